"""The loss a Hugging Face ``Trainer`` back-propagates, whatever computes it: recorded, and replayed the same way.

The Trainer (and every trainer built on it: TRL's SFT, DPO, GRPO...) computes each micro-batch's
loss in ``compute_loss`` (the model's own loss, a ``compute_loss_func``, a ``loss_type``, a subclass's
override), scales it in ``training_step`` and hands it to ``accelerator.backward``. ``TrainerLoss``
wraps the running trainer's two bound methods (instance attributes, removed again by ``remove``):
``compute_loss`` records each training call's inputs, RNG state and autocast, and ``training_step``
the loss it returned, which is the scaled loss it back-propagated and added to its logged loss.
A trip's replay calls the same bound ``compute_loss`` on the same inputs (a DPO trainer's reference
log-probs are computed again too), scales it as ``training_step`` did and calls
``accelerator.backward``. A ``training_step`` of the user's own that does more than that is said to
be unobserved, as is one that never calls ``compute_loss``: the replay could not run it.

Example:
    >>> loss = TrainerLoss(trainer, capture)
    >>> trainer.train()                     # each micro-batch recorded into capture
    >>> micro = capture.take()
    >>> step_loss(micro), loss.replay(model, micro)
    >>> loss.remove()
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from nanguard import compat, dist
from nanguard.integrations.capture import Micro, StepCapture

__all__ = ["EngineLoss", "TrainerLoss", "batch_of", "step_loss"]

_TRUSTED = ("transformers.", "trl.")
"""Packages whose ``training_step`` overrides only wrap the Trainer's (contexts, timers, metrics)."""


class TrainerLoss:
    """Records the loss ``trainer`` trains on, micro-batch by micro-batch, into ``capture``.

    Example:
        >>> TrainerLoss(trainer, capture).remove()
    """

    def __init__(self, trainer: Any, capture: StepCapture) -> None:
        self.trainer = trainer
        self.capture = capture
        self._originals: dict[str, Any] = {}
        self._inside = False
        self._gap = _own_training_step(trainer)
        self.carry: Callable[[torch.Tensor], None] | None = None
        """Called with each training ``compute_loss``'s loss before its backward (``Guard.carry_flags``)."""
        for name, wrapper in (("compute_loss", self._compute_loss), ("training_step", self._training_step)):
            self._originals[name] = getattr(trainer, name)
            setattr(trainer, name, wrapper)

    def remove(self) -> None:
        """Give the trainer its own methods back."""
        for name in self._originals:
            vars(self.trainer).pop(name, None)
        self._originals = {}

    # -- recording -----------------------------------------------------------------------
    def _training_step(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        step = self._originals["training_step"]
        if self.capture.replaying or not torch.is_grad_enabled():
            return step(model, inputs, *args, **kwargs)
        before = len(self.capture.micro)
        loss = step(model, inputs, *args, **kwargs)
        mine = self.capture.micro[before:]
        if not mine:  # a training_step of the user's that never calls compute_loss: nothing to replay
            m = self.capture.record((), {})
            if m is None:
                return loss
            mine = [m]
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            mine[-1].loss = loss.detach()  # the scaled loss it back-propagated, as the Trainer logs it
        return loss

    def _compute_loss(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        compute = self._originals["compute_loss"]
        if self._inside or self.capture.replaying or not torch.is_grad_enabled() or not model.training:
            return compute(model, inputs, *args, **kwargs)  # evaluation, generation, a nested call
        recorded = dict(inputs) if isinstance(inputs, Mapping) else inputs  # compute_loss may pop or add keys
        m = self.capture.record((model, recorded), kwargs)
        if m is not None:
            m.run = self._rerun(args, kwargs)
        self._inside = True
        try:
            out = compute(model, inputs, *args, **kwargs)
        finally:
            self._inside = False
        loss = out[0] if isinstance(out, tuple) else out
        if self.carry is not None and isinstance(loss, torch.Tensor) and loss.requires_grad:
            self.carry(loss)  # its backward seeded with NaN when this rank's loss is non-finite, else 1.0
        return out

    def _rerun(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[..., Any]:
        """The micro-batch's loss as ``training_step`` back-propagated it: ``compute_loss`` in its
        context, averaged over GPUs and divided for accumulation as it was then."""
        trainer = self.trainer
        mean, divisor = compat.hf_loss_scaling(trainer, kwargs.get("num_items_in_batch"))
        compute = self._originals["compute_loss"]

        def run(model: nn.Module, inputs: Any) -> Any:
            with trainer.compute_loss_context_manager():
                out = compute(model, dict(inputs) if isinstance(inputs, Mapping) else inputs, *args, **kwargs)
            loss = out[0] if isinstance(out, tuple) else out
            if mean:
                loss = loss.mean()
            return loss / divisor if divisor != 1 else loss

        return run

    # -- the replay ----------------------------------------------------------------------
    def replay(self, model: nn.Module, micro: list[Micro]) -> list[Any]:
        """Each micro-batch's loss computed and back-propagated as the Trainer did."""
        if self._gap:
            dist.unobserved(self._gap)
        accelerator = self.trainer.accelerator

        def run(m: Micro) -> Any:
            if m.run is None:
                dist.unobserved("the loss of a training_step that does not call compute_loss")
                return None
            with StepCapture.precision(m):
                loss = m.run(*m.args)
            if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                dist.unobserved("the backward (compute_loss returned no loss with a gradient)")
                return loss
            accelerator.backward(loss)
            return loss

        return self.capture.replay(model, micro, run)


def step_loss(micro: list[Micro]) -> torch.Tensor | None:
    """The step's loss as the Trainer logs it: the sum of the losses its ``training_step`` calls
    back-propagated; None (the gradients alone decide) when none is known."""
    losses = [m.loss.float().reshape(()) for m in micro if m.loss is not None]
    return torch.stack(losses).sum() if losses else None


def batch_of(micro: list[Micro]) -> Any:
    """The step's inputs as the diagnosis names them (``batch['input_ids']``), one entry per micro-batch."""
    batches = [m.args[1] for m in micro if len(m.args) > 1]
    if not batches:
        return None
    return batches[0] if len(batches) == 1 else batches


def _own_training_step(trainer: Any) -> str | None:
    """What the replay cannot run: a ``training_step`` override of the user's own, which may do more
    than ``compute_loss`` and the backward (None for the Trainer's and the trusted packages')."""
    for cls in type(trainer).__mro__:
        if "training_step" in vars(cls):
            if cls.__module__.startswith(_TRUSTED):
                return None
            return f"what {cls.__qualname__}.training_step does besides compute_loss and the backward"
    return None


class EngineLoss:
    """Under DeepSpeed the engine's guard records and replays the step; this hands it the trainer's
    ``compute_loss`` as the micro-step it records (``LoopGuard.micro_step``), so a trip's replay
    computes the loss the Trainer back-propagated, not only the model's own.

    Example:
        >>> EngineLoss(trainer, engine_guard.micro_step).remove()
    """

    def __init__(self, trainer: Any, micro_step: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        self.trainer = trainer
        original = trainer.compute_loss

        def compute_loss(model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            # A copy each call: compute_loss may pop the labels out of the dict the replay reads again.
            return original(model, dict(inputs) if isinstance(inputs, Mapping) else inputs, *args, **kwargs)

        trainer.compute_loss = micro_step(compute_loss)

    def remove(self) -> None:
        vars(self.trainer).pop("compute_loss", None)
