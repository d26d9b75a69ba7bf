"""Measure: what one attempt at a step was, as a ``Verdict``, before anything is decided.

The step's health is read once (agreed across ranks); a non-finite step is replayed under
the tracer and diagnosed; a finite one feeds the spike detectors and the divergence check.
Measuring only reads (the history's detectors, the replay's own undone writes and, on an
overflow, the GradScaler's own step aside: only the scaler knows the scale it sets, which the
policy reads): the events, the overflow's count, undoing the attempt and every change of where
the run stands are ``guard/apply.py``'s.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from nanguard import dist
from nanguard.agreement import Layout
from nanguard.diagnose import loss_scale_collapse, replica_divergence, runaway_growth
from nanguard.errors import OutOfStepError
from nanguard.findings import Diagnosis
from nanguard.guard.attempt import Attempt, Rng, scaler_aside
from nanguard.guard.config import GuardConfig
from nanguard.guard.diagnoser import Diagnoser, Replayed, replay_trip
from nanguard.guard.health import DeviceHealth, HealthCheck, HealthFlag, HostCopy, StepHealth
from nanguard.guard.history import UNAGREED, Departure, Forecast, History
from nanguard.guard.join import in_join
from nanguard.guard.optim_state import current_lr
from nanguard.guard.policy import Policy
from nanguard.guard.recovery import Recovery
from nanguard.guard.remedies import Remedies, with_bad_rows
from nanguard.guard.verdict import Verdict, VerdictKind
from nanguard.guard.wrapped import scaler_step
from nanguard.spikes import Spike

__all__ = ["Measure", "Reading"]


@dataclass(frozen=True, slots=True)
class Reading:
    """A step's health on the device, agreed across ranks, before its host read."""

    step: int
    measured: DeviceHealth
    agreed: torch.Tensor
    queued: HostCopy | None = None
    """``sync="deferred"``: the health on its way to the host, queued before the update."""
    alone: bool = False
    """Read from the engine's reduced norm alone (``Engine.reduces_norm``): no rank has agreed yet."""

    def found_inf(self) -> torch.Tensor:
        """Whether any rank's step is bad, on the device (the fused optimizer skips the update)."""
        return self.measured.found_inf(self.agreed)


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
        policy: Policy,
        sharded: bool,
    ) -> None:
        self.model, self.optimizer, self.scaler, self.config = model, optimizer, scaler, config
        self.health, self.history, self.diagnoser = health, history, diagnoser
        self.recovery, self.remedies = recovery, remedies
        self.policy, self.sharded = policy, sharded

    def step(self, attempt: Attempt) -> Verdict:
        """Read the step's health (the one host read) and diagnose a trip."""
        health = self.health
        if health.alone:
            loop_norm = None if self.sharded or health.sharded else attempt.loop_norm
            h = health.read_alone(attempt.value, attempt.step, loop_norm)
            return self.verdict(h, attempt, updated=False)
        if health.reduces_norm and attempt.loop_norm is not None and not health.clip_norm_held:
            read = health.read_by_norm(attempt.value, attempt.loop_norm, attempt.step, attempt.call)
            if read is not None:  # finite: no rank flagged, nothing else to measure
                return self.verdict(read, attempt, updated=False)
        return self.read(self.agree(attempt, queue=False), attempt, updated=False)

    def agree(self, attempt: Attempt, *, queue: bool) -> Reading:
        """The step's health on the device, agreed across ranks (no host read yet). With ``queue``
        (``sync="deferred"``) its copy to the host is queued now, read with the next call."""
        health = self.health
        sharded = self.sharded or health.sharded
        clipped = health.take_clip_norm()
        if clipped is not None:  # the loop's clip reduced the norm over every rank: the flags rode in it
            measured = health.on_device(attempt.value, clipped)
            rode, own = health.by_clip(measured, attempt.call)
            measured = replace(measured, pending=own)
            agreed = measured.agree(sharded=False, carried=rode)
            return Reading(attempt.step, measured, agreed, HostCopy(measured, agreed) if queue else None)
        # A sharded run's agreement adds up the ranks' own norms: a whole norm from the loop has no place in it.
        measured = health.on_device(attempt.value, None if sharded else attempt.loop_norm)
        if health.reduces_norm and attempt.loop_norm is not None and not queue:
            return Reading(attempt.step, measured, _from_norm(measured, attempt.loop_norm, attempt.call), alone=True)
        carried = health.carried()
        pending = health.take_pending()
        if pending is not None:  # the flags poisoned the gradient all-reduce: gathered on a trip only
            measured = replace(measured, pending=pending)
        agreed = measured.agree(sharded=sharded, carried=carried, step=attempt.call)
        return Reading(attempt.step, measured, agreed, HostCopy(measured, agreed) if queue else None)

    def read(self, reading: Reading, attempt: Attempt, *, updated: bool) -> Verdict:
        """The host read of an agreed step (``updated``: the device path has applied its update), or,
        queued, a ``"deferred"`` verdict: decided when the next call reads it."""
        if reading.queued is not None:
            return Verdict("deferred", reading.step, queued=reading.queued)
        h = reading.measured.read(reading.step, reading.agreed, scaled=self.scaler is not None)
        if reading.alone and not math.isfinite(h.grad_norm):
            # Every rank holds the same non-finite norm: they agree on who flagged what now (a trip's collective).
            agreed = reading.measured.agree(sharded=self.sharded or self.health.sharded, step=attempt.call)
            h = reading.measured.read(reading.step, agreed, scaled=self.scaler is not None)
        return self.verdict(h, attempt, updated=updated)

    def verdict(self, h: StepHealth, attempt: Attempt, *, updated: bool) -> Verdict:
        """What a read step is: bad parameters (as loaded, or after an update), a GradScaler
        overflow, a trip (replayed and diagnosed), runaway growth, a spike, or healthy.
        ``updated``: the device path has applied the step's update already."""
        if h.rank_steps and h.out_of_step:  # (one process has no step slots: no call)
            raise OutOfStepError(h.out_of_step)
        kind = h.trip_kind(scaled=self.scaler is not None)  # the branch a joined rank's shadow takes too
        if kind == "params":
            return self._bad_parameters(h, attempt)
        if kind == "overflow":
            return self._overflowed(h)
        if kind == "trip":
            return self._tripped(h, attempt)
        return self._finite(h, attempt, updated=updated)

    def _finite(self, h: StepHealth, attempt: Attempt, *, updated: bool) -> Verdict:
        """A finite step: a spike, a departure or a trend (signs the apply stage records), a spike one rank's
        device made, runaway growth, or healthy. Decided on the agreed values (``history.UNAGREED``)."""
        step, history = h.step, self.history
        spikes = history.observe(step, loss=h.loss, grad_norm=h.grad_norm)
        # NaN (``UNAGREED``) exactly when no collective agreed the loss: this rank's own is watched instead.
        own = history.own_spike(loss=h.loss, own_loss=h.own_loss) if h.loss != h.loss else None
        trend = history.forecast(step, loss=h.loss, grad_norm=h.grad_norm)
        departed = history.departed(step, loss=h.loss, grad_norm=h.grad_norm)
        # One rank's device alone made the spike (a peer computes its batch otherwise): the device's, not the run's.
        if spikes and not updated and (device := self._device_spike(h, attempt, spikes[0].metric)) is not None:
            return Verdict("trip", step, h, diagnosis=device, spikes=spikes)
        # Finite, but diverging: caught before the clip and the update (the device path has applied it).
        # Not while a rank has joined (DDP join()): it holds no history to follow the trip with. A steady
        # step (``History.steady``) is no runaway.
        diag = None if updated or history.steady or h.joined else self._runaway(h)
        if diag is None and not spikes and trend is None and departed is None and own is None:
            return Verdict("healthy", step, h)
        return _signs(h, diag, spikes, trend, departed, own)

    def _runaway(self, h: StepHealth) -> Diagnosis | None:
        """A finite step's divergence, judged on the agreed values (``history.UNAGREED``: the grad norm alone
        where the mean loss was not agreed), so the same verdict on every rank without a collective."""
        step = h.step
        runaway = self.history.runaway(step, loss=h.loss, grad_norm=h.grad_norm)
        if runaway is None:
            return None
        return runaway_growth(
            step=step,
            history=runaway,
            lr=current_lr(self.optimizer),
            rank=0 if dist.is_distributed() else None,
            ranks=list(range(dist.world_size())) if dist.is_distributed() else [],
            weights=self.history.weights.evidence(step) if self.history.weights is not None else None,
        )

    def batch(self, batch: Any, step: int) -> Verdict | None:
        """check_batch before the forward: a trip verdict when any rank rejects its batch (the
        step is counted). Ranks agree first: under DDP one rank cannot skip its forward and
        backward while the others all-reduce gradients."""
        if not self.config.check_batch or in_join(self.model):
            return None  # under DDP join() a rank out of batches could not take part in the agreement
        diag = self.diagnoser.rejected_batch(batch, step) if batch is not None else None
        flagged = dist.agree_flag(diag is not None)
        if not flagged:
            return None
        diag = dist.gather_diagnosis(diag, flagged)
        assert diag is not None  # a flagged rank always contributes its diagnosis
        diag = with_bad_rows(replace(diag, step=step), batch, self.remedies.rows())
        return Verdict("trip", step, diagnosis=diag)

    def engine(
        self, step: int, replay: Callable[[], Any], *, batch: Any, rng: Rng | None
    ) -> tuple[Diagnosis | None, list[int]]:
        """An engine's own verdict on ``step`` (``Guard.engine_verdict``): ``replay`` run under the tracer,
        judged with the run's history as a trip is; every rank then agrees on one diagnosis (or None),
        returned with the ranks whose replay found it."""
        run = self.diagnoser.run_facts(step)
        replayed = replay_trip(self.model, replay, batch=batch, rng=rng, step=step, with_module_stats=False, run=run)
        flagged = dist.agree_flag(replayed.diagnosis is not None)
        diag = dist.gather_diagnosis(replayed.diagnosis, flagged) if flagged else None
        return (None if diag is None else replace(diag, step=step)), flagged

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
        if loaded := h.ranks_with(HealthFlag.LOADED):
            diag = _or_unknown(lambda: self.diagnoser.loaded_parameters(step, loaded), step, h)
            return Verdict("trip", step, h, diagnosis=diag)
        diag = _or_unknown(lambda: self.diagnoser.nonfinite_update(step - 1, params_bad), step - 1, h)
        return Verdict("trip", step - 1, h, diagnosis=diag)

    def _tripped(self, h: StepHealth, attempt: Attempt) -> Verdict:
        """Replay a tripped step under the tracer: its diagnosis, with the batch rows that hold the bad values."""
        if attempt.owns_buffers:
            self.recovery.buffers.restore()  # the replays start from the step's own state (apply undoes theirs)
        error, attempt.closure_error = attempt.closure_error, None
        replay = scaler_aside(self.scaler, attempt.replay)
        rng, batch = attempt.rng, attempt.batch
        replayed = _replayed_or_unknown(
            lambda: self.diagnoser.tripped(replay, h, rng=rng, batch=batch, closure_error=error, trained=attempt.value),
            h.step,
            h,
            error,
        )
        assert replayed.diagnosis is not None
        diag = with_bad_rows(replayed.diagnosis, batch, self.remedies.rows())
        return Verdict("trip", h.step, h, diagnosis=diag, module_stats=replayed.module_stats)

    def _device_spike(self, h: StepHealth, attempt: Attempt, metric: str) -> Diagnosis | None:
        """A finite spike one rank's device made, proven by a peer (``guard/outlier.py``), else None."""
        replay = scaler_aside(self.scaler, attempt.replay)
        device = self.diagnoser.spiked(replay, h, metric, batch=attempt.batch, rng=attempt.rng)
        if device is not None:  # the device's values, not the run's: they stay out of its history
            self.history.forget(h.step, loss=h.loss, grad_norm=h.grad_norm)
        return device

    def _overflowed(self, h: StepHealth) -> Verdict:
        """A GradScaler overflow: the scaler skips the update itself and lowers its scale (its own
        step, taken here because only it knows its next scale: DeepSpeed's keeps a hysteresis); the
        policy says whether that scale has collapsed. Counting and recording it are ``Apply``'s."""
        assert self.scaler is not None and h.scale is not None
        scaler_step(self.optimizer, self.scaler)
        new_scale = float(self.scaler.get_scale())
        streak, overflows = self.recovery.overflow_streak + 1, self.recovery.overflows + 1
        if not self.policy.collapsed(new_scale, streak):
            return Verdict("overflow", h.step, h, overflow=new_scale)
        diag = loss_scale_collapse(
            step=h.step,
            scale=new_scale,
            floor=self.config.loss_scale_floor,
            streak=streak,
            overflows=overflows,
            rank=dist.rank_or_none(),
        )
        return Verdict("collapse", h.step, h, diagnosis=diag, overflow=new_scale)


