"""Apply: carry out the policy's ``Action`` for a measured step, and record it.

``Apply`` switches on the action alone (the verdict only supplies the data): its kind (step,
skip, rollback, raise, the GradScaler's own skip, a reset of a collapsed scale, a resync of
replicas that differ) and how its trip is recorded (``Action.trip``: events, the trip's bundle,
the log line). It applies the remedy the policy chose, and stops the run when the policy says so.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch import nn

from nanguard import dist
from nanguard.announce import Announcer
from nanguard.errors import NonFiniteError
from nanguard.findings import Diagnosis
from nanguard.guard.attempt import Attempt
from nanguard.guard.config import GuardConfig
from nanguard.guard.health import HealthCheck
from nanguard.guard.history import History
from nanguard.guard.join import telling_joined, tells_every_step
from nanguard.guard.policy import STEP, Action, Verdict
from nanguard.guard.progress import Progress
from nanguard.guard.recorder import NullRecorder
from nanguard.guard.recovery import Recovery
from nanguard.guard.remedies import Remedies
from nanguard.guard.trip import Trip
from nanguard.guard.wrapped import scaler_step
from nanguard.hardware import Tracker
from nanguard.inject import NullInjector

__all__ = ["Apply"]

log = logging.getLogger("nanguard")


class Apply:
    """Carries out actions over the guard's parts; ``progress`` gets the latest action.

    Example:
        >>> apply(attempt, verdict, policy.decide(verdict, state))   # True: the update goes ahead
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
        self.announce = Announcer()  # the run's first trip whole, later ones a line

    def __call__(self, attempt: Attempt, verdict: Verdict, action: Action) -> bool:
        """Apply ``action``; True when the update goes ahead. On a trip while a rank has joined
        (DDP join()), and on every step where a stop it cannot foresee may come (``tells_every_step``),
        that rank learns whether the policy stopped the run."""
        h = verdict.health
        every = tells_every_step(self.scaler is not None, self.config.skip_spikes)
        if h is not None and h.joined and (action.trip == "bundle" or every):
            with telling_joined(h, verdict.step):  # the joined rank waits for this flag: see join.py
                return action is STEP or self._apply(attempt, verdict, action)
        return action is STEP or self._apply(attempt, verdict, action)

    def _apply(self, attempt: Attempt, verdict: Verdict, action: Action) -> bool:
        kind, step = action.kind, verdict.step
        if kind == "overflow":
            return False
        if action.forget:  # a spike's skip: no trip, no diagnosis
            self._forget(attempt, verdict, action)
            return False
        diag = verdict.diagnosis
        assert diag is not None, f"a {kind} action of a step with a {verdict.kind} verdict"
        if action.remedy is not None:
            self.remedies.apply(action.remedy, diag, step)
        if kind == "reset_scale":
            assert self.scaler is not None
            self.remedies.reset_scale(self.scaler)
            self.recovery.reset_overflow_streak()
            return False
        diag = self._record(attempt, verdict, diag, action)
        if kind == "raise":
            if action.trip == "bundle":
                self.progress.action = "raise"
            raise NonFiniteError(diag, action.message)
        if kind == "rollback":
            self._rollback(step, diag, action)
        elif kind == "resync":
            assert verdict.source is not None  # the policy resyncs only from a finite replica
            dist.broadcast_state(self.model, src=verdict.source)
            self.health.forget_update()  # the queued parameter check saw the replicas before the repair
        else:
            self._skip(verdict, diag.cause, action)
        return False

    def _forget(self, attempt: Attempt, verdict: Verdict, action: Action) -> None:
        """Skip a spike: as in a run that never saw the batch, its values leave the detectors' windows too."""
        assert action.kind == "skip" and verdict.spikes and verdict.health is not None
        self.history.forget(verdict.step, loss=verdict.health.loss, grad_norm=verdict.health.grad_norm)
        self.recovery.abandon(attempt.owns_buffers, attempt.rng)
        spike = verdict.spikes[0]
        self._skip(verdict, f"{spike.metric} spike (z={spike.score:.1f})", action)

    def _record(self, attempt: Attempt, verdict: Verdict, diag: Diagnosis, action: Action) -> Diagnosis:
        """Record the trip as ``action.trip`` says; returns its diagnosis as recorded."""
        kind, step = action.kind, verdict.step
        if action.trip == "event":  # a collapsed loss scale: this rank's trip event alone
            self.recorder.trip(step, action=kind, ranks=[self.rank], diagnosis=diag)
            return diag
        trip = self._trip(diag, step, kind)  # every rank records it: the tracker's gather is safe
        if action.trip == "tracked":  # replicas that differ
            diag = self.progress.diagnosis = trip.diagnosis
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
            diag = self.progress.diagnosis = trip.with_bundle(bundle).diagnosis
        self.announce(self.rank, step, diag, kind)
        return diag

    def _rollback(self, step: int, diag: Diagnosis, action: Action) -> None:
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
        if action.counted:
            self.progress.action = "rollback"
            self.recovery.count_in_a_row()
            _stop_if(action, diag)

    def _skip(self, verdict: Verdict, reason: str, action: Action) -> None:
        h = verdict.health
        self.recovery.skip()
        self.progress.action = "skip"
        self.recorder.skip(verdict.step, reason)
        self.recorder.step(
            verdict.step,
            loss=h.own_loss if h else None,
            grad_norm=h.grad_norm if h else None,
            scale=h.scale if h else None,
            skipped=True,
        )
        self.recovery.count_in_a_row()
        _stop_if(action, self.progress.diagnosis)

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

    def drop_batch(self) -> None:
        """One of the batches after a rollback (``rollback_skip_batches``): counted, not run."""
        step, self.progress.action = self.progress.step, "drop_batch"
        self.progress.step += 1
        self.recorder.skip(step, reason="rollback: dropping the batch after a bad one")
        log.warning("nanguard: step %d: batch dropped after rollback", step)

    # -- the update ----------------------------------------------------------------------
    def update(self, *, device_step: bool) -> None:
        """The optimizer update of a healthy step (the device path has done it already)."""
        if self.config.clip_grad_norm is not None:
            self.clip()
        if self.scaler is not None:
            scaler_step(self.optimizer, self.scaler)
        elif not device_step:
            self.optimizer.step()

    def clip(self) -> None:
        """``clip_grad_norm``, after the check that measured (and recorded) the norm before it: over
        what ``clip_grad_norm_(model.parameters())`` clips, in its order (the norm's rounding follows
        the order), then any parameter only the optimizer holds."""
        if self.config.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.clip_params(), self.config.clip_grad_norm)

    def clip_params(self) -> list[torch.Tensor]:
        return list({id(p): p for p in [*self.model.parameters(), *self.params]}.values())


def _stop_if(action: Action, diag: Diagnosis | None) -> None:
    if action.stop is not None:
        raise NonFiniteError(diag, action.stop)
