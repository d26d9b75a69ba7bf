"""``Guard``: the coordinator. Each step it asks its parts in order: health (measure, agree,
read once), then the decision, then recovery, history and the recorder.

See the package docstring for the host and device paths.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanguard import compat, dist, environ
from nanguard.diagnose import loss_scale_collapse, replica_divergence
from nanguard.errors import NonFiniteError
from nanguard.findings import Diagnosis
from nanguard.guard.accumulate import step_accumulated
from nanguard.guard.config import GuardConfig
from nanguard.guard.health import HealthCheck, HealthFlag, HostCopy, StepHealth
from nanguard.guard.history import History
from nanguard.guard.recorder import recorder_for
from nanguard.guard.recovery import COUNTERS, Recovery
from nanguard.guard.remedies import Remedies
from nanguard.guard.replay import Diagnoser, Replayed
from nanguard.guard.wrapped import guard_scaler, scaled_optimizer, scaler_step
from nanguard.rng import get_rng_state
from nanguard.spikes import Spike
from nanguard.stats import local
from nanguard.tracer import error_origin

__all__ = ["Guard"]

log = logging.getLogger("nanguard")


class Guard:
    """Guards each optimizer step: detect, diagnose, and skip, roll back or raise.

    ``closure`` follows the ``torch.optim`` convention: it zeroes the gradients, runs
    forward and backward, and returns the loss. With a ``torch.amp.GradScaler`` pass it
    as ``scaler=`` and call ``scaler.scale(loss).backward()`` in the closure; the guard
    unscales, steps and updates the scaler. An Accelerate-prepared optimizer brings its
    own scaler (``accelerator.scaler``), used once. A rollback restores a ``scheduler=`` too.

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
        scheduler: Any = None,
        run_dir: str | Path | None = None,
        comm_hook: tuple[Any, Callable[..., Any]] | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        **config: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        scaler = guard_scaler(optimizer, scaler)  # an Accelerate optimizer brings its own
        _check_parts(scaler, scheduler)
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
        self.recovery = Recovery(model, optimizer, scaler=self.scaler, config=c, scheduler=scheduler)
        self.history = History.from_config(c)
        self.diagnoser = Diagnoser(model, optimizer, self.history, locate=c.locate, module_stats=c.module_stats,
                                   comm=self.health.comm)  # fmt: skip
        self.recorder = recorder_for(run_dir, rank=self.rank, max_bundle_bytes=c.max_bundle_bytes, model=model,
                                     bundle_weights=c.bundle_weights)  # fmt: skip
        self.recorder.listener = _listener(on_event, self.disabled)
        # Only the GPUs this model lives on draw random numbers for its step.
        self._cuda_devices = sorted({p.device.index or 0 for p in self._params if p.device.type == "cuda"})
        self._fused = compat.supports_found_inf(optimizer)
        self._sharded = any(local(p) is not p for p in self._params)  # FSDP2: each rank holds a shard
        self._closure_error: BaseException | None = None
        self._pending: StepHealth | None = None
        self._health_now: StepHealth | None = None  # this step's, once read
        self._deferred = _deferred(c, optimizer, self.scaler, self._fused, self._cuda_devices)
        self._waiting: _Waiting | None = None  # deferred: the last step, its verdict not read yet
        self.recorder.start(asdict(c), dist.world_size(), "device" if self._fused else "host")
        self._remedies = Remedies(model, optimizer, c, self.recorder, run_dir, lambda: getattr(self, "scheduler", None))
        if c.policy in ("rollback", "auto"):
            self.recovery.take_snapshot(self.step_count)

    # Counters owned by the parts, read where users always found them.
    skipped = property(lambda self: self.recovery.skipped, doc="How many steps were skipped.")
    rollbacks = property(lambda self: self.recovery.rollbacks, doc="How many rollbacks ran.")
    overflows = property(lambda self: self.recovery.overflows, doc="GradScaler overflow steps.")
    consecutive_skips = property(lambda self: self.recovery.consecutive_skips, doc="Skips and rollbacks in a row.")
    overflow_streak = property(lambda self: self.recovery.overflow_streak, doc="Overflow steps in a row.")
    spikes = property(lambda self: self.history.spikes, doc="Loss and grad-norm spikes seen.")
    remedies = property(lambda self: self._remedies.entries, doc="Remedies applied, oldest first.")
    loss_spikes = property(lambda self: self.history.loss_spikes, doc="The loss spike detector.")
    grad_spikes = property(lambda self: self.history.grad_spikes, doc="The grad-norm spike detector.")

    # -- the step ------------------------------------------------------------------------
    step_accumulated = step_accumulated  # gradient accumulation: guard/accumulate.py

    def step(self, closure: Callable[[], Any], batch: Any = None, sample_ids: Any = None) -> Any:
        """Run ``closure``, check it, then step the optimizer or recover.

        Returns the closure's loss, or None when the step was skipped or its batch dropped.
        A skip or an error (even ``KeyboardInterrupt``) leaves no trace: README, "What nanguard guarantees".
        """
        if not callable(closure):
            raise ValueError(f"closure must be callable, got {type(closure).__name__}")
        if self.disabled:
            return _plain_step(self, closure)
        _settle(self)
        self._remedies.begin_step(sample_ids)
        if self._drop_batch() or self._bad_batch(batch):
            return None
        rng = get_rng_state(self._cuda_devices)
        self.recovery.buffers.save()
        with _name_the_origin(self, closure, rng), _undo_on_error(self, rng):
            return self._step(closure, batch, rng)

    def _step(self, closure: Callable[[], Any], batch: Any, rng: dict[str, torch.Tensor]) -> Any:
        self.health.comm.reset()
        loss, value, self._closure_error = _run_closure(self, closure)
        _unscale(self.scaler, self.optimizer)
        # A spike verdict comes after the host read, too late for the device path.
        device_step = self._fused and self.scaler is None and not self.config.skip_spikes
        device_step = device_step and self.config.clip_grad_norm is None  # the clip comes before the step
        if not (self._check(value, closure, batch, rng, device_step=device_step) and _clip(self)):
            return None
        if self._waiting is not None:
            return loss  # deferred: its verdict and bookkeeping come with the next call
        if self.scaler is not None:
            scaler_step(self.optimizer, self.scaler)
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
        value = _check_args(loss, replay, rng)
        if self.disabled:
            return True
        _settle(self)
        if self._drop_batch() or self._bad_batch(batch):
            self.health.comm.reset()
            return False
        self._closure_error = None
        _unscale(self.scaler, self.optimizer)
        return self._check(value, replay, batch, rng, device_step=False, restore_buffers=False) and _clip(self)

    def after_step(self) -> None:
        """Record a finished optimizer update: history, step event, parameter check, snapshot."""
        h, self._pending = self._pending, None
        if h is None:
            return
        self.health.after_update(h.step)
        good_steps = self.recovery.good_step()
        every = self.config.fingerprint_every
        if every and dist.is_distributed() and good_steps % every == 0:
            _check_replicas(self, h.step)
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
        if not device_step and self.health.alone:
            return self._decide(self.health.read_alone(loss, step), replay, batch, rng, restore_buffers=restore_buffers)
        measured = self.health.measure(loss)
        agreed = measured.agree(sharded=self._sharded, carried=self.health.carried())
        if device_step:
            copy = HostCopy(measured, agreed) if self._deferred else None  # queued before the update
            # Device path: the fused optimizer skips the update on the device when any rank is bad.
            compat.step_with_found_inf(self.optimizer, measured.found_inf(agreed))
            if copy is not None:
                self._waiting = _Waiting(step, copy, replay, batch, rng, self._closure_error)
                return True
        h = measured.read(step, agreed, scaled=self.scaler is not None)
        return self._decide(h, replay, batch, rng, restore_buffers=restore_buffers)

    def _decide(self, h: StepHealth, replay: Callable[[], Any] | None, batch: Any,
                rng: dict[str, torch.Tensor] | None, *, restore_buffers: bool) -> bool:  # fmt: skip
        """A read step's verdict: trip, overflow, spike skip, or go (True)."""
        step = h.step
        self._health_now = h
        if params_bad := h.ranks_with(HealthFlag.PARAMS):
            self.recovery.abandon(restore_buffers, rng)
            diag = _or_unknown(lambda: self.diagnoser.nonfinite_update(step - 1, params_bad), step - 1, h)
            self._trip(diag, step - 1, batch, rng)
            return False
        if self.scaler is not None and not math.isfinite(h.grad_norm) and not h.bad_ranks:
            _overflow(self, h)
            return False
        if h.bad_ranks or h.synced_bad:
            if restore_buffers:
                self.recovery.buffers.restore()  # the replays start from the step's own state...
            error, self._closure_error = self._closure_error, None
            replay = _scaler_aside(self.scaler, replay)
            replayed = _replayed_or_unknown(
                lambda: self.diagnoser.tripped(replay, h, rng=rng, batch=batch, closure_error=error), step, h, error
            )
            self.recovery.abandon(restore_buffers, rng)  # ...and leave none of theirs behind
            assert replayed.diagnosis is not None
            self._trip(replayed.diagnosis, step, batch, rng, module_stats=replayed.module_stats)
            return False
        spikes = _watch_trends(self, step, h)
        if spikes and self.config.skip_spikes:
            self.recovery.abandon(restore_buffers, rng)
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
        step, self.last_action = self._next_step(), "drop_batch"
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

    # -- trips -------------------------------------------------------------------------
    def _trip(
        self,
        diag: Diagnosis,
        step: int,
        batch: Any,
        rng: dict[str, torch.Tensor] | None,
        module_stats: dict[str, Any] | None = None,
    ) -> None:
        self.last_diagnosis = diag
        action, message = self._remedies.choose(diag, self.recovery, step=step, batch=batch)
        extra = {"module_stats": module_stats} if module_stats else {}
        flagged = diag.evidence.get("flagged_ranks", [self.rank])
        self.recorder.trip_and_bundle(step, action=action, ranks=flagged, diagnosis=diag, batch=batch, rng=rng,
                                      meta=lambda: _bundle_meta(self), **extra)  # fmt: skip
        _announce(self.rank, step, diag, action)
        if action == "raise":
            self.last_action = "raise"
            raise NonFiniteError(diag, message)
        if action == "rollback":
            restored = self.recovery.rollback(diag)
            self._remedies.after_rollback(step, lambda: self.recovery.take_snapshot(restored))
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
        _settle(self)
        return {
            "step_count": self.step_count,
            **self.recovery.state_dict(),
            **self.history.state_dict(),
            "last_diagnosis": self.last_diagnosis.to_dict() if self.last_diagnosis else None,
            "remedies": self._remedies.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_state(state, self.config)  # a bad entry is a ValueError, and nothing is applied
        self.step_count = int(state.get("step_count", 0))
        self.recovery.load_state_dict(state)
        self.history.load_state_dict(state)
        last = state.get("last_diagnosis")
        self.last_diagnosis = Diagnosis.from_dict(last) if last else None
        self._remedies.load_state_dict(state.get("remedies") or {})

    def close(self) -> None:
        _settle(self)
        self.recorder.end(self.step_count, skipped=self.skipped, rollbacks=self.rollbacks)
        self.recorder.close()


def _settle(guard: Guard) -> None:
    """Deferred mode: read the last step's flags (its update is running on the device, which
    skipped it if bad) and finish that step as the immediate path would have."""
    w, guard._waiting = guard._waiting, None
    if w is None:
        return
    h = w.copy.read(w.step, scaled=False)
    guard._closure_error = w.closure_error
    with _undo_on_error(guard, w.rng):
        if guard._decide(h, w.replay, w.batch, w.rng, restore_buffers=True):
            guard.after_step()


def _overflow(guard: Guard, h: StepHealth) -> None:
    """A GradScaler overflow step: normal, counted, and skipped by the scaler itguard."""
    assert guard.scaler is not None and h.scale is not None
    new_scale, streak, c = guard.recovery.overflow(), guard.recovery.overflow_streak, guard.config
    guard.last_action = "overflow"
    guard.recorder.overflow(h.step, scale=h.scale, new_scale=new_scale, streak=streak)
    guard.recorder.step(h.step, loss=h.loss, grad_norm=None, scale=h.scale, skipped=True)
    if new_scale < c.loss_scale_floor or streak >= c.max_overflow_streak:
        diag = loss_scale_collapse(step=h.step, scale=new_scale, floor=c.loss_scale_floor, streak=streak,
                                   overflows=guard.recovery.overflows, rank=dist.rank_or_none())  # fmt: skip
        if guard._remedies.rescue_scaler(h.step, diag, guard.scaler, guard.recovery):
            return
        guard.last_diagnosis = diag
        guard.recorder.trip(h.step, action="raise", ranks=[guard.rank], diagnosis=diag)
        raise NonFiniteError(diag)


@dataclass(frozen=True)
class _Waiting:
    """A deferred step whose flags are on their way to the host, and what its replay needs."""

    step: int
    copy: HostCopy
    replay: Callable[[], Any] | None
    batch: Any
    rng: dict[str, torch.Tensor] | None
    closure_error: BaseException | None


def _deferred(config: GuardConfig, optimizer: torch.optim.Optimizer, scaler: Any, fused: bool, cuda: list[int]) -> bool:
    """Whether ``step`` reads each step's health one step late (``GuardConfig.sync``)."""
    fits = fused and scaler is None and config.clip_grad_norm is None and not config.skip_spikes
    if config.sync == "deferred" and not fits:
        raise ValueError(
            "sync='deferred' needs an optimizer that takes found_inf (fused=True Adam, AdamW or SGD), no "
            f"GradScaler, clip_grad_norm=None and skip_spikes=False; got {type(optimizer).__name__} "
            f"(fused={fused}), scaler={scaler is not None}, clip_grad_norm={config.clip_grad_norm}, "
            f"skip_spikes={config.skip_spikes}; use sync='immediate' or 'auto'"
        )
    return config.sync == "deferred" or (config.sync == "auto" and fits and bool(cuda))


def _run_closure(guard: Guard, closure: Callable[[], Any]) -> tuple[Any, Any, BaseException | None]:
    """The step's forward and backward: (loss, its value, the index error a CPU forward raised)."""
    try:
        with torch.enable_grad(), guard._remedies.headroom.watch(guard.step_count), guard.health.riding():
            loss = closure()
        return loss, _loss_value(loss, "the closure's return value", allow_none=False), None
    except (IndexError, RuntimeError) as err:
        if not _index_error(err):
            raise
        if dist.is_distributed():
            # The other ranks are already in the gradient all-reduce: joining them is
            # impossible, so fail loudly rather than hang. check_batch=True catches it first.
            log.error("nanguard: the forward raised on rank %d; use Guard(check_batch=True) under "
                      "torch.distributed to catch out-of-range ids before the forward", guard.rank)  # fmt: skip
            raise
        # An out-of-range id raises on CPU. This rank still joins the agreement, flagged
        # by a NaN loss, and its replay turns the error into a data diagnosis.
        guard.model.zero_grad(set_to_none=True)
        nan = torch.full((), math.nan, device=guard._params[0].device if guard._params else None)
        return nan, nan, err


@contextlib.contextmanager
def _undo_on_error(guard: Guard, rng: dict[str, torch.Tensor]) -> Iterator[None]:
    """An error in the closure or a replay (even ``KeyboardInterrupt``) leaves no trace of the
    step; the policy's own ``NonFiniteError`` comes after the state was restored."""
    count = guard.step_count
    try:
        yield
    except BaseException as err:
        if not isinstance(err, NonFiniteError):
            guard.recovery.undo(rng, unscaled=guard.step_count != count)  # unscale_ comes before the count
            guard.step_count, guard._pending = count, None
        raise


@contextlib.contextmanager
def _name_the_origin(guard: Guard, closure: Callable[[], Any], rng: dict[str, torch.Tensor]) -> Iterator[None]:
    """A closure that raised after making NaN/Inf (a distribution's validate_args, multinomial)
    still raises, unchanged but for one note naming the origin, found by a replay after the undo.
    Single process only: a replay on the one rank that raised could wait on the others."""
    try:
        yield
    except Exception as err:
        if guard.config.locate and not isinstance(err, NonFiniteError) and not dist.is_distributed():
            note = error_origin(closure, err, model=dist.unwrap(guard.model))
            guard.recovery.undo(rng, unscaled=False)  # the replay ran the closure again
            if note is not None:
                err.add_note(note)
        raise


def _check_replicas(guard: Guard, step: int) -> None:
    """Compare the replicas' fingerprints; resync from a finite majority replica, else roll back or raise."""
    check = dist.replica_mismatch(guard.model)
    if not check.ranks:
        return
    diag = guard.last_diagnosis = replica_divergence(step=step, **vars(check))
    action = "raise" if guard.config.policy == "raise" else "resync"
    if check.source is None:  # no finite replica to copy from
        action = "rollback" if guard.recovery.snapshot is not None else "raise"
    guard.recorder.trip(step, action=action, ranks=check.ranks, diagnosis=diag)
    _announce(guard.rank, step, diag, action)
    if action == "raise":
        raise NonFiniteError(diag)
    if action == "rollback":  # restored_step is evaluated first: rollback() sets drop_batches
        guard.recorder.rollback(step, restored_step=guard.recovery.rollback(diag),
                                skip_batches=guard.recovery.drop_batches, reason=diag.cause)  # fmt: skip
    else:
        dist.broadcast_state(guard.model, src=check.source)
    guard.health.forget_update()  # the queued parameter check saw the replicas before the repair


def _watch_trends(guard: Guard, step: int, h: StepHealth) -> list[Spike]:
    """A finite step's spikes and divergence warning, logged and recorded; returns the spikes."""
    spikes = guard.history.observe(step, loss=h.loss, grad_norm=h.grad_norm)
    for spike in spikes:
        guard.recorder.spike(step, spike)
        log.warning("nanguard: step %d: %s spike %.4g (median %.4g, z=%.1f)",
                    step, spike.metric, spike.value, spike.median, spike.score)  # fmt: skip
    if trend := guard.history.forecast(step, loss=h.loss, grad_norm=h.grad_norm):
        guard.recorder.forecast(step, trend)
        log.warning("nanguard: step %d: %s %.4g grows x%.3g per step: float32 overflow predicted in %d steps",
                    step, trend.metric, trend.value, trend.growth, trend.predicted_overflow_in)  # fmt: skip
    return spikes


def _check_args(loss: Any, replay: Any, rng: Any) -> Any:
    """``check()``'s arguments; returns the loss as the health check reads it."""
    if replay is not None and not callable(replay):
        raise ValueError(f"replay must be callable or None, got {type(replay).__name__}")
    if rng is not None and not isinstance(rng, Mapping):
        raise ValueError(f"rng must be a dict from nanguard.rng.get_rng_state() or None, got {type(rng).__name__}")
    return _loss_value(loss, "loss", allow_none=True)


def _check_state(state: Any, config: GuardConfig) -> None:
    """Check a ``Guard.state_dict()`` before any of it is applied: a ValueError names what is wrong."""
    if not isinstance(state, Mapping):
        raise ValueError(f"state must be a mapping from Guard.state_dict(), got {type(state).__name__}")
    for name in ("step_count", *COUNTERS):
        value = state.get(name, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"state[{name!r}] must be an int >= 0, got {value!r}")
    try:  # the history and the diagnosis are checked by loading them into throwaway copies
        History.from_config(config).load_state_dict(state)
        last = state.get("last_diagnosis")
        if last:
            Diagnosis.from_dict(last)
    except Exception as err:
        raise ValueError(f"cannot load the guard state (history or last_diagnosis): {err!r}") from None


def _check_parts(scaler: Any, scheduler: Any) -> None:
    for obj, name, methods in [
        (scaler, "scaler", ("is_enabled", "unscale_", "step", "update", "get_scale", "state_dict")),
        (scheduler, "scheduler", ("step", "state_dict", "load_state_dict")),
    ]:
        if obj is not None and not all(callable(getattr(obj, m, None)) for m in methods):
            raise ValueError(f"{name} must be None or have the methods {', '.join(methods)}, got {type(obj).__name__}")


def _loss_value(loss: Any, name: str, *, allow_none: bool) -> Any:
    """The loss as the health check reads it: a number or a one-element tensor. A larger
    tensor reads as its mean, or, when any element is NaN/Inf, as a non-finite value."""
    if loss is None and allow_none:
        return None
    if isinstance(loss, torch.Tensor):
        if loss.numel() == 0:
            raise ValueError(f"{name} is an empty tensor; it must hold the loss")
        if loss.numel() == 1:
            return loss
        x = loss.detach().float()
        return torch.where(torch.isfinite(x).all(), x.mean(), x.sum())  # any NaN/Inf makes the sum non-finite
    if isinstance(loss, numbers.Real) and not isinstance(loss, bool):
        return loss
    raise TypeError(f"{name} must be the loss (a tensor or a number), got {type(loss).__name__}")


def _replayed_or_unknown(
    replay: Callable[[], Replayed], step: int, h: StepHealth, closure_error: BaseException | None
) -> Replayed:
    """The replays' findings, or an ``unknown`` diagnosis when nanguard's own diagnosis fails
    (its failure must never kill training); the closure's own error goes on to the user."""
    try:
        return replay()
    except Exception as err:
        if err is closure_error:
            raise
        return Replayed(_unknown(err, step, h), located=False)


def _or_unknown(diagnose: Callable[[], Diagnosis], step: int, h: StepHealth) -> Diagnosis:
    try:
        return diagnose()
    except Exception as err:
        return _unknown(err, step, h)


def _unknown(err: Exception, step: int, h: StepHealth) -> Diagnosis:
    warnings.warn(f"nanguard: the diagnosis of step {step} failed: {err!r}", stacklevel=5)
    return Diagnosis(
        cause="unknown",
        kind="nan" if math.isnan(h.loss) or math.isnan(h.grad_norm) else "inf",
        phase="backward",
        step=step,
        evidence={"loss": h.loss, "grad_norm": h.grad_norm, "why": f"nanguard's diagnosis failed: {err!r}"},
        fixes=["the step was handled by the policy; rerun it with ng.locate to find its origin"],
    )


def _plain_step(guard: Guard, closure: Callable[[], Any]) -> Any:
    """The step of a disabled guard (NANGUARD_DISABLE=1): what the loop would do without nanguard."""
    guard.step_count += 1
    guard.last_action = "step"
    loss = closure()
    if guard.scaler is not None:
        scaler_step(guard.optimizer, guard.scaler)
    else:
        guard.optimizer.step()
    return loss


def _unscale(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Unscale the gradients once: a loop that unscaled already (to clip) is not an error."""
    optimizer = scaled_optimizer(optimizer)  # where the scaler keeps its per-optimizer state
    if scaler is not None and not compat.scaler_unscaled(scaler, optimizer):
        scaler.unscale_(optimizer)


def _scaler_aside(scaler: Any, replay: Callable[[], Any] | None) -> Callable[[], Any] | None:
    """The replay re-runs a closure that may unscale itself (to clip): this step's unscale_ is still open."""
    if scaler is None or replay is None:
        return replay

    def run() -> Any:
        with compat.scaler_steps_aside(scaler):
            return replay()

    return run


def _clip(guard: Guard) -> bool:
    """``clip_grad_norm``, after the check that measured (and recorded) the norm before it; always True."""
    if guard.config.clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(guard._params, guard.config.clip_grad_norm)
    return True


def _listener(on_event: Any, disabled: bool) -> Callable[[dict[str, Any]], None] | None:
    if on_event is not None and not callable(on_event):
        raise ValueError(f"on_event must be None or a callable taking an event dict, got {type(on_event).__name__}")
    return None if disabled else on_event


def _bundle_meta(guard: Guard) -> dict[str, Any]:
    return {**guard.history.tail(), "fingerprint": dist.fingerprint(guard.model)}


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
