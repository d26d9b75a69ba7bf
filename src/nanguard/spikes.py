"""Robust, adaptive spike detectors for the loss and the gradient norm.

A rolling window of recent *finite* values; a value whose robust z-score passes the threshold
is a spike. Non-finite values never enter the window, so one NaN cannot poison the
statistics that follow.

Positive series (a loss, a grad norm) are scored in log space: their noise is multiplicative
and right-skewed, and a spike is a *ratio* to the recent level: scored linearly, the long
upper tail of a noisy loss passes a median/MAD threshold far more often than its nominal rate.
Clean runs still throw the odd value at twice the median, so a spike must also be at least
twice the largest value in the window. Some clean runs (a grad norm under AdamW once the loss sits
at its floor) burst to several times the median every hundred steps or so, more rarely than one
window holds: a spike must also rise at least twice as far above the median as the largest burst
of the last ``_BURST_WINDOWS`` windows did above theirs (ratios to each window's median, so a
falling level does not raise the bar).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

__all__ = ["Spike", "SpikeDetector"]

_MAD_TO_STD = 1.4826  # MAD of a normal distribution times this is its std
_PEAK_RATIO = 2.0  # a positive value must be this many times the window's largest to be a spike
_LOG_FLOOR = 0.02  # scale floor in log space: with the default threshold, no rise under ~13% is a spike
_BURST_WINDOWS = 10  # how many past windows' largest bursts (max / median) a spike must clear twice


@dataclass(frozen=True)
class Spike:
    metric: str
    value: float
    median: float
    score: float


class SpikeDetector:
    """Flags values far above the recent median.

    Example:
        >>> det = SpikeDetector("loss", window=20, warmup=5, threshold=6.0)
        >>> [det.update(2.0 + 0.01 * (i % 3)) for i in range(10)][-1] is None
        True
        >>> det.update(50.0).metric
        'loss'
    """

    def __init__(self, metric: str, *, window: int = 50, warmup: int = 10, threshold: float = 6.0) -> None:
        if window < 3:
            raise ValueError(f"window must be >= 3, got {window}")
        if not 1 <= warmup <= window:
            raise ValueError(f"warmup must be in [1, window={window}], got {warmup}")
        if threshold <= 0:
            raise ValueError(f"threshold must be > 0, got {threshold}")
        self.metric = metric
        self.warmup = warmup
        self.threshold = threshold
        self.values: deque[float] = deque(maxlen=window)
        self.bursts: deque[float] = deque(maxlen=_BURST_WINDOWS)  # each past window's max / median
        self._since = 0  # values added since the last window was closed into ``bursts``
        self.seen = 0
        """How many values the window held when the last ``update`` scored its value (warm: ``>= warmup``)."""

    def update(self, value: float) -> Spike | None:
        """Score ``value`` against the window, then add it when finite."""
        n = self.seen = len(self.values)
        if not math.isfinite(value):
            return None
        if self._since >= n == self.values.maxlen:
            self._close_window()  # keeps the values: n holds
        spike = None
        if n >= self.warmup:
            # The cheap test first: clean losses and grad norms have heavy right tails (a value twice the
            # median comes every few hundred steps), so a spike must also clear the window's own peak by a margin.
            peak = max(self.values)
            if value >= peak * _PEAK_RATIO if peak > 0 else value > peak:
                spike = self._scored(value)
        self.values.append(value)
        self._since += 1
        return spike

    def _scored(self, value: float) -> Spike | None:
        """A spike when ``value``, past the window's peak, also passes the threshold and the recent bursts."""
        score, med = self.score(value)
        if score > self.threshold and self._above_recent_bursts(value, med):
            return Spike(self.metric, value, med, score)
        return None

    def forget(self, value: float) -> None:
        """Take back the last ``update(value)``: a step that was skipped leaves no trace here either.

        Example:
            >>> det = SpikeDetector("loss", window=20, warmup=5)
            >>> for v in (2.0, 2.01, 2.02, 2.0, 2.01, 2.02):
            ...     _ = det.update(v)
            >>> _ = det.update(50.0); det.forget(50.0)   # the spike's step was skipped
            >>> max(det.values)
            2.02
        """
        if math.isfinite(value) and self.values and self.values[-1] == value:
            self.values.pop()
            self._since = max(self._since - 1, 0)

    def score(self, value: float) -> tuple[float, float]:
        """The robust z-score of ``value`` against the window, and the window's median."""
        window = sorted(self.values)
        med = _median(window)
        if value > 0 and window[0] > 0:
            logs = [math.log(v) for v in window]
            center, floor, x = math.log(med), _LOG_FLOOR, math.log(value)
        else:
            logs, center, floor, x = window, med, 1e-3 * abs(med) + 1e-12, value
        mad = _median(sorted(abs(v - center) for v in logs))
        scale = max(_MAD_TO_STD * mad, floor)
        return (x - center) / scale, med

    def _above_recent_bursts(self, value: float, med: float) -> bool:
        # A burst the run has already shown, and stayed healthy through, is its noise: a clean
        # run's rare bursts would each pass the window peak test once the last had left the window.
        if not self.bursts or value <= 0 or med <= 0:
            return True
        return value / med >= _PEAK_RATIO * max(self.bursts)

    def _close_window(self) -> None:
        # Closed lazily, at the next update, so that ``forget`` of a window's last value still
        # takes it out before the window's burst is recorded.
        self._since = 0
        window = sorted(self.values)
        med = _median(window)
        if window[0] > 0 and med > 0:
            self.bursts.append(window[-1] / med)

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self.values), "bursts": list(self.bursts), "since": self._since}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values.clear()
        self.values.extend(float(v) for v in state.get("values", []))
        self.bursts.clear()
        self.bursts.extend(float(v) for v in state.get("bursts", []))
        self._since = int(state.get("since", 0))


def _median(ordered: list[float]) -> float:
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
