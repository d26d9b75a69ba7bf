"""PyTorch Lightning callback: guard every optimizer step of automatic optimization.

Per optimizer step, before ``optimizer.step()`` (in ``on_before_optimizer_step``), the
callback runs ``Guard.check`` on the loss and the gradients; under DDP all ranks agree
through the guard's one collective. A tripped step is replayed (``training_step`` and
backward on the same batch and RNG state) under ``ng.locate`` to name its cause, and the
policy applies: ``skip`` clears the gradients so Lightning's own ``optimizer.step()``
changes neither the weights nor the optimizer state, ``rollback`` restores the last
snapshot, ``raise`` stops ``fit`` with ``ng.NonFiniteError``. A skipped step does not step
the LR schedulers either. Trips and skips go to every logger of the trainer (CSV,
TensorBoard, W&B, ...) as ``nanguard/*`` metrics, and the full diagnosis is printed once (by
global rank 0). ``run_dir`` defaults to ``<trainer.log_dir>/nanguard``.

Example:
    >>> from nanguard.integrations.lightning import NanGuard
    >>> guard_cb = NanGuard(policy="skip", run_dir="runs/exp1")
    >>> trainer = lightning.Trainer(callbacks=[guard_cb], max_steps=1000)
    >>> trainer.fit(model, loader)
    >>> guard_cb.skipped, guard_cb.last_diagnosis
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nanguard import compat, dist, environ
from nanguard.guard import Guard
from nanguard.integrations import GuardedCallback, guard_options, require
from nanguard.integrations.capture import HeldSchedulers, Micro, StepCapture

_pl: Any = require(  # Any: its classes are bases below, known only once imported
    "lightning.pytorch", "lightning", "PyTorch Lightning"
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["NanGuard"]

log = logging.getLogger("nanguard")


class NanGuard(GuardedCallback, _pl.Callback):
    """Checks each optimizer step for NaN/Inf, diagnoses a trip, and skips, rolls back or raises.

    ``policy`` and ``**options`` are those of ``ng.Guard`` (see ``GuardConfig``); ``run_dir``
    receives the per-rank event log and a bundle for each tripped step. Only automatic
    optimization with one optimizer is supported.

    Example:
        >>> cb = NanGuard(policy="skip", max_consecutive_skips=5)
        >>> lightning.Trainer(callbacks=[cb], strategy="ddp", devices=2).fit(model, loader)
        >>> cb.guard.last_diagnosis.cause
        'data.nonfinite'
    """

    def __init__(self, policy: str = "skip", *, run_dir: str | Path | None = None, **options: Any) -> None:
        guard_options(policy, options)
        self.policy = policy
        self.run_dir = run_dir
        self.options = options
        self.guard: Guard | None = None
        self.trips = 0
        self._capture = StepCapture()
        self._loss: torch.Tensor | None = None
        self._state: Mapping[str, Any] | None = None
        self._closed = False
        self._held = HeldSchedulers()  # saved on a skip, put back after Lightning steps them

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise ValueError(
                "NanGuard supports automatic optimization only; with manual optimization call "
                "ng.Guard(...).check(loss, replay=...) in training_step before optimizer.step()"
            )
        if len(trainer.optimizers) != 1:
            raise ValueError(f"NanGuard needs exactly one optimizer, got {len(trainer.optimizers)}")
        self._capture.watch(pl_module)
        default = os.path.join(trainer.log_dir, "nanguard") if trainer.log_dir else None  # log_dir: on every rank
        run_dir = self.run_dir or environ.run_dir(None) or default
        self.guard = Guard(pl_module, trainer.optimizers[0], self.policy, run_dir=run_dir, **self.options)
        if self._state is not None:
            self.guard.load_state_dict(self._state)
            self._state = None
        self._capture.take()
        self._loss, self._closed = None, False

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._capture.record((batch, batch_idx))

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        # Lightning already divided each micro-batch loss by accumulate_grad_batches: the sum is the step's loss.
        loss = loss.detach()
        self._loss = loss if self._loss is None else self._loss + loss
        micro = self._capture.micro
        if micro and micro[-1].loss is None:
            micro[-1].loss = loss  # what this micro-batch back-propagated, for the replay to match

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        micro, loss = self._capture.take(), self._loss
        self._loss = None
        if self.guard is None or loss is None:  # training_step returned None: no backward, nothing to check
            return
        batch = micro[0].args[0] if len(micro) == 1 else [m.args[0] for m in micro]

        def replay() -> list[Any]:
            return _replay(trainer, pl_module, self._capture, micro)

        ok = self._capture.check(
            self.guard,
            loss,
            micro,
            replay=replay,
            batch=batch,
            optimizer=optimizer,
            on_raise=lambda: self._record(trainer),
        )
        if not ok:
            self._held.hold([c.scheduler for c in trainer.lr_scheduler_configs if c.interval == "step"], optimizer)
            self._record(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._held.release()  # Lightning stepped them after the skipped step: put them back
        if self.guard is not None:
            self.guard.after_step()  # a no-op unless this batch ended a checked, stepped update

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()

    def state_dict(self) -> dict[str, Any]:
        if self.guard is not None:
            return self.guard.state_dict()
        return dict(self._state or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks before on_fit_start builds the guard.
        self._state = state_dict
        if self.guard is not None:
            self.guard.load_state_dict(state_dict)
            self._state = None

    def _record(self, trainer: pl.Trainer) -> None:
        guard = self.guard
        assert guard is not None
        if guard.last_action not in ("skip", "rollback", "raise"):
            return  # a batch dropped after a rollback is counted by the guard, not a new trip
        self.trips += 1
        metrics = {
            "nanguard/trips": float(self.trips),
            "nanguard/skipped": float(guard.skipped),
            "nanguard/rollbacks": float(guard.rollbacks),
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _close(self) -> None:
        if self.guard is not None and not self._closed:
            self._closed = True
            self.guard.close()


def _replay(trainer: pl.Trainer, pl_module: pl.LightningModule, capture: StepCapture, micro: list[Micro]) -> list[Any]:
    """Re-run each micro-batch of the step as Lightning ran it: ``training_step``, the module's
    ``backward`` on the loss divided by ``accumulate_grad_batches``, and its ``on_after_backward``.
    Callbacks that touch the gradients after the backward are not re-run: the replay says it did not see them.

    Calling the module directly skips the DDP wrapper, so the replay's gradients stay local to this rank.
    """
    for name in _touching_gradients(trainer):
        dist.unobserved(f"the callback {name}'s on_after_backward, which the replay does not run")

    def run(m: Micro) -> Any:
        with compat.lightning_step_context(trainer):
            out = pl_module.training_step(*m.args)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if loss is None:
            return None
        loss = loss / trainer.accumulate_grad_batches
        pl_module.backward(loss)
        pl_module.on_after_backward()
        return loss

    with compat.lightning_logging_off(pl_module):  # a replay must not log the step a second time
        return capture.replay(pl_module, micro, run)


def _touching_gradients(trainer: pl.Trainer) -> list[str]:
    """The trainer's callbacks (nanguard's aside) with an ``on_after_backward`` of their own."""
    base = _pl.Callback.on_after_backward
    callbacks: list[Any] = getattr(trainer, "callbacks", [])
    return [
        type(c).__name__
        for c in callbacks
        if not isinstance(c, NanGuard) and getattr(type(c), "on_after_backward", base) is not base
    ]
