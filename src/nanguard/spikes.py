"""Robust, adaptive spike detectors for the loss and the gradient norm.

A rolling median and MAD (median absolute deviation) over a window of recent *finite*
values; a value whose robust z-score passes the threshold is a spike. Non-finite values
never enter the window, so one NaN cannot poison the statistics that follow.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import median
from typing import Any

__all__ = ["Spike", "SpikeDetector"]

_MAD_TO_STD = 1.4826  # MAD of a normal distribution times this is its std


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

    def update(self, value: float) -> Spike | None:
        """Score ``value`` against the window, then add it when finite."""
        if not math.isfinite(value):
            return None
        spike = None
        if len(self.values) >= self.warmup:
            med = median(self.values)
            mad = median(abs(v - med) for v in self.values)
            scale = _MAD_TO_STD * mad + 1e-3 * abs(med) + 1e-12
            score = (value - med) / scale
            if score > self.threshold:
                spike = Spike(self.metric, value, med, score)
        self.values.append(value)
        return spike

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self.values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values.clear()
        self.values.extend(float(v) for v in state.get("values", []))
