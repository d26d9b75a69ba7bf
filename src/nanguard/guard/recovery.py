"""Recovery: undo a bad step, keep snapshots to roll back to, and count what the policy did.

``Recovery`` owns the buffer backup taken before each forward, the CPU snapshot of model,
optimizer, scaler and LR scheduler (rollback policy), and the counters that bound recovery:
skips and rollbacks in a row, batches to drop after a rollback, GradScaler overflows in a row.
What to do with them is the policy's (``nanguard.guard.policy``).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from nanguard import dist
from nanguard.backup import BufferBackup
from nanguard.findings import Diagnosis
from nanguard.guard.config import GuardConfig
from nanguard.guard.optim_state import group_settings, load_optimizer_state, optimizer_state, set_group_settings
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
        self._slots: list[dict[str, Any] | None] = []  # the snapshots kept, by slot (``take_snapshot``)
        self._taken = 0  # snapshots taken: which slot the next one refreshes
        self.skipped = 0
        self.rollbacks = 0
        self.overflows = 0
        self.consecutive_skips = 0
        self.overflow_streak = 0
        self.good_steps = 0
        self.drop_batches = 0
        self.held_since: int | None = None
        """The step from which snapshot refreshes are held while the run grows; None when none is."""
        self.scheduler_pending: dict[str, Any] | None = None
        """The newest snapshot, until the guard's next call records the scheduler in it (``settle_scheduler``)."""
        self.snapshot_loss: float | None = None
        """The loss of the last step before the newest snapshot was taken (None: not known)."""
        self.engine_tensors: Callable[[], list[torch.Tensor]] | None = None
        """Tensors an engine keeps outside the model's and the optimizer's state dicts (DeepSpeed ZeRO's
        fp32 partitions): copied with each snapshot and written back by a rollback."""
        self.engine_holds_parameters = False
        """The engine restores the parameters from ``engine_tensors`` (DeepSpeed ZeRO-3, whose module
        holds only what it gathered): snapshots keep the model's buffers alone."""

    @property
    def snapshots(self) -> list[dict[str, Any]]:
        """The snapshots kept, at doubling ages (``take_snapshot``), oldest step first."""
        return sorted((snap for snap in self._slots if snap is not None), key=lambda snap: int(snap["step"]))

    @property
    def snapshot(self) -> dict[str, Any] | None:
        """The newest snapshot, None when none is kept; setting None drops them all."""
        return self.snapshots[-1] if self.snapshots else None

    @snapshot.setter
    def snapshot(self, value: dict[str, Any] | None) -> None:
        if value is not None:
            raise ValueError("Recovery.snapshot can only be set to None (drop every snapshot)")
        self._slots.clear()

    # -- one step ------------------------------------------------------------------------
    def abandon(self, restore_buffers: bool, rng: Mapping[str, torch.Tensor] | None = None) -> None:
        """Undo what the step's forward and backward left: gradients, the scaler's unscale and,
        when the guard owns the step (``restore_buffers``), buffers and the RNG state from
        before the forward, so the next batch draws the random numbers the abandoned one did."""
        if restore_buffers:
            self.buffers.restore()
            if rng is not None:
                set_rng_state(rng)
        dist.zero_grad(self.model)
        if self.scaler is not None:
            # unscale_ already ran for this step: update() closes it, or the next unscale_ raises. The
            # scale is put back: an abandoned batch is no overflow, the run goes on as if it never came.
            scale = self.scaler.state_dict()
            self.scaler.update()
            self.scaler.load_state_dict(scale)

    def undo(self, rng: Mapping[str, torch.Tensor], *, unscaled: bool) -> None:
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

    def target(self, onset: int | None = None) -> dict[str, Any] | None:
        """The snapshot a rollback restores: the newest taken at or before ``onset`` (the step a
        steady growth began at, ``History.onset``), else the oldest kept; the newest without one."""
        if not self.snapshots:
            return None
        if onset is None:
            return self.snapshots[-1]
        before = [snap for snap in self.snapshots if snap["step"] <= onset]
        return before[-1] if before else self.snapshots[0]

    def rollback(self, diag: Diagnosis, onset: int | None = None) -> int:
        """Restore the snapshot ``target(onset)`` names, drop the newer ones (taken on the way out)
        and the next ``rollback_skip_batches`` batches; returns the step the snapshot was taken at
        (``why_restored`` says why that one)."""
        snap = self.target(onset)
        assert snap is not None, "the policy rolls back only with a snapshot to roll back to"
        self._slots = [s if s is None or s["step"] <= snap["step"] else None for s in self._slots]
        self.snapshot_loss = snap["loss"]
        self.model.load_state_dict(snap["model"], strict=not self.engine_holds_parameters)
        # A copy: the optimizer may keep CPU tensors it is given, and the snapshot is refreshed in place.
        load_optimizer_state(self.optimizer, copy.deepcopy(snap["optimizer"]))
        if self.scaler is not None and snap["scaler"] is not None:
            self.scaler.load_state_dict(snap["scaler"])
        if self.scheduler is not None and snap["scheduler"] is not None:
            self.scheduler.load_state_dict(copy.deepcopy(snap["scheduler"]))
            if snap.get("groups") is not None:
                set_group_settings(self.optimizer, snap["groups"])
        if self.engine_tensors is not None and snap.get("engine") is not None:
            with torch.no_grad():
                for tensor, saved in zip(self.engine_tensors(), snap["engine"], strict=True):
                    tensor.copy_(saved)
        dist.zero_grad(self.model)
        self.rollbacks += 1
        self.drop_batches = self.config.rollback_skip_batches
        return int(snap["step"])

    def _model_state(self) -> dict[str, Any]:
        state = self.model.state_dict()
        if self.engine_holds_parameters:
            params = {name for name, _ in self.model.named_parameters()}
            state = {name: value for name, value in state.items() if name not in params}
        return state

    def why_restored(self, onset: int | None = None) -> str:
        """Why the rollback target is the snapshot it is, for the rollback event."""
        snap = self.target(onset)
        assert snap is not None
        step = snap["step"]
        if onset is not None:
            where = "the last snapshot" if step <= onset else "the oldest snapshot kept"
            return f"{where} before the loss or grad norm began to grow at step {onset}, taken at step {step}"
        if self.held_since is None:
            return f"the last snapshot, taken at step {step}"
        return (
            f"the last snapshot before the loss or grad norm began to grow, taken at step {step} "
            f"(refreshes held from step {self.held_since})"
        )

    # -- snapshots and state -------------------------------------------------------------
    def take_snapshot(self, step: int, loss: float | None = None) -> None:
        """Copy model, optimizer, scaler and scheduler state to the CPU.

        Up to ``config.snapshots`` are kept, at doubling ages: the n-th snapshot refreshes slot
        ``min(trailing zeros of n, snapshots - 1)``, so slot 0 is refreshed every time, slot 1 every
        second time, slot 2 every fourth... (a snapshot of the same step refreshes that one). A
        refresh copies into the replaced snapshot's tensors where shapes and dtypes match, so each
        slot holds one snapshot's memory; a new slot is added only while the host's available
        memory holds four more snapshots.
        """
        self.held_since = None
        slot = self._slot(step)
        old, self._slots[slot] = self._slots[slot] or {}, None  # a refresh that fails midway leaves none half-new
        if loss is None:
            loss = old.get("loss") if old.get("step") == step else None
        self._slots[slot] = {
            "step": step,
            "loss": loss,
            "model": _copy_to_cpu(self._model_state(), old.get("model")),
            "optimizer": _copy_to_cpu(optimizer_state(self.optimizer), old.get("optimizer")),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "scheduler": copy.deepcopy(self.scheduler.state_dict()) if self.scheduler is not None else None,
            "engine": _copy_to_cpu(self.engine_tensors(), old.get("engine")) if self.engine_tensors else None,
        }
        self.snapshot_loss = loss
        self.scheduler_pending = self._slots[slot] if self.scheduler is not None else None

    def settle_scheduler(self) -> None:
        """At the guard's first call after a snapshot: record the scheduler in it as the loop left it for the
        next update. A loop steps its scheduler after ``optimizer.step()``, after the snapshot of that update
        was taken: a rollback restores the scheduler with that step in, as the run had it when the snapshot's
        update was done (not one step behind)."""
        snap, self.scheduler_pending = self.scheduler_pending, None
        if snap is None or self.scheduler is None:
            return
        try:
            state, groups = copy.deepcopy(self.scheduler.state_dict()), group_settings(self.optimizer)
        except Exception as err:  # never worth the run: the snapshot keeps the scheduler as it was taken
            warnings.warn(f"nanguard: the scheduler after step {snap['step']} was not kept: {err!r}", stacklevel=3)
            return
        snap["scheduler"], snap["groups"] = state, groups  # the LR (and momentum...) the scheduler set

    def _slot(self, step: int) -> int:
        """The slot a snapshot of ``step`` goes to: the one of the same step, else the next in the
        doubling-age rotation; a slot not yet allocated only while every rank's host has available memory
        for four more snapshots (else the newest snapshot's slot is refreshed; one small all-reduce, at most
        ``snapshots - 1`` times a run)."""
        held = [i for i, snap in enumerate(self._slots) if snap is not None]
        for i in held:
            if self._slots[i]["step"] == step:  # type: ignore[index]
                return i
        slot = _trailing_zeros(self._taken, self.config.snapshots - 1)
        self._taken += 1
        self._slots.extend([None] * (slot + 1 - len(self._slots)))
        if self._slots[slot] is None and held:
            newest = max(held, key=lambda i: int(self._slots[i]["step"]))  # type: ignore[index]
            free = _available_memory()
            short = free is not None and 4 * _nbytes(self._slots[newest]) > free
            # Every rank must keep the same slots, or a rollback would restore another step on each.
            if dist.agree_flag(short):
                return newest
        return slot

    def refresh_snapshot(
        self, step: int, loss: float, growing: Callable[[float | None], bool], *, joined: bool = False
    ) -> None:
        """Snapshot again, when the policy says one is due (``Policy.due``), but not while
        the run grows (``growing(loss when the last snapshot was taken)``): a rollback for divergence
        must land before the growth, not on weights already on their way out.

        Nor of a state that is not finite: the update's own parameter check is read only with the
        next step, so a snapshot could copy a NaN the update (or a fault outside the forward's reach,
        such as an embedding row no batch used) just wrote, and every rollback would restore it; the
        next step trips and rolls back to the last good one. Ranks agree (one tiny all-reduce per
        snapshot), so every replica keeps a snapshot of the same step; none is taken while a rank
        has joined (``joined``: DDP ``join()``), which could not take part.
        """
        if growing(self.snapshot_loss):
            if self.held_since is None:
                self.held_since = step
            return
        if joined:
            return  # a rank that joined (DDP join(), out of batches) cannot take part in the agreement
        engine = self.engine_tensors() if self.engine_tensors is not None else []
        finite = _finite(self.model.state_dict()) and _finite(optimizer_state(self.optimizer)) and _finite(engine)
        if dist.agree_flag(not finite):
            return
        self.take_snapshot(step, loss)

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


def _trailing_zeros(n: int, cap: int) -> int:
    """How many times 2 divides ``n``, at most ``cap`` (``cap`` for 0: the first snapshot takes the
    slot refreshed least often)."""
    if n == 0:
        return cap
    return min((n & -n).bit_length() - 1, cap)


def _nbytes(obj: Any) -> int:
    """Bytes held by the tensors in ``obj`` (dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _available_memory() -> int | None:
    """The host's available memory in bytes (Linux ``MemAvailable``), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


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
