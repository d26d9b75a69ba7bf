"""The run's recent loss and grad-norm history, and its spike detectors.

The guard feeds every checked step to ``observe`` (spike detection) and ``forecast`` (the
early divergence warning), and every finished update to ``append``; on a trip, ``evidence``
says whether the run was diverging, which the trip's diagnosis reads (``evidence.RunFacts``),
and ``growing`` holds the rollback snapshot's refresh while it is.

The rule for a step whose mean loss no collective agreed (``UNAGREED``: the flags rode in the gradients
or the engine's reduced norm on 3 or more DDP ranks, under FSDP2/TP's clip, DeepSpeed, torchtitan and
Megatron-core): its loss is NaN here, so every rule that decides (spike skips, the divergence trip, the
snapshot's hold) goes by the grad norm, the same on every rank, and no collective is added; each rank's
own loss feeds ``own_spike`` alone, a warning in that rank's log that changes nothing the ranks do.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Mapping
from itertools import pairwise
from typing import Any, NamedTuple

from nanguard.guard.config import GuardConfig
from nanguard.guard.growth import WeightLog
from nanguard.spikes import Spike, SpikeDetector

__all__ = ["FLOAT32_SQUARE_MAX", "UNAGREED", "Departure", "Forecast", "History", "Point"]

TREND_POINTS = 4
"""How many recent steps the divergence forecast fits (``History._predict`` reads these four by name)."""
RUNAWAY_STEPS = 2
"""Spiking steps in a row, each grown ``divergence_factor``, that make a finite step a divergence trip."""
ONSET_RISES = 3
"""Updates in a row whose loss (or grad norm) rose that make a steady growth (with ``ONSET_GROWTH``)."""
ONSET_GROWTH = 2.0
"""How much such a run of rises must have grown in all to be a growth, not noise."""
DEPARTED_STEPS = 2
"""Checked steps in a row that must stand ``divergence_factor`` above the recent level: one bad batch
comes back at the next step, a diverging run does not."""
PEAK_RATIO = 2.0
"""A departure must also clear the recent window's own peak this many times (heavy-tailed clean series)."""
_LOG_FLOAT32_MAX = math.log(3.4028234663852886e38)
FLOAT32_SQUARE_MAX = math.sqrt(3.4028234663852886e38)
"""A norm past this squares past float32's range: a float32 norm of such gradients is Inf."""
UNAGREED = math.nan
"""The loss of a finite step whose mean loss no collective agreed (the module's docstring: the rule)."""


class Point(NamedTuple):
    step: int
    loss: float
    grad_norm: float


class Forecast(NamedTuple):
    """A metric growing geometrically towards the float32 overflow."""

    metric: str
    value: float
    growth: float
    """The fitted growth factor per step."""
    predicted_overflow_in: int
    """Steps until the extrapolated metric passes float32's largest finite value."""


class Departure(NamedTuple):
    """A loss or grad norm that left its recent level by an order of magnitude, and stayed there."""

    signal: str
    """``"loss"`` or ``"grad_norm"`` (before any clip)."""
    value: float
    level: float
    """The recent level it left: the median of the updates before the departure."""
    growth: float
    """``value / level``."""
    trend: float
    """The growth per step since the last update at the level."""
    steps_left: int | None
    """Steps until the value passes float32's largest at that growth; None when it does not grow."""


class _Episode:
    """One metric's departure under way: the level and peak it left (frozen), its steps in a row."""

    def __init__(self, level: float, peak: float, since: int) -> None:
        self.level, self.peak, self.since = level, peak, since
        self.streak, self.quiet, self.warned = 0, 0, False


