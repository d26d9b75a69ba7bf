"""Recovery: undo a bad step, keep snapshots to roll back to, and count what the policy did.

``Recovery`` owns the buffer backup taken before each forward, the CPU snapshot of model,
optimizer and scaler (rollback policy), and the counters that bound recovery: skips and
rollbacks in a row, batches to drop after a rollback, GradScaler overflows in a row.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from nanguard.backup import BufferBackup
from nanguard.errors import NonFiniteError
from nanguard.findings import Diagnosis
from nanguard.guard.config import GuardConfig

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

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, scaler: Any, config: GuardConfig) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
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

    # -- one step ------------------------------------------------------------------------
    def abandon(self, restore_buffers: bool) -> None:
        """Undo what the step's forward and backward left: buffers, gradients, the scaler's unscale."""
        if restore_buffers:
            self.buffers.restore()
        self.model.zero_grad(set_to_none=True)
        if self.scaler is not None:
            # unscale_ already ran for this step: update() closes it, or the next unscale_ raises.
            self.scaler.update()

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

    def overflow(self) -> float:
        """A GradScaler overflow step: the scaler skips the update itself and lowers its
        scale; count it and return the new scale."""
        assert self.scaler is not None
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.overflows += 1
        self.overflow_streak += 1
        return float(self.scaler.get_scale())

    # -- the policy ----------------------------------------------------------------------
    def policy_for(self, diag: Diagnosis) -> str:
        """The action for ``diag``: the configured policy, unless the bad update already
        happened, which a skip cannot undo (only a snapshot can)."""
        policy = self.config.policy
        update_done = diag.cause == "optimizer.nonfinite_update" or diag.phase == "optimizer"
        if update_done and policy == "skip":
            return "rollback" if self.snapshot is not None else "raise"
        return policy

    def skip(self) -> None:
        self.skipped += 1

    def rollback(self, diag: Diagnosis) -> int:
        """Restore the last snapshot and drop the next ``rollback_skip_batches`` batches;
        returns the step the snapshot was taken at."""
        if self.snapshot is None:
            raise NonFiniteError(diag, f"{diag}\n(no snapshot to roll back to)")
        snap = self.snapshot
        self.model.load_state_dict(snap["model"])
        self.optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))
        if self.scaler is not None and snap["scaler"] is not None:
            self.scaler.load_state_dict(snap["scaler"])
        self.model.zero_grad(set_to_none=True)
        self.rollbacks += 1
        self.drop_batches = self.config.rollback_skip_batches
        return int(snap["step"])

    def count_in_a_row(self, diag: Diagnosis | None) -> None:
        """Skips and rollbacks in a row without a good step: past the limit, stop the run."""
        self.consecutive_skips += 1
        limit = self.config.max_consecutive_skips
        if self.consecutive_skips >= limit:
            raise NonFiniteError(
                diag,
                f"{self.consecutive_skips} steps skipped in a row (max_consecutive_skips={limit})"
                + (f"; last: {diag.summary()}" if diag else ""),
            )

    # -- snapshots and state -------------------------------------------------------------
    def take_snapshot(self, step: int) -> None:
        self.snapshot = {
            "step": step,
            "model": {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()},
            "optimizer": _to_cpu(copy.deepcopy(self.optimizer.state_dict())),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def snapshot_if_due(self, step: int) -> None:
        """Under the rollback and auto policies, snapshot every ``snapshot_every`` good steps."""
        if self.config.policy in ("rollback", "auto") and self.good_steps % self.config.snapshot_every == 0:
            self.take_snapshot(step)

    def state_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in COUNTERS}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name in COUNTERS:
            setattr(self, name, int(state.get(name, 0)))


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj
