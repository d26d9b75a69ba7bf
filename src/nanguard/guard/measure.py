"""Measure: what one attempt at a step was, as a ``Verdict``, before anything is decided.

The step's health is read once (agreed across ranks); a non-finite step is replayed under
the tracer and diagnosed; a finite one feeds the spike detectors and the divergence check.
What the GradScaler does with an overflow (its own skip, a lower scale) is part of the
measurement: the policy then reads whether the scale collapsed.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from nanguard import compat, dist
from nanguard.diagnose import loss_scale_collapse, replica_divergence, runaway_growth
from nanguard.errors import OutOfStepError
from nanguard.findings import Diagnosis
from nanguard.guard.attempt import Attempt, scaler_aside
from nanguard.guard.config import GuardConfig
from nanguard.guard.diagnoser import Diagnoser, Replayed
from nanguard.guard.health import HealthCheck, HealthFlag, HostCopy, StepHealth
from nanguard.guard.history import Departure, History
from nanguard.guard.join import in_join
from nanguard.guard.optim_state import current_lr
from nanguard.guard.policy import Policy, Verdict
from nanguard.guard.progress import Progress
from nanguard.guard.recorder import NullRecorder
from nanguard.guard.recovery import Recovery
from nanguard.guard.remedies import Remedies, with_bad_rows
from nanguard.guard.wrapped import scaler_step
from nanguard.spikes import Spike

__all__ = ["Measure"]

log = logging.getLogger("nanguard")


class Measure:
    """Turns an attempt into its ``Verdict``: healthy, a spike, a trip (replayed and diagnosed),
    a GradScaler overflow or collapse, replicas that differ.

    Example:
        >>> verdict = measure.step(attempt, device_step=False)
        >>> verdict.kind
        'healthy'
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: Any,
        config: GuardConfig,
        health: HealthCheck,
        history: History,
        diagnoser: Diagnoser,
        recovery: Recovery,
        remedies: Remedies,
        recorder: NullRecorder,
        policy: Policy,
        progress: Progress,
        sharded: bool,
        deferred: bool,
    ) -> None:
        self.model, self.optimizer, self.scaler, self.config = model, optimizer, scaler, config
        self.health, self.history, self.diagnoser = health, history, diagnoser
        self.recovery, self.remedies, self.recorder = recovery, remedies, recorder
        self.policy, self.progress = policy, progress
        self.sharded, self.deferred = sharded, deferred

    def step(self, attempt: Attempt, *, device_step: bool) -> Verdict:
        """Read the step's health (the one host read) and diagnose a trip. With ``device_step`` the
        fused optimizer steps on the device now, skipping the update when any rank is bad; under
        ``sync="deferred"`` the read waits for the next call (a ``"deferred"`` verdict)."""
        step = attempt.step
        self.progress.step = step + 1
        health = self.health
        sharded = self.sharded or health.sharded
        # A sharded run's agreement adds up the ranks' own norms: a whole norm from the loop has no place in it.
        loop_norm = None if sharded else attempt.loop_norm
        if not device_step and health.alone:
            return self.verdict(health.read_alone(attempt.value, step, loop_norm), attempt, updated=False)
        measured = health.measure(attempt.value, loop_norm)
        agreed = measured.agree(sharded=sharded, carried=health.carried(), step=attempt.call)
        if device_step:
            copy = HostCopy(measured, agreed) if self.deferred else None  # queued before the update
            compat.step_with_found_inf(self.optimizer, measured.found_inf(agreed))
            if copy is not None:
                return Verdict("deferred", step, queued=copy)
        h = measured.read(step, agreed, scaled=self.scaler is not None)
        return self.verdict(h, attempt, updated=device_step)

    def verdict(self, h: StepHealth, attempt: Attempt, *, updated: bool) -> Verdict:
        """What a read step is: bad parameters (as loaded, or after an update), a GradScaler
        overflow, a trip (replayed and diagnosed), runaway growth, a spike, or healthy.
        ``updated``: the device path has applied the step's update already."""
        step = h.step
        self.progress.grad_norm = h.grad_norm
        if h.out_of_step:
            raise OutOfStepError(h.out_of_step)
        kind = h.trip_kind(scaled=self.scaler is not None)  # the branch a joined rank's shadow takes too
        if kind == "params":
            return self._bad_parameters(h, attempt)
        if kind == "overflow":
            return self._overflowed(h)
        if kind == "trip":
            return self._tripped(h, attempt)
        spikes = self._watch_trends(step, h)
        # Finite, but diverging: caught before the clip and the update (the device path has applied it).
        # Not while a rank has joined (DDP join()): it holds no history to follow the trip with.
        runaway = None if updated or h.joined else self.history.runaway(step, loss=h.loss, grad_norm=h.grad_norm)
        if runaway is not None:
            self.recovery.abandon(attempt.owns_buffers, attempt.rng)
            diag = runaway_growth(
                step=step,
                history=runaway,
                lr=current_lr(self.optimizer),
                # Every rank's growth, read from the agreed values: the same verdict on every rank.
                rank=0 if dist.is_distributed() else None,
                ranks=list(range(dist.world_size())) if dist.is_distributed() else [],
            )
            return Verdict("trip", step, h, diagnosis=diag)
        return Verdict("spike", step, h, spikes=spikes) if spikes else Verdict("healthy", step, h)

    def batch(self, batch: Any) -> Verdict | None:
        """check_batch before the forward: a trip verdict when any rank rejects its batch (the
        step is counted). Ranks agree first: under DDP one rank cannot skip its forward and
        backward while the others all-reduce gradients."""
        if not self.config.check_batch or in_join(self.model):
            return None  # under DDP join() a rank out of batches could not take part in the agreement
        step = self.progress.step
        diag = self.diagnoser.rejected_batch(batch, step) if batch is not None else None
        flagged = dist.agree_flag(diag is not None)
        if not flagged:
            return None
        self.progress.step = step + 1
        diag = dist.gather_diagnosis(diag, flagged)
        assert diag is not None  # a flagged rank always contributes its diagnosis
        diag = with_bad_rows(replace(diag, step=step), batch, self.remedies.rows())
        return Verdict("trip", step, diagnosis=diag)

    def replicas(self, step: int) -> Verdict | None:
        """Compare the replicas' fingerprints: a verdict when they differ."""
        check = dist.replica_mismatch(self.model)
        if not check.ranks:
            return None
        return Verdict("replicas", step, diagnosis=replica_divergence(step=step, **vars(check)), source=check.source)

    # -- the kinds of step ---------------------------------------------------------------
    def _bad_parameters(self, h: StepHealth, attempt: Attempt) -> Verdict:
        """Non-finite parameters: as built or loaded (no update of this guard wrote them), or
        written by the last update, whose step the verdict names."""
        step = h.step
        params_bad = h.ranks_with(HealthFlag.PARAMS)
        self.recovery.abandon(attempt.owns_buffers, attempt.rng)
        if loaded := h.ranks_with(HealthFlag.LOADED):
            diag = _or_unknown(lambda: self.diagnoser.loaded_parameters(step, loaded), step, h)
            return Verdict("trip", step, h, diagnosis=diag)
        diag = _or_unknown(lambda: self.diagnoser.nonfinite_update(step - 1, params_bad), step - 1, h)
        return Verdict("trip", step - 1, h, diagnosis=diag)

    def _tripped(self, h: StepHealth, attempt: Attempt) -> Verdict:
        """Replay a tripped step under the tracer: its diagnosis, with the batch rows that hold the bad values."""
        if attempt.owns_buffers:
            self.recovery.buffers.restore()  # the replays start from the step's own state...
        error, attempt.closure_error = attempt.closure_error, None
        replay = scaler_aside(self.scaler, attempt.replay)
        rng, batch = attempt.rng, attempt.batch
        replayed = _replayed_or_unknown(
            lambda: self.diagnoser.tripped(replay, h, rng=rng, batch=batch, closure_error=error, trained=attempt.value),
            h.step,
            h,
            error,
        )
        self.recovery.abandon(attempt.owns_buffers, rng)  # ...and leave none of theirs behind
        assert replayed.diagnosis is not None
        diag = with_bad_rows(replayed.diagnosis, batch, self.remedies.rows())
        return Verdict("trip", h.step, h, diagnosis=diag, module_stats=replayed.module_stats)

    def _overflowed(self, h: StepHealth) -> Verdict:
        """A GradScaler overflow: the scaler skips the update itself and lowers its scale; the
        policy says whether the scale has collapsed."""
        assert self.scaler is not None and h.scale is not None
        scaler_step(self.optimizer, self.scaler)
        self.recovery.count_overflow()
        new_scale, streak = float(self.scaler.get_scale()), self.recovery.overflow_streak
        self.progress.action = "overflow"
        self.recorder.overflow(h.step, scale=h.scale, new_scale=new_scale, streak=streak)
        self.recorder.step(h.step, loss=h.loss, grad_norm=None, scale=h.scale, skipped=True)
        if not self.policy.collapsed(new_scale, streak):
            return Verdict("overflow", h.step, h)
        diag = loss_scale_collapse(
            step=h.step,
            scale=new_scale,
            floor=self.config.loss_scale_floor,
            streak=streak,
            overflows=self.recovery.overflows,
            rank=dist.rank_or_none(),
        )
        return Verdict("collapse", h.step, h, diagnosis=diag)

    def _watch_trends(self, step: int, h: StepHealth) -> list[Spike]:
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
        if departed := self.history.departed(step, loss=h.loss, grad_norm=h.grad_norm):
            self._warn(step, departed)
        return spikes

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