class History:
    """Recent finished steps plus the loss and grad-norm spike detectors.

    Example:
        >>> history = History(size=64, spike_window=50, spike_warmup=10, spike_threshold=6.0,
        ...                   divergence_window=5, divergence_factor=10.0)
        >>> history.append(0, loss=2.3, grad_norm=1.1)
        >>> list(history)
        [Point(step=0, loss=2.3, grad_norm=1.1)]
    """

    def __init__(
        self,
        *,
        size: int,
        spike_window: int,
        spike_warmup: int,
        spike_threshold: float,
        divergence_window: int,
        divergence_factor: float,
    ) -> None:
        self.points: deque[Point] = deque(maxlen=size)
        self.loss_spikes = SpikeDetector("loss", window=spike_window, warmup=spike_warmup, threshold=spike_threshold)
        self.grad_spikes = SpikeDetector(
            "grad_norm", window=spike_window, warmup=spike_warmup, threshold=spike_threshold
        )
        self.own_loss_spikes = SpikeDetector(
            "loss", window=spike_window, warmup=spike_warmup, threshold=spike_threshold
        )
        """This rank's own loss, on the steps whose mean loss was not agreed (``own_spike``)."""
        self.divergence_window = divergence_window
        self.divergence_factor = divergence_factor
        self.spikes = 0
        self._recent_spike_step: int | None = None
        self._spike_before: int | None = None
        self._trend: deque[tuple[int, float, float]] = deque(maxlen=TREND_POINTS)  # (step, loss, grad_norm)
        self._warned = False
        self._quiet = 0
        self._observed: tuple[int | None, bool, bool] = (None, False, False)  # step, spiked with warm detectors, spiked
        self._grown: tuple[int | None, int] = (None, 0)  # the last step grown on a spike, how many in a row
        self.steady = True
        """The last ``observe``d step can be no runaway: no spike, its grad norm within float32's square range,
        and no streak of grown spikes under way (``runaway`` would return None and change nothing)."""
        self._episodes: dict[str, _Episode] = {}  # a departure under way, by metric
        self._level_window = spike_window
        self.weights: WeightLog | None = None

    def track(self, weights: WeightLog) -> None:
        """Sample ``weights`` after every finished update (``append``)."""
        self.weights = weights

    @classmethod
    def from_config(cls, config: GuardConfig) -> History:
        c = config
        return cls(
            size=c.history,
            spike_window=c.spike_window,
            spike_warmup=c.spike_warmup,
            spike_threshold=c.spike_threshold,
            divergence_window=c.divergence_window,
            divergence_factor=c.divergence_factor,
        )

    def __iter__(self) -> Iterator[Point]:
        return iter(self.points)

    def __len__(self) -> int:
        return len(self.points)

    def append(self, step: int, *, loss: float, grad_norm: float) -> None:
        self.points.append(Point(step, loss, grad_norm))
        if self.weights is not None:
            self.weights.record(step)

    def observe(self, step: int, *, loss: float, grad_norm: float) -> list[Spike]:
        """Score a step's values against the detectors; returns its spikes (loss first)."""
        losses, norms = self.loss_spikes, self.grad_spikes
        self._spike_before = self._recent_spike_step
        found = []
        for detector, value in ((losses, loss), (norms, grad_norm)):
            spike = detector.update(value)
            if spike is not None:
                found.append(spike)
                self.spikes += 1
                self._recent_spike_step = step
        spiked = bool(found)
        # Were both detectors warm before this step's values (``seen``)? Read by ``runaway`` on a spike only.
        ready = spiked and losses.seen >= losses.warmup and norms.seen >= norms.warmup
        self._observed = (step, ready, spiked)
        self.steady = not spiked and grad_norm < FLOAT32_SQUARE_MAX and not self._grown[1]
        return found

    def own_spike(self, *, loss: float, own_loss: float) -> Spike | None:
        """A spike of this rank's own loss on a finite step whose mean ``loss`` no collective agreed
        (``UNAGREED``), else None. A warning for this rank's log alone: it enters no decision, so the
        ranks, whose own losses differ, still decide alike; nor ``spikes``, which counts the agreed ones
        (the same on every rank).

        Example:
            >>> history.own_spike(loss=math.nan, own_loss=40.0).metric   # after 10 steps at 2.0
            'loss'
        """
        if not math.isnan(loss):
            return None  # the mean loss was agreed: its spikes are the run's (``observe``)
        return self.own_loss_spikes.update(own_loss)

    def forget(self, step: int, *, loss: float, grad_norm: float) -> None:
        """Take back the last ``observe`` and ``forecast`` of ``step``: it was skipped (``skip_spikes``),
        so, as in a run that never saw the batch, its values stay out of the detectors' windows and
        the trend, and its spike is not the "spike before the trip" the divergence rule reads (the
        skipped update never reached the weights). Else a skipped spike would raise the bar for the
        next one until it left the window, and turn any trip in the next few steps into divergence.
        ``spikes`` still counts it."""
        self.loss_spikes.forget(loss)
        self.grad_spikes.forget(grad_norm)
        self._recent_spike_step = self._spike_before
        if self._trend and self._trend[-1][0] == step:
            self._trend.pop()

    def forecast(self, step: int, *, loss: float, grad_norm: float) -> Forecast | None:
        """A warning, once per episode, when the last ``TREND_POINTS`` steps' grad norm or loss
        grow every step and, growing at their slowest step's rate, reach float32's overflow within
        the history window (``size`` steps). The episode ends after ``TREND_POINTS`` quiet steps.

        Example:
            >>> history = History(size=64, spike_window=50, spike_warmup=10, spike_threshold=6.0,
            ...                   divergence_window=5, divergence_factor=10.0)
            >>> [history.forecast(s, loss=2.0, grad_norm=10.0 ** (4 * s)) for s in range(4)][-1].metric
            'grad_norm'
        """
        self._trend.append((step, loss, grad_norm))
        found = self._predict()
        if found is None:
            self._quiet += 1
            if self._quiet >= TREND_POINTS:
                self._warned = False
            return None
        self._quiet = 0
        if self._warned:
            return None
        self._warned = True
        return found

    def _predict(self) -> Forecast | None:
        """``_fit``, after its own test of the window first (most steps fail it): a metric fits only when it
        grew at every step."""
        trend = self._trend
        if len(trend) < TREND_POINTS:
            return None
        (_, l0, g0), (_, l1, g1), (_, l2, g2), (_, l3, g3) = trend
        if not (0 < g0 < g1 < g2 < g3 < math.inf or 0 < l0 < l1 < l2 < l3 < math.inf):
            return None
        return self._fit()

    def _fit(self) -> Forecast | None:
        """The forecast of the trend's window (``_predict`` without its shortcut)."""
        if len(self._trend) < TREND_POINTS:
            return None
        horizon = self.points.maxlen or TREND_POINTS
        steps = [p[0] for p in self._trend]
        best: Forecast | None = None
        for metric, at in (("grad_norm", 2), ("loss", 1)):  # (step, loss, grad_norm)
            vals = [p[at] for p in self._trend]
            if not all(0 < a < b < math.inf for a, b in pairwise(vals)):
                continue  # not growing every step: nothing to fit
            # The slowest step's growth: one jump followed by a plateau predicts nothing.
            pairs = pairwise(zip(steps, vals, strict=True))
            rate = min(math.log(b / a) / max(sb - sa, 1) for (sa, a), (sb, b) in pairs)
            if rate <= 0:
                continue
            left = (_LOG_FLOAT32_MAX - math.log(vals[-1])) / rate
            if left <= horizon and (best is None or left < best.predicted_overflow_in):
                best = Forecast(metric, vals[-1], math.exp(rate), max(1, math.ceil(left)))
        return best

    def departed(self, step: int, *, loss: float, grad_norm: float) -> Departure | None:
        """A warning, once per episode, when the loss (or the grad norm, while the loss climbs to new highs)
        has stood at least ``divergence_factor`` times its recent level, and twice the recent window's
        peak, on ``DEPARTED_STEPS`` checked steps in a row: a run leaving its level by an order of
        magnitude, whatever the clip keeps finite. The level is the median of the last ``spike_window``
        updates (one is enough: a tenfold jump in the first steps is no noise), frozen when the
        departure begins; the episode ends after ``TREND_POINTS`` steps back under it.

        Example:
            >>> for s, v in enumerate([4.0, 3.9, 3.8]):
            ...     history.append(s, loss=v, grad_norm=1.0)
            >>> history.departed(3, loss=60.0, grad_norm=1.0) is None   # one step up: maybe one bad batch
            True
            >>> history.departed(4, loss=900.0, grad_norm=1.0).signal
            'loss'
        """
        if not self._episodes and not (self.points and _may_depart(self.points[-1], loss, grad_norm)):
            return None
        recent = list(self.points)[-self._level_window :]
        losses = [p.loss for p in recent if math.isfinite(p.loss)]
        found = None
        for metric, value in (("loss", loss), ("grad_norm", grad_norm)):
            if metric == "grad_norm" and losses and loss < max(losses):
                # A grad norm jumping while the loss holds or falls (a layer's gain grown, a zero-initialized
                # head reached): the run is not leaving its level; a diverging one climbs to new highs.
                self._episodes.pop(metric, None)
                continue
            departure = self._depart(metric, value, recent, step)
            found = found or departure
        return found

    def _depart(self, metric: str, value: float, recent: list[Point], step: int) -> Departure | None:
        episode = self._episodes.get(metric)
        if episode is None:
            vals = [v for v in (getattr(p, metric) for p in recent) if 0 < v < math.inf]
            level = _median(vals)
            if level is None or not _above(value, self.divergence_factor * level, PEAK_RATIO * max(vals)):
                return None
            episode = self._episodes[metric] = _Episode(level, max(vals), recent[-1].step)
        if _above(value, self.divergence_factor * episode.level, PEAK_RATIO * episode.peak):
            episode.streak, episode.quiet = episode.streak + 1, 0
        elif not episode.warned:
            del self._episodes[metric]  # came back: one bad batch, not a run leaving its level
            return None
        else:
            episode.quiet += 1
            if episode.quiet >= TREND_POINTS:
                del self._episodes[metric]
            return None
        if episode.warned or episode.streak < DEPARTED_STEPS:
            return None
        episode.warned = True
        growth = value / episode.level
        trend = growth ** (1 / max(step - episode.since, 1))
        left = math.ceil((_LOG_FLOAT32_MAX - math.log(value)) / math.log(trend)) if trend > 1 else None
        return Departure(metric, value, episode.level, growth, trend, max(left, 1) if left is not None else None)

    def growing(self, baseline: float | None = None) -> bool:
        """Is the run growing now: a steady growth is under way (``onset``), the forecast's episode
        is open, a spike came within the last
        ``divergence_window`` updates, the loss or grad norm grew ``divergence_factor``-fold
        within them (the divergence rule's own evidence), or the loss stands ``divergence_factor``
        times above ``baseline`` (the loss when the last good snapshot was taken)?

        Example:
            >>> history = History(size=64, spike_window=50, spike_warmup=10, spike_threshold=6.0,
            ...                   divergence_window=5, divergence_factor=10.0)
            >>> for step, loss in enumerate([2.0, 9.0, 60.0]):
            ...     history.append(step, loss=loss, grad_norm=1.0)
            >>> history.growing()
            True
        """
        if self._warned or self.onset() is not None or any(e.warned for e in self._episodes.values()):
            return True
        if not self.points:
            return False
        last = self.points[-1]
        if baseline is not None and 0 < baseline < math.inf and last.loss > self.divergence_factor * baseline:
            return True
        return bool(self.evidence(last.step + 1, None).get("diverging"))

    def onset(self) -> int | None:
        """The step a steady growth under way began at: the first of the last updates whose loss or
        grad norm rose on each update since, at least ``ONSET_RISES`` times and ``ONSET_GROWTH``-fold
        in all (the earlier of the two metrics' starts). None when the last updates do not grow so.
        A snapshot taken at this step or before holds the state from before the growth; one taken
        after it holds a state already on its way out, whatever the growth rate (x1.3 a step never
        makes the tenfold jump the other rules wait for).

        Example:
            >>> for step, loss in enumerate([2.0, 1.9, 2.6, 5.2, 10.4]):
            ...     history.append(step, loss=loss, grad_norm=1.0)
            >>> history.onset()
            1
        """
        points = list(self.points)
        found: int | None = None
        for metric in ("loss", "grad_norm"):
            vals = [getattr(p, metric) for p in points]
            first = len(vals) - 1
            while first > 0 and 0 < vals[first - 1] < vals[first] < math.inf:
                first -= 1
            rises = len(vals) - 1 - first
            if rises >= ONSET_RISES and vals[-1] >= ONSET_GROWTH * vals[first]:
                step = points[first].step
                found = step if found is None else min(found, step)
        return found

    def tail(self, n: int = 16) -> dict[str, list[float]]:
        """The last ``n`` losses and grad norms, for a repro bundle."""
        return {
            "loss_tail": [p.loss for p in self.points][-n:],
            "grad_norm_tail": [p.grad_norm for p in self.points][-n:],
        }

    def evidence(self, step: int, lr: Any) -> dict[str, Any]:
        """How the steps before ``step`` grew: the ``history`` evidence of the divergence rule
        ({} with fewer than two recent steps).

        The window counts updates, not step numbers: skipped steps leave the parameters as the
        last updates made them, so a run that keeps skipping keeps the evidence of how it got there.
        Nor does it count updates without a gradient (norm exactly 0): a run blown up so far that
        its outputs saturate has none, while its optimizer's momentum goes on moving the weights,
        and such updates say nothing of how the run grew.
        """
        before = [p for p in self.points if p.step < step and p.grad_norm != 0.0]
        recent = before[-self.divergence_window :]
        if len(recent) < 2:
            return {}
        out: dict[str, Any] = {"window": len(recent), "lr": lr}
        best = ("grad_norm", 1.0)
        for metric in ("grad_norm", "loss"):
            vals = [v for v in (getattr(p, metric) for p in recent) if math.isfinite(v) and v > 0]
            if len(vals) >= 2:
                growth = vals[-1] / min(vals[:-1])
                if growth > best[1]:
                    best = (metric, growth)
        out["metric"], out["growth"] = best
        last_spike = self._recent_spike_step
        spiked = last_spike is not None and sum(p.step >= last_spike for p in before) <= self.divergence_window
        out["diverging"] = best[1] >= self.divergence_factor or spiked
        out["spike"] = spiked
        return out

    def runaway(self, step: int, *, loss: float, grad_norm: float) -> dict[str, Any] | None:
        """Divergence seen in a finite step (after ``observe``), before its clip and update: the
        ``history`` evidence when the gradients' norm is past what float32 can square (a float32
        ``clip_grad_norm_`` computes an Inf norm; an Inf ``grad_norm`` of a step no rank flagged is
        that: the ranks' finite squared norms summed past float32's range), or when the loss and the grad norm both grew
        ``divergence_factor`` over the last ``divergence_window`` updates on ``RUNAWAY_STEPS``
        steps in a row that the warm spike detectors flag. None otherwise.

        Growth alone is no trip: in a run's first steps healthy losses and grad norms move by
        such factors too (a zero-initialized head, warmup). Nor is one spike: a single bad batch
        spikes too, and the next step is back; a run that diverges keeps growing.

        Example:
            >>> history.observe(9, loss=2.0, grad_norm=7e19)
            >>> history.runaway(9, loss=2.0, grad_norm=7e19)["metric"]
            'grad_norm'
        """
        seen, ready, spiked = self._observed
        spiked = spiked and seen == step
        if grad_norm >= FLOAT32_SQUARE_MAX:  # Inf: every rank's gradients finite, their squares summed past float32
            past = min(grad_norm, FLOAT32_SQUARE_MAX)  # an Inf norm grew at least this much
            found = {"metric": "grad_norm", "growth": self._growth("grad_norm", past), "float32_overflow": True}
        else:
            if not (ready and spiked):  # no growth is a runaway without a spike the warm detectors flag
                self._grown = (None, 0)
                return None
            # A NaN loss of a step no rank flagged is one no collective agreed (``UNAGREED``, the module's
            # rule): the grad norm, alike on every rank, decides alone.
            known = [(m, v) for m, v in (("loss", loss), ("grad_norm", grad_norm)) if not math.isnan(v)]
            growth = {m: self._growth(m, v) for m, v in known}
            if min(growth.values()) < self.divergence_factor:
                self._grown = (None, 0)
                return None
            last, streak = self._grown
            self._grown = (step, streak + 1 if last == step - 1 else 1)
            if self._grown[1] < RUNAWAY_STEPS:
                return None
            metric = max(growth, key=lambda m: growth[m])
            found = {"metric": metric, "growth": growth[metric], "float32_overflow": False}
        recent = [p for p in self.points if p.step < step][-self.divergence_window :]
        return {
            "window": len(recent),
            **found,
            "diverging": True,
            "spike": spiked,
            "loss": loss,
            "grad_norm": grad_norm,
        }

    def _growth(self, metric: str, value: float) -> float:
        """``value`` over the smallest finite, positive ``metric`` of the last ``divergence_window`` updates."""
        recent = [getattr(p, metric) for p in list(self.points)[-self.divergence_window :]]
        base = [v for v in recent if math.isfinite(v) and v > 0]
        return value / min(base) if base and math.isfinite(value) and value > 0 else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {
            "spikes": self.spikes,
            "history": [list(p) for p in self.points],
            "loss_spikes": self.loss_spikes.state_dict(),
            "grad_spikes": self.grad_spikes.state_dict(),
            "own_loss_spikes": self.own_loss_spikes.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.spikes = int(state.get("spikes", 0))
        self.points.clear()
        self.points.extend(Point(int(s), float(lv), float(g)) for s, lv, g in state.get("history", []))
        self.loss_spikes.load_state_dict(state.get("loss_spikes", {}))
        self.grad_spikes.load_state_dict(state.get("grad_spikes", {}))
        self.own_loss_spikes.load_state_dict(state.get("own_loss_spikes", {}))


def _median(values: list[float]) -> float | None:
    """The median of the finite, positive ``values``; None when there are none."""
    ordered = sorted(v for v in values if 0 < v < math.inf)
    if not ordered:
        return None
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _may_depart(last: Point, loss: float, grad_norm: float) -> bool:
    """Can a departure begin at this step? Not for a value that is not finite (a riding step's unagreed
    loss), nor while a value is under ``PEAK_RATIO`` times the last update's (that update is in the window
    whose peak a departure must clear): the healthy step's shortcut, exact, before the window is copied and
    sorted."""
    return _may_rise(last.loss, loss) or _may_rise(last.grad_norm, grad_norm)


def _may_rise(last: float, value: float) -> bool:
    return math.isfinite(value) and (not 0 < last < math.inf or value >= PEAK_RATIO * last)


def _above(value: float, *bars: float) -> bool:
    """``value`` finite and at or past every bar."""
    return math.isfinite(value) and all(value >= bar for bar in bars)
