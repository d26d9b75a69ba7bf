"""Recovery: undo a bad step, keep snapshots to roll back to, and count what the policy did.

``Recovery`` owns the buffer backup taken before each forward, the CPU snapshot of model,
optimizer, scaler and LR scheduler (rollback policy), and the counters that bound recovery:
skips and rollbacks in a row, batches to drop after a rollback, GradScaler overflows in a row.
What to do with them is the policy's (``nanguard.guard.policy``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from nanguard import dist
from nanguard.backup import BufferBackup
from nanguard.errors import NonFiniteError
from nanguard.findings import Diagnosis
from nanguard.guard.config import GuardConfig
from nanguard.guard.optim_state import load_optimizer_state, optimizer_state
from nanguard.rng import set_rng_state
from nanguard.stats import local

__all__ = ["COUNTERS", "Recovery"]

COUNTERS = ("skipped", "rollbacks", "overflows", "consecutive_skips", "overflow_streak")
"""The counters a ``Recovery`` keeps; ``Guard.state_dict`` carries them."""


class Recovery:
    """Undoes bad steps and bounds how many happen in a row.

    Example:
        >>> recovery = Recovery(model, optimizer, scaler=None, config=GuardConfig(policy="rollback"))
        >>> recovery.take_snapshot(step=0)
        >>> recovery.rollback(diag)   # model and optimizer as they were at step 0
        0
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scaler: Any,
        config: GuardConfig,
        scheduler: Any = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.scheduler = scheduler
        self.config = config
        self.buffers = BufferBackup(list(model.buffers()))
        self.snapshot: dict[str, Any] | None = None
        self.skipped = 0
        self.rollbacks = 0
        self.overflows = 0
        self.consecutive_skips = 0
        self.overflow_streak = 0
        self.good_steps = 0
        self.drop_batches = 0
        self.held_since: int | None = None
        """The step from which snapshot refreshes are held while the run grows; None when none is."""
        self.snapshot_loss: float | None = None
        """The loss of the last step before the snapshot was taken (None: not known)."""

    # -- one step ------------------------------------------------------------------------
    def abandon(self, restore_buffers: bool, rng: dict[str, torch.Tensor] | None = None) -> None:
        """Undo what the step's forward and backward left: gradients, the scaler's unscale and,
        when the guard owns the step (``restore_buffers``), buffers and the RNG state from
        before the forward, so the next batch draws the random numbers the abandoned one did."""
        if restore_buffers:
            self.buffers.restore()
            if rng is not None:
                set_rng_state(rng)
        dist.zero_grad(self.model)
        if self.scaler is not None:
            # unscale_ already ran for this step: update() closes it, or the next unscale_ raises.
            self.scaler.update()

    def undo(self, rng: dict[str, torch.Tensor], *, unscaled: bool) -> None:
        """The closure or a replay raised: put back buffers and RNG, drop the step's gradients,
        and close the scaler's ``unscale_`` (when it ran) with the scale as it was."""
        self.buffers.restore()
        set_rng_state(rng)
        dist.zero_grad(self.model)
        if self.scaler is not None and unscaled:
            scale = self.scaler.state_dict()
            with contextlib.suppress(AssertionError, RuntimeError):  # already closed by abandon()
                self.scaler.update()
            self.scaler.load_state_dict(scale)

    def take_drop(self) -> bool:
        """True when this call's batch is to be dropped (one of the batches after a rollback)."""
        if self.drop_batches <= 0:
            return False
        self.drop_batches -= 1
        return True

    def good_step(self) -> int:
        """Count a finished update; returns the number of good steps so far."""
        self.good_steps += 1
        self.consecutive_skips = 0
        self.overflow_streak = 0
        return self.good_steps

    def count_overflow(self) -> None:
        """A GradScaler overflow step (the scaler skipped the update itself and lowered its scale)."""
        self.overflows += 1
        self.overflow_streak += 1

    def reset_overflow_streak(self) -> None:
        """The scale was reset: the streak starts again."""
        self.overflow_streak = 0

    def skip(self) -> None:
        self.skipped += 1

    def count_in_a_row(self) -> None:
        """A skip or rollback without a good step since the last one."""
        self.consecutive_skips += 1

    def rollback(self, diag: Diagnosis) -> int:
        """Restore the last snapshot and drop the next ``rollback_skip_batches`` batches;
        returns the step the snapshot was taken at (``why_restored`` says why that one)."""
        if self.snapshot is None:
            raise NonFiniteError(diag, f"{diag}\n(no snapshot to roll back to)")
        snap = self.snapshot
        self.model.load_state_dict(snap["model"])
        # A copy: the optimizer may keep CPU tensors it is given, and the snapshot is refreshed in place.
        load_optimizer_state(self.optimizer, copy.deepcopy(snap["optimizer"]))
        if self.scaler is not None and snap["scaler"] is not None:
            self.scaler.load_state_dict(snap["scaler"])
        if self.scheduler is not None and snap["scheduler"] is not None:
            self.scheduler.load_state_dict(copy.deepcopy(snap["scheduler"]))
        dist.zero_grad(self.model)
        self.rollbacks += 1
        self.drop_batches = self.config.rollback_skip_batches
        return int(snap["step"])

    def why_restored(self) -> str:
        """Why the rollback target is the snapshot it is, for the rollback event."""
        assert self.snapshot is not None
        step = self.snapshot["step"]
        if self.held_since is None:
            return f"the last snapshot, taken at step {step}"
        return (
            f"the last snapshot before the loss or grad norm began to grow, taken at step {step} "
            f"(refreshes held from step {self.held_since})"
        )

    # -- snapshots and state -------------------------------------------------------------
    def take_snapshot(self, step: int) -> None:
        """Copy model, optimizer, scaler and scheduler state to the CPU.

        A refresh copies into the previous snapshot's tensors where shapes and dtypes match,
        so it holds one snapshot's memory, not two.
        """
        old = self.snapshot or {}
        self.held_since = None
        self.snapshot = None  # a refresh that fails midway leaves no half-new snapshot
        self.snapshot = {
            "step": step,
            "model": _copy_to_cpu(self.model.state_dict(), old.get("model")),
            "optimizer": _copy_to_cpu(optimizer_state(self.optimizer), old.get("optimizer")),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "scheduler": copy.deepcopy(self.scheduler.state_dict()) if self.scheduler is not None else None,
        }

    def snapshot_if_due(
        self, step: int, loss: float, growing: Callable[[float | None], bool], *, joined: bool = False
    ) -> None:
        """Under the rollback and auto policies, snapshot every ``snapshot_every`` good steps, but
        not while the run grows (``growing(loss when the last snapshot was taken)``): a rollback
        for divergence must land before the growth, not on weights already on their way out.

        Nor of a state that is not finite: the update's own parameter check is read only with the
        next step, so a snapshot could copy a NaN the update (or a fault outside the forward's reach,
        such as an embedding row no batch used) just wrote, and every rollback would restore it; the
        next step trips and rolls back to the last good one. Ranks agree (one tiny all-reduce per
        snapshot), so every replica keeps a snapshot of the same step; none is taken while a rank
        has joined (``joined``: DDP ``join()``), which could not take part.
        """
        if self.config.policy not in ("rollback", "auto") or self.good_steps % self.config.snapshot_every:
            return
        if growing(self.snapshot_loss):
            if self.held_since is None:
                self.held_since = step
            return
        if joined:
            return  # a rank that joined (DDP join(), out of batches) cannot take part in the agreement
        finite = _finite(self.model.state_dict()) and _finite(optimizer_state(self.optimizer))
        if dist.agree_flag(not finite):
            return
        self.take_snapshot(step)
        self.snapshot_loss = loss

    def state_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in COUNTERS}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name in COUNTERS:
            setattr(self, name, int(state.get(name, 0)))


def _finite(obj: Any) -> bool:
    """Are all floating-point tensors in ``obj`` (dicts, lists, tuples) finite? One host read."""
    found: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            if x.is_floating_point() and x.numel():
                found.append(torch.isfinite(local(x).detach()).all())
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(obj)
    return not found or bool(torch.stack([f.to(found[0].device) for f in found]).all())


def _copy_to_cpu(obj: Any, into: Any) -> Any:
    """A CPU copy of ``obj`` (tensors in dicts, lists and tuples), written into the tensors of
    ``into`` (a previous copy) where they match, allocating only what is new."""
    if isinstance(obj, torch.Tensor):
        src = obj.detach()
        if isinstance(into, torch.Tensor) and into.shape == src.shape and into.dtype == src.dtype:
            return into.copy_(src)
        return src.to("cpu", copy=True)
    if isinstance(obj, dict):
        old = into if isinstance(into, dict) else {}
        return {k: _copy_to_cpu(v, old.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        olds = into if isinstance(into, type(obj)) and len(into) == len(obj) else [None] * len(obj)
        return type(obj)(_copy_to_cpu(v, o) for v, o in zip(obj, olds, strict=True))
    return copy.deepcopy(obj)
