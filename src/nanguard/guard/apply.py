"""Apply: carry out the policy's ``Action`` for a measured step, and record it: the step's only writer.

``Measure`` only reads (health, history, the diagnosis); everything a step changes is done here:
the events a measurement found (spikes, a forecast), the GradScaler's own step on an overflow,
undoing an abandoned attempt, the action's kind (step, skip, rollback, raise, a reset of a
collapsed scale, a resync of replicas that differ), the one ``Trip`` and its bundle
(``Action.trip``), the remedy the policy chose, the counters. Where the run then stands comes
back as an ``Outcome`` (frozen) that the guard folds into its ``Progress``; a stop the policy
chose comes back in it too (``Outcome.error``), raised once the outcome is folded.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nanguard import dist
from nanguard.announce import Announcer
from nanguard.errors import NonFiniteError
from nanguard.findings import Diagnosis
from nanguard.guard.attempt import Attempt
from nanguard.guard.config import GuardConfig
from nanguard.guard.health import HealthCheck, StepHealth
from nanguard.guard.history import Departure, History
from nanguard.guard.join import tell_joined, tells_every_step
from nanguard.guard.optim_state import current_lr
from nanguard.guard.policy import DEFER, STEP, Action
from nanguard.guard.progress import Outcome, Progress
from nanguard.guard.recorder import NullRecorder
from nanguard.guard.recovery import Recovery
from nanguard.guard.remedies import Remedies
from nanguard.guard.trip import Trip
from nanguard.guard.verdict import Verdict
from nanguard.guard.wrapped import scaler_step
from nanguard.hardware import Tracker
from nanguard.inject import NullInjector

__all__ = ["Apply", "Outcome"]

log = logging.getLogger("nanguard")


@dataclass(frozen=True, slots=True)
class _Done:
    """What one action did, before it becomes the step's ``Outcome``."""

    action: str | None = None
    diagnosis: Diagnosis | None = None
    error: NonFiniteError | None = None


_NOTHING = _Done()
_SPIKE = "nanguard: step %d: %s%s spike %.4g (median %.4g, z=%.1f)"
_STEPPED = Outcome(action="step")


