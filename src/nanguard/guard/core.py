"""``Guard``: each step is one pipeline, read top to bottom in ``Guard.step``:

    measure (health, agreed across ranks, read once; a trip replayed and diagnosed) -> ``Verdict``
    -> ``Policy.decide(verdict, state)`` -> ``Action`` -> apply (step, skip, rollback, remedy, raise)
    -> record

Every decision is the policy's (``guard/policy.py``); the parts own their state: health,
recovery (buffers, snapshots, counters), history, the diagnoser, the remedies, the recorder.
See the package docstring for the host and device paths.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import os
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

from nanguard import compat, dist, environ
from nanguard.diagnose import loss_scale_collapse, replica_divergence, runaway_growth
from nanguard.errors import NonFiniteError, OutOfStepError
from nanguard.findings import Diagnosis
from nanguard.guard.accumulate import accumulation_closure, micro_batch_list
from nanguard.guard.config import GuardConfig
from nanguard.guard.health import HealthCheck, HealthFlag, HostCopy, StepHealth, check_after_loads
from nanguard.guard.history import History
from nanguard.guard.join import in_join, install, telling_joined, tells_every_step
from nanguard.guard.policy import STEP, Action, Policy, Verdict
from nanguard.guard.recorder import recorder_for
from nanguard.guard.recovery import COUNTERS, Recovery
from nanguard.guard.remedies import Remedies, with_bad_rows
from nanguard.guard.replay import Diagnoser, Replayed
from nanguard.guard.tracker import Tracker, where
from nanguard.guard.wrapped import guard_scaler, scaled_optimizer, scaler_step
from nanguard.inject import Fault, NullInjector, injector_for
from nanguard.rng import get_rng_state
from nanguard.stats import local
from nanguard.tracer import error_origin

__all__ = ["Guard"]

log = logging.getLogger("nanguard")

Rng = dict[str, torch.Tensor]


class Guard:
    """Guards each optimizer step: detect, diagnose, and skip, roll back or raise.

    ``closure`` follows the ``torch.optim`` convention: it zeroes the gradients, runs
    forward and backward, and returns the loss. With a ``torch.amp.GradScaler`` pass it
    as ``scaler=`` and call ``scaler.scale(loss).backward()`` in the closure; the guard
    unscales, steps and updates the scaler. An Accelerate-prepared optimizer brings its
    own scaler (``accelerator.scaler``), used once. A rollback restores a ``scheduler=`` too,
    and ``policy="auto"`` scales its ``base_lrs`` when it lowers the LR.

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
    ``"drop_batch"``, so the loop knows which batches were skipped. ``guard.last_grad_norm``
    is the latest checked step's gradient norm, across ranks and before clipping (what a loop
    logs); NaN or Inf on a step that tripped, None before the first.

    Pass ``batch=`` to ``step``: a trip's replay names the input that held the bad values
    (``batch['pixel_values']``), a repro bundle stores it, and ``check_batch=True`` audits
    it before the forward. Under DDP the guard wraps the model's comm hook to see each
    rank's own gradients before averaging; a custom hook goes in as ``comm_hook=(state,
    hook)``. ``on_event=fn`` gets each recorded event as a dict (see ``integrations.scalars``);
    ``inject="nan_grad@step=100,rank=3;..."`` plants a fire drill's faults (``nanguard.inject``,
    also ``NANGUARD_INJECT``); every other option is a ``GuardConfig`` field.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        policy: str = "skip",
        *,
        scaler: Any = None,
        scheduler: Any = None,
        run_dir: str | os.PathLike[str] | None = None,
        comm_hook: tuple[Any, Callable[..., Any]] | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        inject: str | list[Fault] | None = None,
        **config: Any,
    ) -> None:
        scaler = _check_parts(model, optimizer, scaler, scheduler)
        c = self.config = GuardConfig.from_options(environ.policy(policy), config)
        self.disabled = environ.disabled()  # NANGUARD_DISABLE=1: a plain optimizer step, no files
        run_dir = None if self.disabled else environ.run_dir(run_dir)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        # _calls: Guard.step/check calls, undone by nothing: the step index the ranks agree on.
        self.rank, self.step_count, self._calls = dist.rank(), 0, 0
        self.last_diagnosis: Diagnosis | None = None
        self.last_action: str | None = None
        self.last_grad_norm: float | None = None  # documented on the class: across ranks, before clipping
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        self.health = HealthCheck(
            self._params,
            scaler=self.scaler,
            comm=dist.watch_communication(model, comm_hook),
            param_check_every=c.param_check_every,
            check_loaded=True,
        )
        self._load_hook = check_after_loads(model, self.health)  # a later load_state_dict is checked too
        self.recovery = Recovery(model, optimizer, scaler=self.scaler, config=c, scheduler=scheduler)
        self.history = History.from_config(c)
        self.diagnoser = Diagnoser(
            model, optimizer, self.history, locate=c.locate, module_stats=c.module_stats, comm=self.health.comm
        )
        self.recorder = recorder_for(
            run_dir, rank=self.rank, max_bundle_bytes=c.max_bundle_bytes, model=model, bundle_weights=c.bundle_weights
        )
        self.recorder.listener = _listener(on_event, self.disabled)
        self._drill_and_tracker(inject, run_dir)
        self._spikes_before = 0  # the spikes seen before a drilled step
        self.policy = Policy(c)
        self._remedies = Remedies(model, optimizer, c, self.recorder, run_dir, scheduler=scheduler)
        self._state = _PolicyState(self)
        self._choose_paths()
        self._closure_error: BaseException | None = None
        self._pending: StepHealth | None = None  # a checked step whose update is to be recorded
        self._waiting: _Waiting | None = None  # deferred: the last step, its verdict not read yet
        self.recorder.start(asdict(c), dist.world_size(), "device" if self._fused else "host")
        if c.policy in ("rollback", "auto"):
            self.recovery.take_snapshot(self.step_count)
        install(self)  # DDP join(): a rank out of batches shadows the guard's collectives

    def _drill_and_tracker(self, inject: str | list[Fault] | None, run_dir: str | os.PathLike[str] | None) -> None:
        """The fire drill's injector (``inject=`` or NANGUARD_INJECT) and the run's hardware tracker."""
        self.injector = injector_for(
            None if self.disabled else environ.inject(inject),
            self.model,
            write=self.recorder.drill,
            steps=lambda: self.step_count,
        )
        here = where(self._params[0].device if self._params else None)
        self.tracker = Tracker(run_dir, here=here, warn_after=self.config.hardware_warn_after)

    def _choose_paths(self) -> None:
        """The paths every step takes, fixed by the parts the guard was built with."""
        c = self.config
        # Only the GPUs this model lives on draw random numbers for its step.
        self._cuda_devices = sorted({p.device.index or 0 for p in self._params if p.device.type == "cuda"})
        self._fused = compat.supports_found_inf(self.optimizer)
        self._sharded = any(local(p) is not p for p in self._params)  # FSDP2: each rank holds a shard
        # The fused optimizer skips a bad update on the device; a spike verdict (after the host
        # read) and a clip (before the step) need the host path.
        self._device_step = self._fused and self.scaler is None and not c.skip_spikes and c.clip_grad_norm is None
        self._deferred = _deferred(c, self.optimizer, self.scaler, self._fused, self._cuda_devices)

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
    def step(self, closure: Callable[[], Any], batch: Any = None, sample_ids: Any = None) -> Any:
        """Run ``closure``, check it, then step the optimizer or recover.

        Returns the closure's loss, or None when the step was skipped or its batch dropped.
        A skip or an error (even ``KeyboardInterrupt``) leaves no trace: README, "What nanguard guarantees".
        """
        if not callable(closure):
            raise ValueError(f"closure must be callable, got {type(closure).__name__}")
        if self.disabled:
            return self._plain_step(closure)
        self._calls += 1
        self._settle()
        self._remedies.begin_step(sample_ids)
        if self._drop_batch() or self._bad_batch(batch):
            return None
        closure = self._begin_drill().wrap(closure)
        rng = get_rng_state(self._cuda_devices)
        self.recovery.buffers.save()
        try:
            with _name_the_origin(self, closure, rng), self._undo_on_error(rng):
                loss, value = self._forward_backward(closure)
                verdict = self._measure(value, closure, batch, rng, device_step=self._device_step)
                if verdict is None:
                    self._headroom(closure, rng)
                    return loss  # deferred: its verdict and bookkeeping come with the next call
                if not self._act(verdict, batch, rng, restore_buffers=True):
                    return None
                self._headroom(closure, rng)
                self._update(device_step=self._device_step)
                self.after_step()
                return loss
        finally:
            if self._waiting is None:  # deferred: the drill's outcome comes with the verdict
                self._end_drill()

    def step_accumulated(
        self,
        micro_batches: Iterable[Any],
        loss_fn: Callable[[Any], Any],
        *,
        mean: bool = True,
        sample_ids: Any = None,
    ) -> Any:
        """One optimizer step over several micro-batches, as ``step``.

        ``loss_fn(micro_batch)`` runs the forward and returns the loss; the guard zeroes the
        gradients, divides each loss by the number of micro-batches (``mean=False``: as is),
        scales it with the guard's ``scaler=`` and runs backward, inside the model's ``no_sync()``
        (DDP) for all but the last micro-batch. The check sees the summed loss and a trip replays
        every micro-batch. Returns that sum, or None when the step was skipped.

        Example:
            >>> micro = [get_batch() for _ in range(4)]
            >>> loss = guard.step_accumulated(micro, lambda b: model(**b).loss)
        """
        batches = micro_batch_list(micro_batches, loss_fn, mean)
        closure = accumulation_closure(self.model, self.optimizer, self.scaler, batches, loss_fn, mean=mean)
        return self.step(closure, batch=batches, sample_ids=sample_ids)

    def check(
        self,
        loss: Any,
        *,
        replay: Callable[[], Any] | None = None,
        batch: Any = None,
        rng: Rng | None = None,
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
        self._calls += 1
        self._settle()
        if self._drop_batch() or self._bad_batch(batch):
            self.health.comm.reset()
            return False
        self._closure_error = None
        value = self._begin_drill().loss(value)
        try:
            _unscale(self.scaler, self.optimizer)
            verdict = self._measure(value, replay, batch, rng, device_step=False, restore_buffers=False)
            assert verdict is not None  # only the device path defers
            if not self._act(verdict, batch, rng, restore_buffers=False):
                return False
            self._headroom(replay, rng)
            self._clip()
            return True
        finally:
            self._end_drill()

    def after_step(self) -> None:
        """Record a finished optimizer update: history, step event, parameter check, snapshot."""
        h, self._pending = self._pending, None
        if h is None:
            return
        self.health.after_update(h.step)
        good_steps = self.recovery.good_step()
        self.history.append(h.step, loss=h.loss, grad_norm=h.grad_norm)
        every = self.config.fingerprint_every
        # A rank that joined (DDP join(), out of batches) cannot shadow the fingerprint gather.
        if every and good_steps % every == 0 and dist.is_distributed() and not h.joined:
            self._check_replicas(h.step)
        self.recovery.snapshot_if_due(self.step_count, h.loss, self.history.growing, joined=bool(h.joined))
        self.last_action = "step"
        if h.step % self.config.log_every == 0:
            self.recorder.step(h.step, loss=h.own_loss, grad_norm=h.grad_norm, scale=h.scale, skipped=False)

    # -- measure -------------------------------------------------------------------------
    def _forward_backward(self, closure: Callable[[], Any]) -> tuple[Any, Any]:
        """The closure and the scaler's unscale: (the loss, its value as the health check reads it)."""
        self.health.comm.reset()
        loss, value, self._closure_error = self._run_closure(closure)
        _unscale(self.scaler, self.optimizer)
        return loss, value

    def _measure(
        self,
        value: Any,
        replay: Callable[[], Any] | None,
        batch: Any,
        rng: Rng | None,
        *,
        device_step: bool,
        restore_buffers: bool = True,
    ) -> Verdict | None:
        """Read the step's health (the one host read) and diagnose a trip: the step's verdict.
        None when the read is deferred to the next call (the device path with ``sync="deferred"``).
        ``restore_buffers`` is False when no backup was taken before the forward (``check()``)."""
        step = self.step_count
        self.step_count += 1
        if not device_step and self.health.alone:
            h = self.health.read_alone(value, step)
            return self._verdict(h, replay, batch, rng, restore_buffers, updated=False)
        measured = self.health.measure(value)
        # The step index the ranks agree on: this rank's Guard.step/check calls, undone by nothing.
        agreed = measured.agree(
            sharded=self._sharded or self.health.sharded, carried=self.health.carried(), step=self._calls - 1
        )
        if device_step:
            copy = HostCopy(measured, agreed) if self._deferred else None  # queued before the update
            # Device path: the fused optimizer skips the update on the device when any rank is bad.
            compat.step_with_found_inf(self.optimizer, measured.found_inf(agreed))
            if copy is not None:
                self._waiting = _Waiting(step, copy, replay, batch, rng, self._closure_error)
                return None
        h = measured.read(step, agreed, scaled=self.scaler is not None)
        return self._verdict(h, replay, batch, rng, restore_buffers, updated=device_step)

    def _verdict(
        self,
        h: StepHealth,
        replay: Callable[[], Any] | None,
        batch: Any,
        rng: Rng | None,
        restore_buffers: bool,
        *,
        updated: bool,
    ) -> Verdict:
        """What a read step is: bad parameters (as loaded, or after an update), a GradScaler
        overflow, a trip (replayed and diagnosed), runaway growth, a spike, or healthy.
        ``updated``: the device path has applied the step's update already."""
        step = h.step
        self.last_grad_norm = h.grad_norm
        if h.out_of_step:
            raise OutOfStepError(h.out_of_step)
        kind = h.trip_kind(scaled=self.scaler is not None)  # the branch a joined rank's shadow takes too
        if kind == "params":
            params_bad = h.ranks_with(HealthFlag.PARAMS)
            self.recovery.abandon(restore_buffers, rng)
            if loaded := h.ranks_with(HealthFlag.LOADED):  # as built or loaded: no update of this guard wrote them
                diag = _or_unknown(lambda: self.diagnoser.loaded_parameters(step, loaded), step, h)
                return Verdict("trip", step, h, diagnosis=diag)
            diag = _or_unknown(lambda: self.diagnoser.nonfinite_update(step - 1, params_bad), step - 1, h)
            return Verdict("trip", step - 1, h, diagnosis=diag)
        if kind == "overflow":
            return self._overflowed(h)
        if kind == "trip":
            return self._tripped(h, replay, batch, rng, restore_buffers)
        spikes = self._watch_trends(step, h)
        # Finite, but diverging: caught before the clip and the update (the device path has applied it).
        # Not while a rank has joined (DDP join()): it holds no history to follow the trip with.
        runaway = None if updated or h.joined else self.history.runaway(step, loss=h.loss, grad_norm=h.grad_norm)
        if runaway is not None:
            self.recovery.abandon(restore_buffers, rng)
            diag = runaway_growth(
                step=step,
                history=runaway,
                lr=self.optimizer.param_groups[0].get("lr"),
                rank=dist.rank_or_none(),
                ranks=[],
            )
            return Verdict("trip", step, h, diagnosis=diag)
        return Verdict("spike", step, h, spikes=spikes) if spikes else Verdict("healthy", step, h)

    def _tripped(
        self, h: StepHealth, replay: Callable[[], Any] | None, batch: Any, rng: Rng | None, restore_buffers: bool
    ) -> Verdict:
        """Replay a tripped step under the tracer: its diagnosis, with the batch rows that hold the bad values."""
        if restore_buffers:
            self.recovery.buffers.restore()  # the replays start from the step's own state...
        error, self._closure_error = self._closure_error, None
        replay = _scaler_aside(self.scaler, replay)
        replayed = _replayed_or_unknown(
            lambda: self.diagnoser.tripped(replay, h, rng=rng, batch=batch, closure_error=error), h.step, h, error
        )
        self.recovery.abandon(restore_buffers, rng)  # ...and leave none of theirs behind
        assert replayed.diagnosis is not None
        diag = with_bad_rows(replayed.diagnosis, batch, self._remedies.rows())
        return Verdict("trip", h.step, h, diagnosis=diag, module_stats=replayed.module_stats)

    def _overflowed(self, h: StepHealth) -> Verdict:
        """A GradScaler overflow: the scaler skips the update itself and lowers its scale. Below
        ``loss_scale_floor``, or ``max_overflow_streak`` times in a row, the scale has collapsed."""
        assert self.scaler is not None and h.scale is not None
        scaler_step(self.optimizer, self.scaler)
        self.recovery.count_overflow()
        new_scale, streak, c = float(self.scaler.get_scale()), self.recovery.overflow_streak, self.config
        self.last_action = "overflow"
        self.recorder.overflow(h.step, scale=h.scale, new_scale=new_scale, streak=streak)
        self.recorder.step(h.step, loss=h.loss, grad_norm=None, scale=h.scale, skipped=True)
        if new_scale >= c.loss_scale_floor and streak < c.max_overflow_streak:
            return Verdict("overflow", h.step, h)
        diag = loss_scale_collapse(
            step=h.step,
            scale=new_scale,
            floor=c.loss_scale_floor,
            streak=streak,
            overflows=self.recovery.overflows,
            rank=dist.rank_or_none(),
        )
        return Verdict("collapse", h.step, h, diagnosis=diag)

    def _watch_trends(self, step: int, h: StepHealth) -> list[Any]:
        """A finite step's spikes and divergence warning, logged and recorded; returns the spikes."""
        spikes = self.history.observe(step, loss=h.loss, grad_norm=h.grad_norm)
        for spike in spikes:
            self.recorder.spike(step, spike)
            log.warning(
                "nanguard: step %d: %s spike %.4g (median %.4g, z=%.1f)",
                step,
                spike.metric,
                spike.value,
                spike.median,
                spike.score,
            )
        if trend := self.history.forecast(step, loss=h.loss, grad_norm=h.grad_norm):
            self.recorder.forecast(step, trend)
            log.warning(
                "nanguard: step %d: %s %.4g grows x%.3g per step: float32 overflow predicted in %d steps",
                step,
                trend.metric,
                trend.value,
                trend.growth,
                trend.predicted_overflow_in,
            )
        return spikes

    def _drop_batch(self) -> bool:
        """One of the batches after a rollback: dropped without running (the rollback's action)."""
        if not self.recovery.take_drop():
            return False
        step, self.last_action = self.step_count, "drop_batch"
        self.step_count += 1
        self.recorder.skip(step, reason="rollback: dropping the batch after a bad one")
        log.warning("nanguard: step %d: batch dropped after rollback", step)
        return True

    def _bad_batch(self, batch: Any) -> bool:
        """check_batch before the forward. Ranks agree first: under DDP one rank cannot skip
        its forward and backward while the others all-reduce gradients."""
        if not self.config.check_batch or in_join(self.model):
            return False  # under DDP join() a rank out of batches could not take part in the agreement
        diag = self.diagnoser.rejected_batch(batch, self.step_count) if batch is not None else None
        flagged = dist.agree_flag(diag is not None)
        if not flagged:
            return False
        step = self.step_count
        self.step_count += 1
        diag = dist.gather_diagnosis(diag, flagged)
        assert diag is not None  # a flagged rank always contributes its diagnosis
        diag.step = step
        diag = with_bad_rows(diag, batch, self._remedies.rows())
        self._act(Verdict("trip", step, diagnosis=diag), batch, None, restore_buffers=False)
        return True

    def _check_replicas(self, step: int) -> None:
        """Compare the replicas' fingerprints; a mismatch is a verdict for the policy."""
        check = dist.replica_mismatch(self.model)
        if check.ranks:
            diag = replica_divergence(step=step, **vars(check))
            self._act(Verdict("replicas", step, diagnosis=diag, source=check.source), None, None, restore_buffers=False)

    # -- decide and apply ----------------------------------------------------------------
    def _act(self, verdict: Verdict, batch: Any, rng: Rng | None, *, restore_buffers: bool) -> bool:
        """The policy's action for ``verdict``, applied; True when the update goes ahead. On a trip
        while a rank has joined (DDP join()), that rank learns whether the policy stopped the run."""
        h = verdict.health
        if h is None or not h.joined or (verdict.kind != "trip" and not tells_every_step(self)):
            return self._apply(verdict, batch, rng, restore_buffers=restore_buffers)
        with telling_joined(h, verdict.step):
            return self._apply(verdict, batch, rng, restore_buffers=restore_buffers)

    def _apply(self, verdict: Verdict, batch: Any, rng: Rng | None, *, restore_buffers: bool) -> bool:
        if verdict.diagnosis is not None:
            self.last_diagnosis = verdict.diagnosis
        action = self.policy.decide(verdict, self._state)
        if action is STEP:
            self._pending = verdict.health
            return True
        kind = action.kind
        if kind == "overflow":
            return False
        diag = verdict.diagnosis
        if diag is None:  # a spike skip: no diagnosis of its own
            assert kind == "skip" and verdict.spikes and verdict.health is not None
            # As in a run that never saw the batch: its values leave the detectors' windows too.
            self.history.forget(verdict.step, loss=verdict.health.loss, grad_norm=verdict.health.grad_norm)
            self.recovery.abandon(restore_buffers, rng)
            spike = verdict.spikes[0]
            self._skip(verdict, f"{spike.metric} spike (z={spike.score:.1f})", action)
            return False
        if action.remedy is not None:
            self._remedies.apply(action.remedy, diag, verdict.step)
        if verdict.kind in ("collapse", "replicas"):
            self._repair(verdict, diag, action)
            return False
        self._track(diag, verdict.step, kind)
        flagged = diag.evidence.get("flagged_ranks", [self.rank])
        extra = {"where": self.tracker.here, **({"module_stats": verdict.module_stats} if verdict.module_stats else {})}
        self.recorder.trip_and_bundle(
            verdict.step,
            action=kind,
            ranks=flagged,
            diagnosis=diag,
            batch=batch,
            rng=rng,
            meta=self._bundle_meta,
            **extra,
        )
        _announce(self.rank, verdict.step, diag, kind)
        if kind == "raise":
            self.last_action = "raise"
            raise NonFiniteError(diag, action.message)
        if kind == "rollback":
            self._rollback(verdict.step, diag, action)
        else:
            self._skip(verdict, diag.cause, action)
        return False

    def _repair(self, verdict: Verdict, diag: Diagnosis, action: Action) -> None:
        """A collapsed loss scale (reset it, or stop) or replicas that differ (resync, roll back, or stop)."""
        kind, step = action.kind, verdict.step
        if kind == "reset_scale":
            assert self.scaler is not None
            self._remedies.reset_scale(self.scaler)
            self.recovery.reset_overflow_streak()
            return
        ranks = [self.rank] if verdict.kind == "collapse" else diag.ranks
        if verdict.kind == "replicas":  # every rank compares fingerprints: the tracker's gather is safe
            self._track(diag, step, kind)
        self.recorder.trip(step, action=kind, ranks=ranks, diagnosis=diag)
        if verdict.kind == "replicas":
            _announce(self.rank, step, diag, kind)
        if kind == "raise":
            raise NonFiniteError(diag, action.message)
        if kind == "rollback":
            self._rollback(step, diag, action, count=False)
        else:
            assert verdict.source is not None  # the policy resyncs only from a finite replica
            dist.broadcast_state(self.model, src=verdict.source)
        self.health.forget_update()  # the queued parameter check saw the replicas before the repair

    def _rollback(self, step: int, diag: Diagnosis, action: Action, *, count: bool = True) -> None:
        onset = self.history.onset()  # a steady growth under way: land before it began
        why = self.recovery.why_restored(onset)
        restored = self.recovery.rollback(diag, onset)
        if action.lower_lr:
            # Snapshot again, so a later rollback restores the lowered LR, not the one that diverged.
            self._remedies.lower_lr()
            self.recovery.take_snapshot(restored)
        self.health.forget_update()
        self.recorder.rollback(
            step, restored_step=restored, skip_batches=self.recovery.drop_batches, reason=diag.cause, why=why
        )
        if count:
            self.last_action = "rollback"
            self.recovery.count_in_a_row()
            self._stop_if(action, diag)

    def _skip(self, verdict: Verdict, reason: str, action: Action) -> None:
        h = verdict.health
        self.recovery.skip()
        self.last_action = "skip"
        self.recorder.skip(verdict.step, reason)
        self.recorder.step(
            verdict.step,
            loss=h.own_loss if h else None,
            grad_norm=h.grad_norm if h else None,
            scale=h.scale if h else None,
            skipped=True,
        )
        self.recovery.count_in_a_row()
        self._stop_if(action, self.last_diagnosis)

    def _stop_if(self, action: Action, diag: Diagnosis | None) -> None:
        if action.stop is not None:
            raise NonFiniteError(diag, action.stop)

    def _update(self, *, device_step: bool) -> None:
        """The optimizer update of a healthy step (the device path has done it already)."""
        if self.config.clip_grad_norm is not None:
            self._clip()
        if self.scaler is not None:
            scaler_step(self.optimizer, self.scaler)
        elif not device_step:
            self.optimizer.step()

    def _clip(self) -> None:
        """``clip_grad_norm``, after the check that measured (and recorded) the norm before it: over
        what ``clip_grad_norm_(model.parameters())`` clips, in its order (the norm's rounding follows
        the order), then any parameter only the optimizer holds."""
        if self.config.clip_grad_norm is not None:
            params = list({id(p): p for p in [*self.model.parameters(), *self._params]}.values())
            torch.nn.utils.clip_grad_norm_(params, self.config.clip_grad_norm)

    def _headroom(self, replay: Callable[[], Any] | None, rng: Rng | None) -> None:
        """Every ``headroom_every``-th step's overflow headroom, where the step itself was not
        measured as it ran (compiled models, ``check()``): on a replay of its closure with
        communication off, never on the compiled step that updates the weights."""
        check, step = self._remedies.headroom, self.step_count - 1
        run = _scaler_aside(self.scaler, replay)
        if run is None or not check.due(step):
            return
        check.replay(
            step,
            lambda: dist.replay_locally(self.model, run),
            params=self._params,
            rng=rng,
            cuda_devices=self._cuda_devices,
        )

    # -- around the step -----------------------------------------------------------------
    def _begin_drill(self) -> NullInjector:
        """Plant this step's faults; the injector then wraps its closure (``step``) or loss (``check``)."""
        self._spikes_before = self.history.spikes
        self.injector.begin(self.step_count)
        return self.injector

    def _end_drill(self) -> None:
        self.injector.end(
            action=self.last_action, diagnosis=self.last_diagnosis, spiked=self.history.spikes > self._spikes_before
        )

    def _track(self, diag: Diagnosis, step: int, action: str) -> None:
        """Which planted faults the trip answers, and where it ran, into its diagnosis and the run's
        hardware tracker (``guard/tracker.py``)."""
        self.injector.mark(diag, step, action)
        try:
            self.tracker.trip(diag, step)
        except Exception as err:  # evidence only: nanguard's own failure must not kill training
            warnings.warn(f"nanguard: could not track the hardware of step {step}'s trip: {err!r}", stacklevel=4)

    def _settle(self) -> None:
        """Deferred mode: read the last step's flags (its update is running on the device, which
        skipped it if bad) and finish that step as the immediate path would have."""
        w, self._waiting = self._waiting, None
        if w is None:
            return
        h = w.copy.read(w.step, scaled=False)
        self._closure_error = w.closure_error
        assert w.rng is not None
        try:
            with self._undo_on_error(w.rng):
                verdict = self._verdict(h, w.replay, w.batch, w.rng, True, updated=True)
                if self._act(verdict, w.batch, w.rng, restore_buffers=True):
                    self.after_step()
        finally:
            self._end_drill()

    def _run_closure(self, closure: Callable[[], Any]) -> tuple[Any, Any, BaseException | None]:
        """The step's forward and backward: (loss, its value, the index error a CPU forward raised)."""
        try:
            riding = self.health.riding(self._calls - 1)
            with torch.enable_grad(), riding, self._remedies.headroom.watch(self.step_count):
                loss = closure()
            return loss, _loss_value(loss, "the closure's return value", allow_none=False), None
        except (IndexError, RuntimeError) as err:
            if not _index_error(err):
                raise
            if dist.is_distributed():
                # The other ranks are already in the gradient all-reduce: joining them is
                # impossible, so fail loudly rather than hang. check_batch=True catches it first.
                log.error(
                    "nanguard: the forward raised on rank %d; use Guard(check_batch=True) under "
                    "torch.distributed to catch out-of-range ids before the forward",
                    self.rank,
                )
                raise
            # An out-of-range id raises on CPU. This rank still joins the agreement, flagged
            # by a NaN loss, and its replay turns the error into a data diagnosis.
            dist.zero_grad(self.model)
            nan = torch.full((), math.nan, device=self._params[0].device if self._params else None)
            return nan, nan, err

    @contextlib.contextmanager
    def _undo_on_error(self, rng: Rng) -> Iterator[None]:
        """An error in the closure or a replay (even ``KeyboardInterrupt``) leaves no trace of the
        step; the policy's own ``NonFiniteError`` comes after the state was restored."""
        count = self.step_count
        try:
            yield
        except BaseException as err:
            if not isinstance(err, NonFiniteError):
                self.recovery.undo(rng, unscaled=self.step_count != count)  # unscale_ comes before the count
                self.step_count, self._pending = count, None
            raise

    def _plain_step(self, closure: Callable[[], Any]) -> Any:
        """The step of a disabled guard (NANGUARD_DISABLE=1): what the loop would do without nanguard."""
        self.step_count += 1
        self.last_action = "step"
        loss = closure()
        if self.scaler is not None:
            scaler_step(self.optimizer, self.scaler)
        else:
            self.optimizer.step()
        return loss

    def _bundle_meta(self) -> dict[str, Any]:
        return {**self.history.tail(), "fingerprint": dist.fingerprint(self.model)}

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Counters, history and detector windows, so a resumed run keeps them."""
        self._settle()
        return {
            "step_count": self.step_count,
            **self.recovery.state_dict(),
            **self.history.state_dict(),
            "last_diagnosis": self.last_diagnosis.to_dict() if self.last_diagnosis else None,
            "remedies": {**self._remedies.state_dict(), **self.policy.state_dict()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_state(state, self.config)  # a bad entry is a ValueError, and nothing is applied
        self.step_count = int(state.get("step_count", 0))
        self.recovery.load_state_dict(state)
        self.history.load_state_dict(state)
        last = state.get("last_diagnosis")
        self.last_diagnosis = Diagnosis.from_dict(last) if last else None
        remedies = state.get("remedies") or {}
        self._remedies.load_state_dict(remedies)
        self.policy.load_state_dict(remedies)

    def close(self) -> None:
        self._settle()
        self.recorder.end(self.step_count, skipped=self.skipped, rollbacks=self.rollbacks)
        self.recorder.close()


class _PolicyState:
    """What the policy reads of the guard's parts (``policy.State``), read only when it asks."""

    def __init__(self, guard: Guard) -> None:
        # Weakly: the guard holds this, and a cycle would keep the guard, its model and (under DDP)
        # the process group alive until a garbage collection, perhaps into interpreter shutdown.
        self._guard = weakref.proxy(guard)

    @property
    def has_snapshot(self) -> bool:
        return self._guard.recovery.snapshot is not None

    @property
    def consecutive_skips(self) -> int:
        return self._guard.recovery.consecutive_skips

    @property
    def upcast(self) -> list[str]:
        return self._guard._remedies.upcast

    @property
    def last_diagnosis(self) -> Diagnosis | None:
        return self._guard.last_diagnosis

    def can_upcast(self, module: str | None) -> str | None:
        return self._guard._remedies.can_upcast(module)


@dataclass(frozen=True)
class _Waiting:
    """A deferred step whose flags are on their way to the host, and what its replay needs."""

    step: int
    copy: HostCopy
    replay: Callable[[], Any] | None
    batch: Any
    rng: Rng | None
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
            if note is not None and hasattr(err, "add_note"):  # Python 3.11+: 3.10 keeps the error as it was
                err.add_note(note)
        raise


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


def _check_parts(model: Any, optimizer: Any, scaler: Any, scheduler: Any) -> Any:
    """The Guard's parts checked (a ValueError names the wrong one); returns the scaler to use."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    scaler = guard_scaler(optimizer, scaler)  # an Accelerate optimizer brings its own
    for obj, name, methods in [
        (scaler, "scaler", ("is_enabled", "unscale_", "step", "update", "get_scale", "state_dict")),
        (scheduler, "scheduler", ("step", "state_dict", "load_state_dict")),
    ]:
        if obj is not None and not all(callable(getattr(obj, m, None)) for m in methods):
            raise ValueError(f"{name} must be None or have the methods {', '.join(methods)}, got {type(obj).__name__}")
    return scaler


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
