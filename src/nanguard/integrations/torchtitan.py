"""torchtitan's trainer guarded in its own loop: FSDP2, tensor parallel (DTensor), pipeline parallel.

torchtitan computes the loss outside the model (``loss_fn(model(inputs), labels, tokens)``), its
default ``ChunkedLossWrapper`` runs the output layer's backward inside the loss and turns that
layer's FSDP gradient sync back on for its last chunk, its loss may be a DTensor, and it steps an
``OptimizersContainer`` and an ``LRSchedulersContainer``. ``TitanGuard`` is ``LoopGuard`` for that
shape: it guards the model part the trainer calls, records each micro-batch's forward inputs and
the loss call's labels, and replays a tripped step as the trainer ran it (model forward, the loss
with its own backward, then backward on the loss), every FSDP gradient sync held off throughout.
Under pipeline parallelism each rank replays its own stage from what it received; the schedule
took the loss function when it was built, so its copy is wrapped too
(``self.pp_schedule._loss_fn = self.guard.loss(self.pp_schedule._loss_fn)``).

The lines to add to torchtitan's ``Trainer`` (``docs/torchtitan.md``):

Example:
    >>> from nanguard.integrations.torchtitan import TitanGuard                # __init__, at its end
    >>> self.guard = TitanGuard(self.model_parts, self.optimizers, self.lr_schedulers,
    ...                         policy="skip", run_dir=config.dump_folder)
    >>> self.loss_fn = self.guard.loss(self.loss_fn)
    >>> if self.guard.step_skipped:                                           # train_step, after
    ...     return                                                            # lr_schedulers.step()
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanguard import dist, environ
from nanguard.guard import Guard
from nanguard.guard.health import Engine
from nanguard.integrations import guard_options
from nanguard.integrations.capture import Micro
from nanguard.integrations.clipnorm import sums_every_rank
from nanguard.integrations.loop import LoopGuard, _local, _scalar

__all__ = ["IGNORE_INDEX", "TitanGuard"]

IGNORE_INDEX = -100
"""The label torchtitan's losses ignore (``torchtitan.components.loss.IGNORE_INDEX``)."""


