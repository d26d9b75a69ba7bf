"""Precursors: the per-layer signals that grow for many steps before a known kind of blow-up, the
published fix for each, and the rule that turns a sampled series into a warning with a lead time.

Plain numbers over sampled values: ``tracer/precursors.py`` measures the signals on the
device, ``guard/precursors.py`` samples them every ``precursor_every`` steps and records the
warnings. One row of ``SIGNALS`` per signal: what it is, the level where it blows up (``limit``)
and the fix; adding a signal is one row and one measurement.

The rule (``Trend``), per (module, signal): the last ``POINTS`` samples rose at every sample and
grew ``MIN_GROWTH``-fold in all; the value stands within 8x of the signal's limit
(``dtypes.OVERFLOW_FRACTION``, the margin the headroom check calls close; a signal's own ``floor``
where healthy runs sit closer), and still below it (a value past the limit with no blow-up says the
limit is not this model's: a softmax that subtracts its max); growing at the slowest
of those samples' rates (per step), it reaches the limit within ``HORIZON`` steps. Where the limit
is the model's for sure (a float16 output's largest value; a logit an ``exp`` takes without the max
subtraction: ``Signal.hard``, the capture's ``raw``), a value that swings rather than grows warns
too: the largest of those samples times their spread (largest over smallest) reaches the limit, so one
more swing like those seen does. Warned once per (module, signal).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import NamedTuple

from nanguard.dtypes import OVERFLOW_FRACTION

__all__ = ["COLLAPSE", "HORIZON", "MIN_GROWTH", "POINTS", "SIGNALS", "Precursor", "SecondMoment", "Signal", "Trend"]

COLLAPSE = 10.0
"""A layer's gradients stopped when its Adam update per unit of LR stands this far below its own median."""

LOG_FLOAT32_MAX = math.log(3.4028234663852886e38)
"""88.72: past it ``exp`` overflows float32, and a softmax over such a spread is one-hot."""


@dataclass(frozen=True)
class Signal:
    """One precursor: its id (the ``signal`` field of a ``warning`` event), what it measures, the level
    where the mechanism blows up, and the published fix."""

    name: str
    what: str
    limit: float
    blowup: str
    fix: str
    floor: float | None = None
    """A growth warns only from this level on; None: within 8x of ``limit`` (``OVERFLOW_FRACTION``)."""
    hard: bool = False
    """The limit is this model's for sure (a float16 output past its largest value is Inf): a swing that
    would reach it warns too (``Trend``). Measurements taken at an ``exp`` written without the max
    subtraction are hard whatever their signal (``Trend.add``'s ``raw``)."""

    @property
    def warns_from(self) -> float:
        return self.floor if self.floor is not None else OVERFLOW_FRACTION * self.limit


SIGNALS: dict[str, Signal] = {
    s.name: s
    for s in (
        Signal(
            "attn_logit",
            "the largest attention logit (q.k^T, scaled, before the softmax)",
            LOG_FLOAT32_MAX,
            "the attention softmax saturates (one-hot rows, entropy collapse; exp past float32)",
            "add QK-norm (a LayerNorm/RMSNorm on q and k: Dehghani et al. 2023, Wortsman et al. 2023) "
            "or lower the learning rate",
        ),
        Signal(
            "logit_z",
            "log Z of the output logits (logsumexp over the vocabulary, RMS over positions)",
            LOG_FLOAT32_MAX,
            "the output logits leave float range (the loss is log Z minus a logit: cancellation, then overflow)",
            "add a z-loss, 1e-4 * logsumexp(logits)**2 averaged over tokens (PaLM; Wortsman et al. 2023), "
            "or weight decay on the output layer",
        ),
        Signal(
            "router_logit",
            "the largest router logit of an MoE router (before its softmax/top-k)",
            LOG_FLOAT32_MAX,
            "the router's softmax saturates and its exp leaves float range",
            "add a router z-loss, 1e-3 * mean(logsumexp(router_logits)**2) (ST-MoE, Zoph et al. 2022), "
            "or lower the router's learning rate",
        ),
        Signal(
            "update_ratio",
            "the update-to-weight ratio of the layer (|w_new - w_old| / |w_old|)",
            1.0,
            "one update as large as the weights themselves",
            "lower the learning rate or lengthen the warmup; a gradient clip keeps values finite, not the run",
        ),
        Signal(
            "adam_update",
            "Adam's update per unit of learning rate, RMS over the layer (m_hat / (sqrt(v_hat) + eps))",
            1.0,
            "every weight moves a full learning rate each step whatever its gradient: the second moment "
            "decayed and Adam turned into sign descent (Molybog et al. 2023)",
            "lower the learning rate, or a smaller Adam eps / a larger beta2 so v does not decay away "
            "(Molybog et al. 2023)",
            # Never a warning alone: a healthy layer whose gradients keep their sign sits near 1 too (a LayerNorm
            # under a warmup's small LR: 1.24, benchmarks/early_warning.py); it goes with its module's warnings.
            floor=math.inf,
        ),
        Signal(
            "adam_v_decay",
            "how far Adam's second moment of the layer decayed while its gradients stopped: the scale of v "
            "at its peak over now, times sqrt(1 - beta2); counted while the layer's update per unit of LR stands "
            f"{COLLAPSE:g}x below its own largest (m forgets in 1/(1-beta1) steps, v in 1/(1-beta2))",
            1.0,
            "when the layer's gradients return, they meet a second moment that forgot their scale: Adam's "
            "step starts over unnormalized, large and uncorrelated with the descent direction "
            "(Molybog et al. 2023)",
            "a larger beta2 (v forgets its scale more slowly), a lower learning rate, or no optimizer step on "
            "batches that carry no loss (Molybog et al. 2023)",
            floor=math.inf,  # its own rule (SecondMoment), not a growth's
        ),
        Signal(
            "output_rms",
            "the RMS of the layer's output",
            3.4028234663852886e38,
            "the layer's outputs overflow float32",
            "lower the learning rate; normalize the layer's output (pre-/post-norm) or shrink its init",
        ),
        Signal(
            "headroom",
            "the largest float16/bfloat16 op output of the module over the dtype's largest finite value",
            1.0,
            "the module's low-precision outputs overflow to Inf",
            "run the module in float32 (autocast off) or use bfloat16 instead of float16; lower the learning rate",
            hard=True,
        ),
    )
}

