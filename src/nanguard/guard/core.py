"""``Guard``: the coordinator. Each step it asks its parts in order: health (measure, agree,
read once), then the decision, then recovery, history and the recorder.

See the package docstring for the host and device paths.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanguard import compat, dist, environ
from nanguard.diagnose import loss_scale_collapse, replica_divergence
from nanguard.errors import NonFiniteError
from nanguard.findings import Diagnosis
from nanguard.guard.config import GuardConfig
from nanguard.guard.health import HealthCheck, HealthFlag, StepHealth
from nanguard.guard.history import History
from nanguard.guard.recorder import recorder_for
from nanguard.guard.recovery import Recovery
from nanguard.guard.replay import Diagnoser
from nanguard.rng import get_rng_state
from nanguard.spikes import SpikeDetector
from nanguard.stats import local

__all__ = ["Guard"]

log = logging.getLogger("nanguard")


class Guard:
    """Guards each optimizer step: detect, diagnose, and skip, roll back or raise.

    ``closure`` follows the ``torch.optim`` convention: it zeroes the gradients, runs
    forward and backward, and returns the loss. With a ``torch.amp.GradScaler`` pass it
    as ``scaler=`` and call ``scaler.scale(loss).backward()`` in the closure; the guard
    unscales, steps and updates the scaler.

    Example:
        >>> guard = ng.Guard(model, optimizer, policy="skip", run_dir="runs/exp1")
        >>> for batch in loader:
        ...     def closure():
        ...         optimizer.zero_grad()
        ...         loss = model(**batch).loss
        ...         loss.backward()
        ...         return loss
        ...     loss = guard.step(closure, batch=batch)   # None when the step was skipped
        >>> guard.skipped, guard.last_diagnosis

    After a rollback, the next ``rollback_skip_batches`` calls to ``step`` drop their batch
    without running the closure and return None; ``guard.last_action`` is then
    ``"drop_batch"``, so the loop knows which batches were skipped.

    Pass ``batch=`` to ``step``: a trip's replay names the input that held the bad values
    (``batch['pixel_values']``), a repro bundle stores it, and ``check_batch=True`` audits
    it before the forward. Under DDP the guard wraps the model's comm hook to see each
    rank's own gradients before averaging; a custom hook goes in as ``comm_hook=(state,
    hook)``. ``on_event=fn`` gets each recorded event as a dict (see ``integrations.scalars``);
    every other option is a ``GuardConfig`` field.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        policy: str = "skip",
        *,
        scaler: Any = None,
        run_dir: str | Path | None = None,
        comm_hook: tuple[Any, Callable[..., Any]] | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        **config: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        c = self.config = GuardConfig.from_options(environ.policy(policy), config)
        self.disabled = environ.disabled()  # NANGUARD_DISABLE=1: a plain optimizer step, no files
        run_dir = None if self.disabled else environ.run_dir(run_dir)
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.rank = dist.rank()
        self.step_count = 0
        self.last_diagnosis: Diagnosis | None = None
        self.last_action: str | None = None
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        self.health = HealthCheck(self._params, scaler=self.scaler, comm=dist.watch_communication(model, comm_hook),
                                  param_check_every=c.param_check_every)  # fmt: skip
        self.recovery = Recovery(model, optimizer, scaler=self.scaler, config=c)
        self.history = History.from_config(c)
        self.diagnoser = Diagnoser(model, optimizer, self.history, locate=c.locate, module_stats=c.module_stats)
        self.recorder = recorder_for(run_dir, rank=self.rank, max_bundle_bytes=c.max_bundle_bytes)
        self.recorder.listener = _listener(on_event, self.disabled)
        # Only the GPUs this model lives on draw random numbers for its step.
        self._cuda_devices = sorted({p.device.index or 0 for p in self._params if p.device.type == "cuda"})
        self._fused = compat.supports_found_inf(optimizer)
        self._sharded = any(local(p) is not p for p in self._params)  # FSDP2: each rank holds a shard
        self._closure_error: BaseException | None = None
        self._pending: StepHealth | None = None
        self._health_now: StepHealth | None = None  # this step's, once read
        self.recorder.start(asdict(c), dist.world_size(), "device" if self._fused else "host")
        if c.policy == "rollback":
            self.recovery.take_snapshot(self.step_count)

    # Counters owned by the parts, read where users always found them.
    skipped = property(lambda self: self.recovery.skipped, doc="How many steps were skipped.")
    rollbacks = property(lambda self: self.recovery.rollbacks, doc="How many rollbacks ran.")
    overflows = property(lambda self: self.recovery.overflows, doc="GradScaler overflow steps.")
    consecutive_skips = property(lambda self: self.recovery.consecutive_skips, doc="Skips and rollbacks in a row.")
    overflow_streak = property(lambda self: self.recovery.overflow_streak, doc="Overflow steps in a row.")
    spikes = property(lambda self: self.history.spikes, doc="Loss and grad-norm spikes seen.")

    @property
    def loss_spikes(self) -> SpikeDetector:
        return self.history.loss_spikes

    @property
    def grad_spikes(self) -> SpikeDetector:
        return self.history.grad_spikes

    # -- the step ------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any], batch: Any = None) -> Any:
        """Run ``closure``, check it, then step the optimizer or recover.

        Returns the closure's loss, or None when the step was skipped or its batch dropped.
        """
        if not callable(closure):
            raise ValueError(f"closure must be callable, got {type(closure).__name__}")
        if self.disabled:
            return _plain_step(self, closure)
        if self._drop_batch() or self._bad_batch(batch):
            return None
        rng = get_rng_state(self._cuda_devices)
        self.recovery.buffers.save()
        self.health.comm.reset()
        self._closure_error = None
        try:
            with torch.enable_grad():
                loss = closure()
        except (IndexError, RuntimeError) as err:
            if not _index_error(err):
                raise
            if dist.is_distributed():
                # The other ranks are already in the gradient all-reduce: joining them is
                # impossible, so fail loudly rather than hang. check_batch=True catches it first.
                log.error("nanguard: the forward raised on rank %d; use Guard(check_batch=True) under "
                          "torch.distributed to catch out-of-range ids before the forward", self.rank)  # fmt: skip
                raise
            # An out-of-range id raises on CPU. This rank still joins the agreement, flagged
            # by a NaN loss, and its replay turns the error into a data diagnosis.
            self._closure_error = err
            self.model.zero_grad(set_to_none=True)
            loss = torch.full((), math.nan, device=self._params[0].device if self._params else None)
        _unscale(self.scaler, self.optimizer)
        # A spike verdict comes after the host read, too late for the device path.
        device_step = self._fused and self.scaler is None and not self.config.skip_spikes
        device_step = device_step and self.config.clip_grad_norm is None  # the clip comes before the step
        if not (self._check(loss, closure, batch, rng, device_step=device_step) and _clip(self)):
            return None
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif not device_step:
            self.optimizer.step()
        self.after_step()
        return loss

    def check(
        self,
        loss: Any,
        *,
        replay: Callable[[], Any] | None = None,
        batch: Any = None,
        rng: dict[str, torch.Tensor] | None = None,
    ) -> bool:
        """The closure-free form, for loops that own backward and ``optimizer.step()``.

        Call it after backward and before the optimizer step; step only when it returns
        True, then call ``after_step()``. ``replay`` re-runs the forward and backward (it
        is traced by ``ng.locate`` on a trip); ``rng`` is the RNG state captured before the
        forward (``nanguard.rng.get_rng_state()``), so the replay draws the same numbers.

        Example:
            >>> loss = model(batch).mean(); loss.backward()
            >>> if guard.check(loss, replay=lambda: rerun(batch), batch=batch):
            ...     optimizer.step()
            ...     guard.after_step()
        """
        if self.disabled:
            return True
        if self._drop_batch() or self._bad_batch(batch):
            self.health.comm.reset()
            return False
        self._closure_error = None
        _unscale(self.scaler, self.optimizer)
        return self._check(loss, replay, batch, rng, device_step=False, restore_buffers=False) and _clip(self)

    def after_step(self) -> None:
        """Record a finished optimizer update: history, step event, parameter check, snapshot."""
        h, self._pending = self._pending, None
        if h is None:
            return
        self.health.after_update(h.step)
        good_steps = self.recovery.good_step()
        every = self.config.fingerprint_every
        if every and dist.is_distributed() and good_steps % every == 0:
            self._check_replicas(h.step)
        self.recovery.snapshot_if_due(self.step_count)
        self.history.append(h.step, loss=h.loss, grad_norm=h.grad_norm)
        self.last_action = "step"
        if h.step % self.config.log_every == 0:
            self.recorder.step(h.step, loss=h.own_loss, grad_norm=h.grad_norm, scale=h.scale, skipped=False)

    def _check(
        self,
        loss: Any,
        replay: Callable[[], Any] | None,
        batch: Any,
        rng: dict[str, torch.Tensor] | None,
        *,
        device_step: bool,
        restore_buffers: bool = True,
    ) -> bool:
        """The decision of one step; ``restore_buffers`` is False when no backup was taken
        before the forward (``check()``: the caller owns its loop)."""
        step = self._next_step()
        measured = self.health.measure(loss)
        agreed = measured.agree(sharded=self._sharded)
        if device_step:
            # Device path: the fused optimizer skips the update on the device when any rank is bad.
            compat.step_with_found_inf(self.optimizer, measured.found_inf(agreed))
        h = measured.read(step, agreed, scaled=self.scaler is not None)
        self._health_now = h
        if params_bad := h.ranks_with(HealthFlag.PARAMS):
            self.recovery.abandon(restore_buffers)
            self._trip(self.diagnoser.nonfinite_update(step - 1, params_bad), step - 1, batch, rng)
            return False
        if self.scaler is not None and not math.isfinite(h.grad_norm) and not h.bad_ranks:
            self._overflow(h)
            return False
        if h.bad_ranks or h.synced_bad:
            if restore_buffers:
                self.recovery.buffers.restore()  # the replays start from the step's own state...
            error, self._closure_error = self._closure_error, None
            replayed = self.diagnoser.tripped(replay, h, rng=rng, batch=batch, closure_error=error)
            self.recovery.abandon(restore_buffers)  # ...and leave none of theirs behind
            assert replayed.diagnosis is not None
            self._trip(replayed.diagnosis, step, batch, rng, module_stats=replayed.module_stats)
            return False
        spikes = self.history.observe(step, loss=h.loss, grad_norm=h.grad_norm)
        for spike in spikes:
            self.recorder.spike(step, spike)
            log.warning("nanguard: step %d: %s spike %.4g (median %.4g, z=%.1f)",
                        step, spike.metric, spike.value, spike.median, spike.score)  # fmt: skip
        if spikes and self.config.skip_spikes:
            self.recovery.abandon(restore_buffers)
            self._skip(step, f"{spikes[0].metric} spike (z={spikes[0].score:.1f})", h)
            return False
        self._pending = h
        return True

    def _next_step(self) -> int:
        step = self.step_count
        self.step_count += 1
        self._health_now = None
        return step

    def _drop_batch(self) -> bool:
        if not self.recovery.take_drop():
            return False
        step = self._next_step()
        self.last_action = "drop_batch"
        self.recorder.skip(step, reason="rollback: dropping the batch after a bad one")
        log.warning("nanguard: step %d: batch dropped after rollback", step)
        return True

    def _bad_batch(self, batch: Any) -> bool:
        """check_batch before the forward. Ranks agree first: under DDP one rank cannot skip
        its forward and backward while the others all-reduce gradients."""
        if not self.config.check_batch:
            return False
        diag = self.diagnoser.rejected_batch(batch, self.step_count) if batch is not None else None
        flagged = dist.agree_flag(diag is not None)
        if not flagged:
            return False
        step = self._next_step()
        diag = dist.gather_diagnosis(diag, flagged)
        assert diag is not None  # a flagged rank always contributes its diagnosis
        diag.step = step
        self._trip(diag, step, batch, None)
        return True

    def _overflow(self, h: StepHealth) -> None:
        """A GradScaler overflow step: normal, counted, and skipped by the scaler itself."""
        assert self.scaler is not None and h.scale is not None
        new_scale, streak, c = self.recovery.overflow(), self.recovery.overflow_streak, self.config
        self.last_action = "overflow"
        self.recorder.overflow(h.step, scale=h.scale, new_scale=new_scale, streak=streak)
        self.recorder.step(h.step, loss=h.loss, grad_norm=None, scale=h.scale, skipped=True)
        if new_scale < c.loss_scale_floor or streak >= c.max_overflow_streak:
            diag = loss_scale_collapse(step=h.step, scale=new_scale, floor=c.loss_scale_floor, streak=streak,
                                       overflows=self.recovery.overflows, rank=dist.rank_or_none())  # fmt: skip
            self.last_diagnosis = diag
            self.recorder.trip(h.step, action="raise", ranks=[self.rank], diagnosis=diag)
            raise NonFiniteError(diag)

    def _check_replicas(self, step: int) -> None:
        differ, first = dist.replica_mismatch(self.model)
        if not differ:
            return
        diag = self.last_diagnosis = replica_divergence(step=step, ranks=differ, first_parameter=first)
        action = "raise" if self.config.policy == "raise" else "resync"
        self.recorder.trip(step, action=action, ranks=differ, diagnosis=diag)
        _announce(self.rank, step, diag, action)
        if action == "raise":
            raise NonFiniteError(diag)
        dist.broadcast_state(self.model, src=0)

    # -- trips -------------------------------------------------------------------------
    def _bundle_meta(self) -> dict[str, Any]:
        return {**self.history.tail(), "fingerprint": dist.fingerprint(self.model)}

    def _trip(
        self,
        diag: Diagnosis,
        step: int,
        batch: Any,
        rng: dict[str, torch.Tensor] | None,
        module_stats: dict[str, Any] | None = None,
    ) -> None:
        self.last_diagnosis = diag
        action = self.recovery.policy_for(diag)
        extra = {"module_stats": module_stats} if module_stats else {}
        flagged = diag.evidence.get("flagged_ranks", [self.rank])
        self.recorder.trip(step, action=action, ranks=flagged, diagnosis=diag, **extra)
        self.recorder.bundle(diag, step, batch, rng, meta=self._bundle_meta)
        _announce(self.rank, step, diag, action)
        if action == "raise":
            self.last_action = "raise"
            raise NonFiniteError(diag)
        if action == "rollback":
            restored = self.recovery.rollback(diag)
            self.health.forget_update()
            self.last_action = "rollback"
            self.recorder.rollback(step, restored_step=restored, skip_batches=self.recovery.drop_batches,
                                   reason=diag.cause)  # fmt: skip
            self.recovery.count_in_a_row(diag)
            return
        self._skip(step, diag.cause, self._health_now)

    def _skip(self, step: int, reason: str, h: StepHealth | None) -> None:
        self.recovery.skip()
        self.last_action = "skip"
        self.recorder.skip(step, reason)
        self.recorder.step(step, loss=h.own_loss if h else None, grad_norm=h.grad_norm if h else None,
                           scale=h.scale if h else None, skipped=True)  # fmt: skip
        self.recovery.count_in_a_row(self.last_diagnosis)

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Counters, history and detector windows, so a resumed run keeps them."""
        return {
            "step_count": self.step_count,
            **self.recovery.state_dict(),
            **self.history.state_dict(),
            "last_diagnosis": self.last_diagnosis.to_dict() if self.last_diagnosis else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step_count = int(state.get("step_count", 0))
        self.recovery.load_state_dict(state)
        self.history.load_state_dict(state)
        last = state.get("last_diagnosis")
        self.last_diagnosis = Diagnosis.from_dict(last) if last else None

    def close(self) -> None:
        self.recorder.end(self.step_count, skipped=self.skipped, rollbacks=self.rollbacks)
        self.recorder.close()


def _plain_step(guard: Guard, closure: Callable[[], Any]) -> Any:
    """The step of a disabled guard (NANGUARD_DISABLE=1): what the loop would do without nanguard."""
    guard.step_count += 1
    guard.last_action = "step"
    loss = closure()
    if guard.scaler is not None:
        guard.scaler.step(guard.optimizer)
        guard.scaler.update()
    else:
        guard.optimizer.step()
    return loss


def _unscale(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Unscale the gradients once: a loop that unscaled already (to clip) is not an error."""
    if scaler is not None and not compat.scaler_unscaled(scaler, optimizer):
        scaler.unscale_(optimizer)


def _clip(guard: Guard) -> bool:
    """``clip_grad_norm``, after the check that measured (and recorded) the norm before it; always True."""
    if guard.config.clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(guard._params, guard.config.clip_grad_norm)
    return True


def _listener(on_event: Any, disabled: bool) -> Callable[[dict[str, Any]], None] | None:
    if on_event is not None and not callable(on_event):
        raise ValueError(f"on_event must be None or a callable taking an event dict, got {type(on_event).__name__}")
    return None if disabled else on_event


def _announce(rank: int, step: int, diag: Diagnosis, action: str) -> None:
    """One log line per trip: the step once, and which rank speaks under torch.distributed."""
    who = f"rank {rank}: " if dist.is_distributed() else ""
    log.warning("nanguard: %sstep %d: %s -> %s", who, step, replace(diag, step=None).summary(), action)


def _index_error(err: BaseException) -> bool:
    """An error an out-of-range index raises on CPU (CUDA asserts on the device instead)."""
    if isinstance(err, IndexError):
        return True
    text = str(err).lower()
    return "out of bounds" in text or "out of range" in text