class Apply:
    """Carries out actions over the guard's parts; reads ``progress``, returns an ``Outcome``.

    Example:
        >>> outcome = apply(attempt, verdict, policy.decide(verdict, state))
        >>> outcome.update   # the update goes ahead
        True
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: Any,
        config: GuardConfig,
        params: list[torch.Tensor],
        health: HealthCheck,
        history: History,
        recovery: Recovery,
        remedies: Remedies,
        recorder: NullRecorder,
        injector: NullInjector,
        tracker: Tracker,
        progress: Progress,
    ) -> None:
        self.model, self.optimizer, self.scaler, self.config = model, optimizer, scaler, config
        self.params = params
        self.health, self.history, self.recovery, self.remedies = health, history, recovery, remedies
        self.recorder, self.injector, self.tracker, self.progress = recorder, injector, tracker, progress
        self.rank = dist.rank()
        self.tells_every_step = tells_every_step(scaler is not None, config.skip_spikes)
        self.announce = Announcer()  # the run's first trip whole, later ones a line

    def __call__(self, attempt: Attempt, verdict: Verdict, action: Action) -> Outcome:
        """Apply ``action``; the outcome says whether the update goes ahead. On a trip while a rank
        has joined (DDP join()), and on every step where a stop it cannot foresee may come
        (``tells_every_step``), that rank learns whether the policy stopped the run."""
        h = verdict.health
        if verdict.spikes or verdict.forecast is not None or verdict.departure is not None or verdict.own_spike:
            self._record_trends(verdict)
        done = _NOTHING if action is STEP or action is DEFER else self._apply(attempt, verdict, action)
        if h is not None and (action.trip == "bundle" or self.tells_every_step) and h.joined:
            tell_joined(done.error is not None, verdict.step)  # the joined rank waits for this: see join.py
        return Outcome(
            step=attempt.step + 1,
            action=done.action,
            diagnosis=done.diagnosis or verdict.diagnosis,
            grad_norm=h.grad_norm if h is not None else None,
            update=action is STEP,
            error=done.error,
        )

    def _apply(self, attempt: Attempt, verdict: Verdict, action: Action) -> _Done:
        kind, step = action.kind, verdict.step
        if verdict.overflow is not None:  # the GradScaler skips the update itself and lowers its scale
            self._overflow(verdict)
            if kind == "overflow":
                return _Done("overflow")
        if verdict.kind == "trip" and verdict.health is not None:  # a measured attempt: leave none of its writes
            self.recovery.abandon(attempt.owns_buffers, attempt.rng)
        if action.forget:  # a spike's skip: no trip, no diagnosis
            return self._forget(attempt, verdict, action)
        diag = verdict.diagnosis
        assert diag is not None, f"a {kind} action of a step with a {verdict.kind} verdict"
        if action.remedy is not None:
            self.remedies.apply(action.remedy, diag, step)
        if kind == "reset_scale":
            assert self.scaler is not None
            self.remedies.reset_scale(self.scaler)
            self.recovery.reset_overflow_streak()
            return _Done("overflow")
        diag = self._record(attempt, verdict, diag, action)
        return _CARRY_OUT.get(kind, Apply._skip_diagnosed)(self, verdict, diag, action)

    # -- the actions a diagnosed step takes, by ``Action.kind`` (``_CARRY_OUT``) ------------
    def _raise(self, verdict: Verdict, diag: Diagnosis, action: Action) -> _Done:
        ran = "raise" if action.trip == "bundle" else ("overflow" if verdict.overflow is not None else None)
        return _Done(ran, diag, NonFiniteError(diag, action.message))

    def _rolled_back(self, verdict: Verdict, diag: Diagnosis, action: Action) -> _Done:
        return self._rollback(verdict.step, diag, action)

    def _resync(self, verdict: Verdict, diag: Diagnosis, action: Action) -> _Done:
        assert verdict.source is not None  # the policy resyncs only from a finite replica
        dist.broadcast_state(self.model, src=verdict.source)
        self.health.forget_update()  # the queued parameter check saw the replicas before the repair
        return _Done(None, diag)

    def _skip_diagnosed(self, verdict: Verdict, diag: Diagnosis, action: Action) -> _Done:
        return self._skip(verdict, diag.cause, action, diag)

    def _record_trends(self, verdict: Verdict) -> None:
        """A finite step's spikes and divergence warning, as the measure found them: logged and recorded."""
        step = verdict.step
        for spike in verdict.spikes or ():
            self.recorder.spike(step, spike)
            log.warning(_SPIKE, step, "", spike.metric, spike.value, spike.median, spike.score)
        if (own := verdict.own_spike) is not None:
            self.recorder.spike(step, own, own=True)
            log.warning(_SPIKE, step, f"rank {self.rank}'s own ", own.metric, own.value, own.median, own.score)
        if (trend := verdict.forecast) is not None:
            self.recorder.forecast(step, trend)
            log.warning(
                "nanguard: step %d: %s %.4g grows x%.3g per step: float32 overflow predicted in %d steps",
                step,
                trend.metric,
                trend.value,
                trend.growth,
                trend.predicted_overflow_in,
            )
        if verdict.departure is not None:
            self._warn(step, verdict.departure)

    def _warn(self, step: int, d: Departure) -> None:
        """A run leaving its level by an order of magnitude: a ``warning`` event naming the LR, logged once."""
        lr = current_lr(self.optimizer)
        what = "the loss" if d.signal == "loss" else "the gradient norm (before any clip)"
        fix = (
            f"lower the learning rate (lr={lr}), e.g. tenfold, or add warmup: {what} grew x{d.growth:.3g} "
            "from its recent level; a gradient clip keeps the values finite, not the run"
        )
        self.recorder.warning(
            step,
            signal=d.signal,
            module=None,
            value=d.value,
            trend=d.trend,
            steps_left=d.steps_left,
            fix=fix,
            lr=lr,
            level=d.level,
        )
        log.warning(
            "nanguard: step %d: %s %.4g is x%.3g its recent level %.4g (lr=%s): the run is diverging; %s",
            step,
            d.signal,
            d.value,
            d.growth,
            d.level,
            lr,
            fix,
        )

    def _overflow(self, verdict: Verdict) -> None:
        """A GradScaler overflow (the scaler skipped the update and lowered its scale): counted and recorded."""
        h, new_scale = verdict.health, verdict.overflow
        assert h is not None and h.scale is not None and new_scale is not None
        self.recovery.count_overflow()
        self.recorder.overflow(h.step, scale=h.scale, new_scale=new_scale, streak=self.recovery.overflow_streak)
        self.recorder.step(h.step, loss=h.loss, grad_norm=None, scale=h.scale, skipped=True)

    def _forget(self, attempt: Attempt, verdict: Verdict, action: Action) -> _Done:
        """Skip a spike: as in a run that never saw the batch, its values leave the detectors' windows too."""
        assert action.kind == "skip" and verdict.spikes and verdict.health is not None
        self.history.forget(verdict.step, loss=verdict.health.loss, grad_norm=verdict.health.grad_norm)
        self.recovery.abandon(attempt.owns_buffers, attempt.rng)
        spike = verdict.spikes[0]
        return self._skip(verdict, f"{spike.metric} spike (z={spike.score:.1f})", action, None)

    def _record(self, attempt: Attempt, verdict: Verdict, diag: Diagnosis, action: Action) -> Diagnosis:
        """Record the trip as ``action.trip`` says; returns its diagnosis as recorded."""
        kind, step = action.kind, verdict.step
        if action.trip == "event":  # a collapsed loss scale: this rank's trip event alone
            self.recorder.trip(step, action=kind, ranks=[self.rank], diagnosis=diag)
            return diag
        trip = self._trip(diag, step, kind)  # every rank records it: the tracker's gather is safe
        if action.trip == "tracked":  # replicas that differ
            diag = trip.diagnosis
            self.recorder.trip(step, action=kind, ranks=diag.ranks, diagnosis=diag)
        else:
            flagged = trip.diagnosis.evidence.get("flagged_ranks", [self.rank])
            stats = verdict.module_stats
            extra = {"where": self.tracker.here, **({"module_stats": stats} if stats else {})}
            bundle = self.recorder.trip_and_bundle(
                step,
                action=kind,
                ranks=flagged,
                diagnosis=trip.diagnosis,
                batch=attempt.batch,
                rng=attempt.rng,
                meta=self._bundle_meta(attempt.batch),
                **extra,
            )
            diag = trip.with_bundle(bundle).diagnosis
        self.announce(self.rank, step, diag, kind)
        return diag

    def _rollback(self, step: int, diag: Diagnosis, action: Action) -> _Done:
        onset = self.history.onset()  # a steady growth under way: land before it began
        why = self.recovery.why_restored(onset)
        restored = self.recovery.rollback(diag, onset)
        if action.lower_lr:
            # Snapshot again, so a later rollback restores the lowered LR, not the one that diverged.
            self.remedies.lower_lr()
            self.recovery.take_snapshot(restored)
        self.health.forget_update()
        self.recorder.rollback(
            step, restored_step=restored, skip_batches=self.recovery.drop_batches, reason=diag.cause, why=why
        )
        if not action.counted:
            return _Done(None, diag)
        self.recovery.count_in_a_row()
        return _Done("rollback", diag, _stop(action, diag))

    def _skip(self, verdict: Verdict, reason: str, action: Action, diag: Diagnosis | None) -> _Done:
        h = verdict.health
        self.recovery.skip()
        self.recorder.skip(verdict.step, reason)
        self.recorder.step(
            verdict.step,
            loss=h.own_loss if h else None,
            grad_norm=h.grad_norm if h else None,
            scale=h.scale if h else None,
            skipped=True,
        )
        self.recovery.count_in_a_row()
        return _Done("skip", diag, _stop(action, diag or self.progress.diagnosis))

    def _trip(self, diag: Diagnosis, step: int, action: str) -> Trip:
        """The trip's record: which planted faults it answers, and where it ran (the run's hardware
        tracker, ``nanguard.hardware``, records it too)."""
        injected = self.injector.mark(diag.cause, step, action)
        try:
            hardware = self.tracker.trip(diag, step, injected=bool(injected))
        except Exception as err:  # evidence only: nanguard's own failure must not kill training
            warnings.warn(f"nanguard: could not track the hardware of step {step}'s trip: {err!r}", stacklevel=4)
            hardware = {}
        return Trip(diag, step, action, injected, hardware)

    def _bundle_meta(self, batch: Any) -> dict[str, Any]:
        """What a trip's bundle keeps besides the batch: the recent history and the weights' fingerprint."""
        if not self.recorder.keeps_bundle(batch):
            return {}
        try:
            return {**self.history.tail(), "fingerprint": dist.fingerprint(self.model)}
        except Exception as err:  # evidence only: the bundle is written without it
            return {"meta_error": repr(err)}

    def engine_trip(self, step: int, diag: Diagnosis, *, action: str, ranks: list[int], **extra: Any) -> None:
        """Record an engine's own verdict (``Guard.engine_verdict``): a trip event; nothing else changes."""
        self.recorder.trip(step, action=action, ranks=ranks, diagnosis=diag, **extra)

    def drop_batch(self) -> Outcome:
        """One of the batches after a rollback (``rollback_skip_batches``): counted, not run."""
        step = self.progress.step
        self.recorder.skip(step, reason="rollback: dropping the batch after a bad one")
        log.warning("nanguard: step %d: batch dropped after rollback", step)
        return Outcome(step=step + 1, action="drop_batch")

    # -- the update ----------------------------------------------------------------------
    def update(self, *, device_step: bool) -> None:
        """The optimizer update of a healthy step (the device path has done it already)."""
        if self.config.clip_grad_norm is not None:
            self.clip()
        if self.scaler is not None:
            scaler_step(self.optimizer, self.scaler)
        elif not device_step:
            self.optimizer.step()

    def updated(self, h: StepHealth) -> int:
        """A finished update, counted: the parameter check queued, the history appended. The good steps so far."""
        self.health.after_update(h.step)
        good_steps = self.recovery.good_step()
        self.history.append(h.step, loss=h.loss, grad_norm=h.grad_norm)
        return good_steps

    def finish(self, h: StepHealth, *, snapshot: bool) -> Outcome:
        """The end of a finished update: the snapshot when due, the step event every ``log_every``."""
        if snapshot:
            self.recovery.refresh_snapshot(self.progress.step, h.loss, self.history.growing, joined=bool(h.joined))
        if h.step % self.config.log_every == 0:
            self.recorder.step(h.step, loss=h.own_loss, grad_norm=h.grad_norm, scale=h.scale, skipped=False)
        return _STEPPED

    def clip(self) -> None:
        """``clip_grad_norm``, after the check that measured (and recorded) the norm before it: over
        what ``clip_grad_norm_(model.parameters())`` clips, in its order (the norm's rounding follows
        the order), then any parameter only the optimizer holds."""
        if self.config.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.clip_params(), self.config.clip_grad_norm)

    def clip_params(self) -> list[torch.Tensor]:
        return list({id(p): p for p in [*self.model.parameters(), *self.params]}.values())


def _stop(action: Action, diag: Diagnosis | None) -> NonFiniteError | None:
    return NonFiniteError(diag, action.stop) if action.stop is not None else None


_CARRY_OUT: dict[str, Callable[[Apply, Verdict, Diagnosis, Action], _Done]] = {
    "raise": Apply._raise,
    "rollback": Apply._rolled_back,
    "resync": Apply._resync,
}
"""What ``Apply._apply`` does for a diagnosed step's action, by kind, once recorded (else: skip)."""