_WARNS_FROM = {name: signal.warns_from for name, signal in SIGNALS.items()}

POINTS = 4
"""Samples in a row that must each rise for a growth to count (three rises)."""
MIN_GROWTH = 1.5
"""How much those samples must have grown in all: noise around a level does not compound."""
HORIZON = 100
"""Warn when the growth reaches the signal's limit within this many steps."""


class Precursor(NamedTuple):
    """A precursor warning: ``signal`` of ``module`` at ``value``, growing ``trend``-fold a step, reaching
    the signal's limit in ``steps_left`` steps; ``series``: the samples it was fitted on."""

    signal: str
    module: str
    value: float
    trend: float
    steps_left: int
    level: float
    """The first of the fitted samples: where the growth stood ``POINTS`` samples ago."""
    series: tuple[tuple[int, float], ...]
    context: dict[str, float]
    """The module's other signals at the same sample (Adam's update per unit of LR, its output RMS, ...)."""


class Trend:
    """The sampled series of every (module, signal), and the warnings they earn, once each.

    Example:
        >>> trend = Trend()
        >>> [trend.add(s, {("blocks.0.attn", "attn_logit"): 12.0 * 1.05**s}) for s in range(0, 40, 10)][-1][0].signal
        'attn_logit'
    """

    def __init__(self, *, points: int = POINTS, horizon: int = HORIZON, min_growth: float = MIN_GROWTH) -> None:
        self.points, self.horizon, self.min_growth = points, horizon, min_growth
        self.series: dict[tuple[str, str], deque[tuple[int, float]]] = {}
        self.warned: set[tuple[str, str]] = set()

    def add(
        self, step: int, values: dict[tuple[str, str], float], raw: Collection[tuple[str, str]] = ()
    ) -> list[Precursor]:
        """Fold one sample (``(module, signal) -> value``) in; the new warnings, soonest blow-up first.
        ``raw``: the keys measured at an ``exp`` written without the max subtraction (hard limits)."""
        found, every = [], self.series
        for key, value in values.items():
            if key not in every:
                every[key] = deque(maxlen=self.points)
            series = every[key]
            if not 0 < value < math.inf:  # NaN fails too
                series.clear()  # a non-finite value is the guard's business; a zero has no growth
                continue
            series.append((step, value))
            if value >= _WARNS_FROM[key[1]] and key not in self.warned and (warning := self._fit(key, series, raw)):
                self.warned.add(key)
                context = {sig: v for (m, sig), v in values.items() if m == key[0] and sig != key[1]}
                found.append(warning._replace(context=context))
        if found:
            found.sort(key=lambda w: w.steps_left)
        return found

    def _fit(
        self, key: tuple[str, str], series: deque[tuple[int, float]], raw: Collection[tuple[str, str]]
    ) -> Precursor | None:
        if len(series) < self.points:
            return None
        grown = self._grown(key, series)
        if grown is None and (SIGNALS[key[1]].hard or key in raw):
            return self._swing(key, series)
        return grown

    def _swing(self, key: tuple[str, str], series: deque[tuple[int, float]]) -> Precursor | None:
        """A hard limit one swing away: the largest of the samples, times their own spread (largest over
        smallest), reaches it. A noisy value near a limit it overflows at blows up on the batch whose tail
        reaches it, without the steady growth the other rule needs; ``steps_left`` 0: any step may."""
        values = [v for _, v in series]
        top, bottom = max(values), min(values)
        limit = SIGNALS[key[1]].limit
        if not _WARNS_FROM[key[1]] <= top < limit or top * (top / bottom) < limit:
            return None
        (s0, first), (s1, last) = series[0], series[-1]
        trend = (last / first) ** (1 / max(s1 - s0, 1))
        return Precursor(key[1], key[0], top, trend, 0, bottom, tuple(series), {})

    def _grown(self, key: tuple[str, str], series: deque[tuple[int, float]]) -> Precursor | None:
        (_, first), (_, last) = series[0], series[-1]
        pairs = list(zip(series, list(series)[1:], strict=False))
        if not all(b > a for (_, a), (_, b) in pairs) or last < self.min_growth * first:
            return None
        rate = min(math.log(b / a) / max(sb - sa, 1) for (sa, a), (sb, b) in pairs)
        signal = SIGNALS[key[1]]
        limit = signal.limit
        if not signal.warns_from <= last < limit:
            return None  # past the limit, no blow-up: the limit is not this model's (a softmax that subtracts its max)
        left = math.log(limit / last) / rate
        if left > self.horizon:
            return None
        module, name = key
        return Precursor(name, module, last, math.exp(rate), max(0, math.ceil(left)), first, tuple(series), {})

    def state_dict(self) -> dict[str, list[list[str]]]:
        return {"warned": [list(k) for k in sorted(self.warned)]}

    def load_state_dict(self, state: dict[str, list[list[str]]]) -> None:
        self.warned = {(str(m), str(s)) for m, s in state.get("warned", [])}


