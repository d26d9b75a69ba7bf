"""Lightning Fabric: guard a hand-written Fabric loop without changing its shape.

``FabricGuard(fabric, model, optimizer)`` takes the module and optimizer ``fabric.setup``
returned and watches the loop the user already wrote: each training forward of ``model``
(its inputs and the RNG state before it), each ``fabric.backward`` (the step's loss is the sum
of what was back-propagated, as with ``loss / accumulation_steps``), and the end of the step.
The check runs once per optimizer step, at the first of ``fabric.clip_gradients`` (so a NaN
never reaches its ``error_if_nonfinite``) and ``optimizer.step()``; every rank agrees through
the guard's one collective. A tripped step is replayed for the user, every micro-batch of it
from its own RNG state with communication off, under ``ng.locate``; then the policy applies:
``skip`` makes ``optimizer.step()`` (and a ``scheduler=``'s next ``step()``) do nothing and puts
BatchNorm-style running statistics back, ``rollback`` restores the last snapshot, ``raise``
raises ``ng.NonFiniteError``. Module names are those of the user's model: no Fabric, DDP or
compile wrapper level appears in them.

When the loss is computed outside the model (``loss_fn(model(x), y)``), decorate the function
that computes it with ``@guard.micro_step``; the replay then re-runs it, backward included.
A model that returns its loss (a one-element tensor, a ``"loss"`` entry, or one among the
outputs, as nanoGPT's ``logits, loss``) needs nothing more.

Example:
    >>> from nanguard.integrations.fabric import FabricGuard
    >>> model, optimizer = fabric.setup(model, optimizer)
    >>> guard = FabricGuard(fabric, model, optimizer, policy="skip", run_dir="runs/exp1")
    >>> for i, batch in enumerate(loader):
    ...     with fabric.no_backward_sync(model, enabled=(i + 1) % accum != 0):
    ...         loss = model(batch)
    ...         fabric.backward(loss / accum)
    ...     if (i + 1) % accum == 0:
    ...         fabric.clip_gradients(model, optimizer, max_norm=1.0)
    ...         optimizer.step()                  # skipped when the step tripped
    ...         optimizer.zero_grad()
    >>> guard.close(); guard.skipped, guard.last_diagnosis
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanguard import compat
from nanguard.guard import Guard
from nanguard.guard.fidelity import loss_differs
from nanguard.integrations import guard_options, require
from nanguard.integrations.capture import Micro
from nanguard.integrations.loop import LoopGuard

_fabric = require("lightning.fabric", "lightning", "Lightning Fabric")

__all__ = ["FabricGuard"]

log = logging.getLogger("nanguard")


class FabricGuard(LoopGuard):
    """Checks each optimizer step of a Fabric loop for NaN/Inf, diagnoses a trip, and skips,
    rolls back or raises.

    ``model`` and ``optimizer`` are what ``fabric.setup`` returned; ``policy`` and ``**options``
    are those of ``ng.Guard`` (see ``GuardConfig``). ``mean=False`` when the loop back-propagates
    each micro-batch's loss undivided (the replay divides by the number of micro-batches
    otherwise). ``scheduler`` is left unstepped after a skipped step and is restored by a
    rollback. ``close()`` (or leaving a ``with`` block) ends the run's log and unhooks the loop.
    ``micro_step``, ``last_grad_norm``, ``state_dict`` are ``LoopGuard``'s.

    Example:
        >>> with FabricGuard(fabric, model, optimizer, policy="raise") as guard:
        ...     train(fabric, model, optimizer)
        Traceback (most recent call last):
        nanguard.errors.NonFiniteError: ... data.nonfinite ...
    """

    _rides = False  # Fabric asks for the check in clip_gradients, before its clip: the guard's one all-reduce

    def __init__(
        self,
        fabric: Any,
        model: nn.Module,
        optimizer: Any,
        policy: str = "skip",
        *,
        scheduler: Any = None,
        run_dir: str | Path | None = None,
        mean: bool = True,
        **options: Any,
    ) -> None:
        guard_options(policy, options)
        if not isinstance(fabric, _fabric.Fabric):
            raise ValueError(f"fabric must be a lightning.fabric.Fabric, got {type(fabric).__name__}")
        forward, user = compat.fabric_modules(model)
        if forward is model:
            raise ValueError(
                f"model must be the module fabric.setup(model, optimizer) returned, got a plain {type(model).__name__}"
            )
        inner = compat.fabric_inner_optimizer(optimizer)
        if inner is optimizer:
            raise ValueError(
                "optimizer must be the optimizer fabric.setup(model, optimizer) returned, got a plain "
                f"{type(optimizer).__name__}"
            )
        if getattr(fabric.strategy.precision, "scaler", None) is not None:
            raise ValueError(
                "FabricGuard does not support a precision with a GradScaler (precision='16-mixed') yet; "
                "use precision='bf16-mixed', '32-true' or '64-true'"
            )
        self.fabric = fabric
        self._loss: torch.Tensor | None = None
        self._trained: torch.Tensor | None = None  # the step's, once checked
        self._originals = {"backward": fabric.backward, "clip_gradients": fabric.clip_gradients}
        # The guard sees the strategy's module (DDP: its comm hook and no_sync), names from the user's.
        guard = Guard(forward, inner, policy, scheduler=scheduler, run_dir=run_dir, **options)
        self._watch(model, optimizer, guard, scheduler=scheduler, mean=mean, user=user)
        fabric.backward = self._fabric_backward
        fabric.clip_gradients = self._clip_gradients

    def _unhook(self) -> None:
        for name in self._originals:
            vars(self.fabric).pop(name, None)

    def _fabric_backward(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if not self._capture.replaying and isinstance(tensor, torch.Tensor):
            part = tensor.detach().float().reshape(-1).sum()
            self._loss = part if self._loss is None else self._loss + part
        self._originals["backward"](tensor, *args, **kwargs)

    def _clip_gradients(self, module: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if optimizer is self.optimizer and not self._decide():
            return torch.tensor(float("nan"))  # the skipped step's gradients were dropped: nothing to clip
        return self._originals["clip_gradients"](module, optimizer, *args, **kwargs)

    def _step_loss(self, micro: list[Micro]) -> torch.Tensor | None:
        """What the loop gave ``fabric.backward`` over the step, summed (its own scaling kept)."""
        loss, self._loss = self._loss, None
        self._trained = loss
        return loss if loss is not None else super()._step_loss(micro)

    def _replay(self, micro: list[Micro]) -> list[Any]:
        """``LoopGuard``'s replay; a step whose ``fabric.backward`` was given more than the recorded
        losses (a term added outside the model and ``micro_step``) says the replay did not see it."""
        results = super()._replay(micro)
        n = len(micro) if self.mean else 1
        losses = [r for r in results if isinstance(r, torch.Tensor) and r.numel() == 1 and r.is_floating_point()]
        if self._trained is not None and len(losses) == len(micro):
            with torch.no_grad():
                replayed = torch.stack([r.detach().float().reshape(()) for r in losses]).sum() / n
            loss_differs(self._trained, replayed, " (what fabric.backward was given)")
        return results

    def _backward(self, loss: torch.Tensor) -> None:
        self._originals["backward"](loss, model=self.model)

    def _announces(self) -> bool:
        return bool(self.fabric.is_global_zero)