class TitanGuard(LoopGuard):
    """``LoopGuard`` for torchtitan's ``Trainer``: checks each ``self.optimizers.step()`` and skips,
    rolls back or raises, every rank agreeing; a healthy step reads the norm the trainer's clip reduced.

    ``model_parts`` is the trainer's ``self.model_parts``. Without pipeline parallelism it holds
    one model; under pipeline parallelism, this rank's stage(s): the first is guarded (the one
    that reads the batch on the first stage). ``optimizers`` is the ``OptimizersContainer`` (a
    ``torch.optim.Optimizer``: its ``step`` is checked), ``lr_schedulers`` the
    ``LRSchedulersContainer`` (held after a skipped step, restored by a rollback). ``policy``
    and ``**options`` are ``ng.Guard``'s; ``check_batch=True`` checks each micro-batch's token
    ids and labels before they are used: a bad one on any rank is named (its rank, its key) and
    the step skipped on every rank, never an ``IndexError`` that ends the job.

    A healthy step runs the trainer's forward and backward once: the headroom check (every
    ``headroom_every`` steps, as ``ng.Guard``'s) reads the due step's own forward as it runs.

    ``step_skipped`` says the latest step was skipped: torchtitan's trainer logs the step's loss
    and stops at a non-finite one, so it returns early instead.

    Example:
        >>> guard = TitanGuard(trainer.model_parts, trainer.optimizers, trainer.lr_schedulers)
        >>> trainer.loss_fn = guard.loss(trainer.loss_fn)
    """

    _rides = False  # the trainer's clip norm carries the flags where it can (attach_engine)

    def __init__(
        self,
        model_parts: nn.Module | Sequence[nn.Module],
        optimizers: torch.optim.Optimizer,
        lr_schedulers: Any = None,
        policy: str = "skip",
        *,
        run_dir: str | Path | None = None,
        **options: Any,
    ) -> None:
        parts = [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)
        if not parts or not all(isinstance(p, nn.Module) for p in parts):
            raise ValueError(
                "model_parts must be the trainer's model_parts: an nn.Module or a non-empty list of them, "
                f"got {model_parts!r}"
            )
        if not isinstance(optimizers, torch.optim.Optimizer):
            raise ValueError(
                "optimizers must be the trainer's OptimizersContainer (a torch.optim.Optimizer), "
                f"got {type(optimizers).__name__}"
            )
        if lr_schedulers is not None and not callable(getattr(lr_schedulers, "step", None)):
            raise ValueError(
                f"lr_schedulers must be the trainer's LRSchedulersContainer or None, got {type(lr_schedulers).__name__}"
            )
        guard_options(policy, options)
        model = parts[0]
        self.model_parts = parts
        self._ids_bad: torch.Tensor | None = None  # this micro-batch's token ids past the vocabulary, on the device
        if environ.disabled():  # NANGUARD_DISABLE=1: the trainer as it is, nothing hooked
            self._stay_off(model)
            return
        guard = Guard(model, optimizers, policy, scheduler=lr_schedulers, run_dir=run_dir, **options)
        self._watch(model, optimizers, guard, scheduler=lr_schedulers, mean=False, user=dist.unwrap(model))
        self._vocab = _vocab(self._user)
        # A first pipeline stage computes no loss to carry the flag: check_batch=True covers it there.
        self._computes_loss = _has_lm_head(self._user)
        self._ride_clip(guard, optimizers)

    def _ride_clip(self, guard: Guard, optimizers: torch.optim.Optimizer) -> None:
        """The trainer's clip reduces the grad norm over the whole mesh each step (``dist_utils.clip_grad_norm_``),
        and over the pipeline stages: a healthy step is read from it where that norm sums every rank's own
        gradients (``sums_every_rank``). A stage without the loss carries its check in its output's gradient."""
        pipelined = self._vocab is None or not self._computes_loss  # alike on every rank: no stage holds both
        if sums_every_rank([p for g in optimizers.param_groups for p in g["params"]], pipelined=pipelined):
            guard.attach_engine(Engine(reduces_norm=True))
            stages = [p for p in self.model_parts if not _has_lm_head(dist.unwrap(p))]
            self._hooks += [p.register_forward_hook(self._carry_stage) for p in stages]

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The forward's token ids made valid before the embedding reads them, without a host read: an id
        past the vocabulary would end the job (an ``IndexError`` on one rank, the others hung in FSDP's
        all-gather) or, under tensor parallel, read a zero row silently. The recorded batch keeps the
        original ids; the step's checked loss is made NaN on this rank, so every rank trips and the
        replay names the ids (``data.index_out_of_range``). ``check_batch=True`` checks on the host instead."""
        recorded = len(self._capture.micro)
        fixed = super()._before_forward(module, args, kwargs)
        self._ids_bad = None
        if fixed is not None or self._vocab is None or len(self._capture.micro) == recorded:
            return fixed  # check_batch's own fix, no embedding here (a later pipeline stage), or not a training forward
        if not self._computes_loss or self.guard is None or self.guard.config.check_batch:
            return None
        args, kwargs, self._ids_bad = _valid_tokens(args, kwargs, self._vocab)
        return (args, kwargs) if self._ids_bad is not None else None

    def _carry_stage(self, module: nn.Module, args: Any, output: Any) -> None:
        """A pipeline stage's training forward without the loss: its parameter check rides in the gradient its
        output receives back, into the norm the clip reduces over the stages (``Guard.carry_flags``)."""
        guard = self.guard
        if guard is None or self._capture.replaying or not module.training or not isinstance(output, torch.Tensor):
            return
        guard.carry_flags(output, checked=_local(output).new_zeros((), dtype=torch.float32))

    def _loop_norm(self) -> torch.Tensor | None:
        """The norm torchtitan's clip reduced over the mesh (a plain tensor, the same on every rank), read as
        the step's; a DTensor norm (``torch.nn.utils.clip_grad_norm_`` on DTensor gradients) is not: the
        ranks agree instead."""
        return self._clip.take(reduced=True)

    def _replay(self, micro: list[Micro]) -> list[Any]:
        """The step's micro-batches as the trainer ran them; then, once every rank has run the same
        forwards and collectives, the recorded ids met as a lookup in the whole vocabulary would meet them."""
        results = super()._replay(micro)
        if self._vocab is not None:
            for m in micro:
                _look_up(m.args[0] if m.args else m.kwargs.get("tokens"), self._vocab)
                _look_up(m.extra.get("labels"), self._vocab)
        return results

    def loss(self, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``loss_fn`` (the trainer's ``self.loss_fn``: ``(pred, labels, global_valid_tokens,
        **kwargs) -> (loss, metrics)``), recorded: each training call attaches its labels and
        loss to the micro-batch whose forward made ``pred``, and a trip's replay calls the model
        and ``loss_fn`` again, then backward on the loss, as the trainer does."""
        if not callable(loss_fn):
            raise ValueError(f"loss_fn must be the trainer's loss function, got {type(loss_fn).__name__}")
        if self.guard is None:
            return loss_fn  # NANGUARD_DISABLE=1
        model = self.model

        def recorded(pred: Any, labels: Any, *args: Any, **kwargs: Any) -> Any:
            micro = self._capture.micro
            if self._capture.replaying or not micro or not torch.is_grad_enabled() or not model.training:
                return loss_fn(pred, labels, *args, **kwargs)
            m = micro[-1]
            m.extra["labels"] = labels
            used, bad = self._checked_labels(labels)
            vocab = self._vocab

            @functools.wraps(model.forward)
            def run(*a: Any, **k: Any) -> Any:
                if vocab is not None:  # the ids the trainer's forward got: every rank runs the same collectives
                    a, k = _valid_tokens(a, k, vocab)[:2]
                return _loss_value(loss_fn(model(*a, **k), used, *args, **kwargs))

            m.run = run
            out = loss_fn(pred, used, *args, **kwargs)
            value = _loss_value(out)
            if _scalar(value):
                m.loss = _local(value.detach())
                if bad is not None:  # the check's one read carries it: NaN where an id was past the vocabulary
                    m.loss = m.loss.masked_fill(bad, torch.nan)
                if self.guard is not None and isinstance(pred, torch.Tensor):
                    # On the model's output, not the loss: the chunked loss hands the model its own gradient
                    # whatever its loss's is. Into the clip's reduced norm, on every rank.
                    self.guard.carry_flags(pred, checked=m.loss)
            return out

        return recorded

    def _checked_labels(self, labels: Any) -> tuple[Any, torch.Tensor | None]:
        """The labels the loss is given (ids outside the vocabulary made ignored) and whether this micro-batch's
        token ids or labels were outside it, on the device (None: nothing to check)."""
        bad = self._ids_bad
        if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or self._vocab is None:
            return labels, bad
        used, bad_labels = _valid_labels(labels, self._vocab)
        return used, bad_labels if bad is None else bad | bad_labels