class SecondMoment:
    """Adam's second-moment decay per module (``adam_v_decay``): the rule of a state that arms a blow-up,
    where the others are growths that reach a limit.

    Each sample brings, per module, Adam's update per unit of LR (``adam_update``; 0 when the step left
    the module alone, which says nothing) and its second moment's scale (``adam_v``, the fourth root of
    v_hat's mean square). A module's gradients stopped when its update stands ``COLLAPSE``-fold
    below the largest of its own earlier samples (``POINTS`` of them at least; m forgets in about
    1/(1-beta1) steps, v in 1/(1-beta2): the update falls only when the gradients do); while they stay
    stopped, ``adam_v_decay`` is the peak of ``adam_v`` over now, times sqrt(1 - beta2): at 1, v has
    decayed so far that a gradient of the scale v once knew makes a step as large as a restarted Adam's
    first ones, without the bias correction that tames those. Two samples in a row at 1 or more warn,
    once per module: the blow-up comes when the gradients return. A healthy run's update stays near
    its level (its gradients shrink with v), so it never stands tenfold below it.

    Example:
        >>> rule = SecondMoment()
        >>> for step in range(0, 100, 20):
        ...     rule.add(step, {("blocks.0", "adam_update"): 0.2, ("blocks.0", "adam_v"): 1e-3}, {"blocks.0": 0.95})
        []
        []
        []
        []
        []
    """

    def __init__(self) -> None:
        self.peak: dict[str, float] = {}
        self.level: dict[str, tuple[int, float]] = {}
        """Per module: samples seen and the largest update per unit of LR among them."""
        self.armed: dict[str, list[tuple[int, float]]] = {}
        self.warned: set[str] = set()

    def add(self, step: int, values: dict[tuple[str, str], float], beta2: dict[str, float]) -> list[Precursor]:
        """Replace each module's ``adam_v`` in ``values`` by its ``adam_v_decay``; the new warnings.

        A sample brings one value per module and signal, every ``precursor_every`` steps: lookups by ``in``
        and subscripts, not ``dict.get`` (each a call: a hundred a sample on a small model)."""
        found, armed = [], self.armed
        for key in [k for k in values if k[1] == "adam_v"]:
            module, adam = key[0], (key[0], "adam_update")
            update = values[adam] if adam in values else None  # noqa: SIM401 (the docstring: no call)
            b2 = beta2[module] if module in beta2 else None  # noqa: SIM401
            decay = self._decay(module, values.pop(key), update, b2)
            values[(module, "adam_v_decay")] = decay
            if decay < 1.0:
                if module in armed:
                    del armed[module]
                continue
            series = armed[module] = [*armed[module][-1:], (step, decay)] if module in armed else [(step, decay)]
            if series[1:] and module not in self.warned:  # two in a row
                self.warned.add(module)
                (s0, first), (s1, last) = series
                trend = (last / first) ** (1 / max(s1 - s0, 1))
                context = {sig: v for (m, sig), v in values.items() if m == module and sig != "adam_v_decay"}
                found.append(Precursor("adam_v_decay", module, last, trend, 0, first, tuple(series), context))
        return found

    def _decay(self, module: str, v: float, update: float | None, beta2: float | None) -> float:
        if update is None or beta2 is None or not (0 < v < math.inf and 0 < update < math.inf):
            return 0.0
        peak, (seen, top) = (self.peak[module], self.level[module]) if module in self.peak else (0.0, (0, 0.0))
        self.peak[module] = peak = v if v > peak else peak  # max() of two finite floats, without its call
        self.level[module] = (seen + 1, update if update > top else top)
        if seen < POINTS or update > top / COLLAPSE:
            return 0.0
        return peak / v * math.sqrt(1 - beta2)