def _signs(
    h: StepHealth,
    diag: Diagnosis | None,
    spikes: list[Spike],
    trend: Forecast | None,
    departed: Departure | None,
    own: Spike | None,
) -> Verdict:
    """The verdict of a finite step that showed a sign: a runaway's trip, a spike, or a warning of a healthy one."""
    kind: VerdictKind = "trip" if diag is not None else "spike" if spikes else "healthy"
    return Verdict(
        kind, h.step, h, diagnosis=diag, spikes=spikes or None, forecast=trend, departure=departed, own_spike=own
    )


def _from_norm(measured: DeviceHealth, norm: Any, step: int) -> torch.Tensor:
    """The agreement's layout filled from this rank alone and the engine's reduced norm: a finite norm speaks
    for every rank (each rank's flags ride in it), so this rank's own codes count only beside a non-finite one.
    No collective averaged the loss: ``history.UNAGREED`` on more than one rank (this rank's own stays in
    the host read's own slot)."""
    device = measured.loss.device
    n = torch.as_tensor(norm, device=device).detach().float().reshape(())
    code = torch.where(torch.isfinite(n), torch.zeros_like(measured.flags), measured.flags)
    world = dist.world_size()
    loss = measured.loss if world == 1 else UNAGREED
    return Layout(world).vector(rank=dist.rank(), code=code, loss=loss, norm=n, step=step, device=device)


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