def _has_lm_head(model: nn.Module) -> bool:
    return getattr(model, "lm_head", None) is not None


def _loss_value(out: Any) -> Any:
    """The loss of what a torchtitan loss returns: ``(loss, metrics)``, or the loss alone."""
    return out[0] if isinstance(out, tuple) else out


def _valid_tokens(args: tuple, kwargs: dict[str, Any], vocab: int) -> tuple[tuple, dict[str, Any], torch.Tensor | None]:
    """The forward's arguments with its token ids (``tokens``, the first) past the vocabulary made 0, and
    whether there were any, on the device (no host read); None when there are no integer ids."""
    tokens = args[0] if args else kwargs.get("tokens")
    if not isinstance(tokens, torch.Tensor) or tokens.is_floating_point():
        return args, kwargs, None
    bad = _outside(tokens, vocab)
    valid = tokens.masked_fill(bad, 0)
    fixed = ((valid, *args[1:]), kwargs) if args else (args, {**kwargs, "tokens": valid})
    return fixed[0], fixed[1], bad.any()


def _vocab(model: nn.Module) -> int | None:
    """The vocabulary size: the first embedding's rows (None on a pipeline stage without one)."""
    return next((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), None)


def _valid_labels(labels: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``labels`` with ids outside the vocabulary made ignored (the loss runs on every rank, its
    collectives match), and whether there were any, on the device (no host read)."""
    bad = _outside(labels, vocab) & (labels != IGNORE_INDEX)
    return labels.masked_fill(bad, IGNORE_INDEX), bad.any()


def _outside(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """``ids < 0 or ids >= vocab``, elementwise: two kernels where ``vocab - 1`` fits the ids' dtype (a clamp
    changes exactly those), else no id reaches ``vocab`` and only a negative one is outside."""
    top = torch.iinfo(ids.dtype).max if ids.dtype != torch.bool else 1
    return ids.clamp(0, vocab - 1) != ids if vocab - 1 <= top else ids < 0


def _look_up(ids: Any, vocab: int) -> None:
    """On a replay: look ``ids`` up in a table of ``vocab`` empty rows on the CPU, which raises the
    ``IndexError`` an embedding raises for an id past the vocabulary (the tracer names it, with its
    batch key); on the CPU, never a device-side assert. Ignored labels are left out."""
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point():
        return
    if bool((ids == IGNORE_INDEX).any()):  # a host read, on a trip only
        ids = ids[ids != IGNORE_INDEX]
    torch.nn.functional.embedding(ids.cpu(), torch.empty(vocab, 0))
