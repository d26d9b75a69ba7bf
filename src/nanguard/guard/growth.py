"""How the run's weights grew: their norms sampled on the device every ``EVERY`` updates, and the
step its learning rate went negative.

A trip whose origin is an overflow of grown weights is an optimizer cause when the weights were
not that large at the start of the run: this log says by how much they grew, how fast per step,
and since which step (``WeightLog.evidence``, read on a trip only). A healthy step adds no host
read: a sample is one foreach norm kept on the device, and the LR is the Python number the
optimizer already holds (a tensor LR is not read).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any

import torch
from torch import nn

from nanguard import compat
from nanguard.guard.optim_state import current_lr
from nanguard.stats import local

__all__ = ["EVERY", "WeightLog"]

log = logging.getLogger("nanguard")

EVERY = 8
"""Updates between two samples of the weights' norms."""
SAMPLES = 64
"""Samples kept (with ``EVERY``, the last 512 updates), besides the one taken at the start."""


class WeightLog:
    """The norms of ``model``'s weights at the start and every ``every`` updates since, and the LR's sign.

    Example:
        >>> weights = WeightLog(model, optimizer)
        >>> for step in range(100):
        ...     ...  # an update
        ...     weights.record(step)
        >>> weights.evidence(100)["per_step"]     # how fast the fastest-growing weight grew, per update
        1.2
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, every: int = EVERY) -> None:
        self.optimizer = optimizer
        self.every = every
        # Matrices only (linear, conv, embedding weights): a bias or a norm's gain may start near 0 and grow
        # 100-fold in a healthy run; a weight matrix starts at its init's scale.
        named = [(n, p) for n, p in model.named_parameters() if p.dim() >= 2 and p.is_floating_point()]
        named = [(n, p) for n, p in named if local(p).numel() > 0]
        self.names = [n for n, _ in named]
        self._params: list[torch.Tensor] = [p for _, p in named]
        self._plain = all(local(p) is p for p in self._params)  # no DTensor: the norms read the parameters as they are
        self.samples: deque[tuple[int, torch.Tensor]] = deque(maxlen=SAMPLES)
        self.negative_since: int | None = None
        self._updates = 0
        self.start: torch.Tensor | None = None
        try:
            self.start = self._norms()
        except Exception as err:  # evidence only: the guard goes on without the log
            log.warning("nanguard: no weight log: %r", err)

    def _norms(self) -> torch.Tensor | None:
        """Every weight's norm as one float64 device tensor (this rank's shard of a sharded one): a weight
        grown past 1e19 has a float32 norm of Inf long before its products overflow."""
        if not self._params:
            return None
        enabled = torch.is_grad_enabled()  # no_grad's grad mode in two calls, where its context manager makes a dozen
        compat.set_grad_enabled(False)
        try:
            tensors = self._params if self._plain else [local(p) for p in self._params]
            try:
                norms = torch._foreach_norm(tensors, 2, dtype=torch.float64)
            except (RuntimeError, TypeError):  # a device without float64
                norms = torch._foreach_norm(tensors)
            device = norms[0].device
            return torch.stack(norms if {n.device for n in norms} == {device} else [n.to(device) for n in norms])
        finally:
            compat.set_grad_enabled(enabled)

    def record(self, step: int) -> None:
        """After the update of ``step``: the LR's sign, and a sample every ``every`` updates. Never raises."""
        if self.start is None:
            return
        try:
            lr = current_lr(self.optimizer)
            if type(lr) is float or (isinstance(lr, (int, float)) and not isinstance(lr, bool)):  # (a float: no call)
                if lr < 0 and self.negative_since is None:
                    self.negative_since = step
                elif lr >= 0:
                    self.negative_since = None
            self._updates += 1
            if self._updates % self.every == 0:
                norms = self._norms()
                if norms is not None:
                    self.samples.append((step, norms))
        except Exception as err:  # evidence only: a run is never stopped for it
            log.warning("nanguard: the weight log stopped: %r", err)
            self.start = None

    def evidence(self, step: int) -> dict[str, Any]:
        """``_evidence``, or {} when reading the log fails: a trip's diagnosis never fails for it."""
        try:
            return self._evidence(step)
        except Exception as err:
            log.warning("nanguard: the weight log could not be read: %r", err)
            return {}

    def _evidence(self, step: int) -> dict[str, Any]:
        """What the log says at a trip at ``step`` (a host read, on the trip only): the weight that grew most
        since the start, ``growth`` (now over start), ``per_step`` (its growth per update over the last
        samples), ``since`` (the first step of the samples in a row that grew), and ``lr_negative_since``.
        {} when nothing was recorded."""
        out: dict[str, Any] = {}
        if self.negative_since is not None:
            out["lr_negative_since"] = self.negative_since
        now = self._norms() if self.start is not None else None
        if self.start is None or now is None:
            return out
        steps, values = self._table(step, now)
        best = max(range(len(values)), key=lambda i: _growth(values[i]))
        row = values[best]
        if _growth(row) <= 0:
            return out
        first, per_step = _rise(row, steps)
        out.update(
            parameter=self.names[best],
            norm_start=row[0],
            norm_now=row[-1],
            growth=_growth(row),
            per_step=per_step,
            since=max(steps[first], 0),
            sampled_every=self.every,
        )
        return out

    def _table(self, step: int, now: torch.Tensor) -> tuple[list[int], list[list[float]]]:
        """The samples before ``step`` and ``now`` after the start (step -1): their steps, and one row of
        norms per weight (a host read)."""
        assert self.start is not None
        series = [(s, n.to(self.start.device)) for s, n in self.samples if s < step]
        now = now.to(self.start.device)
        if not series or not torch.equal(series[-1][1], now):  # else the last sample is now: counted once
            series.append((step, now))
        steps = [-1, *(s for s, _ in series)]
        table = torch.stack([self.start, *(n for _, n in series)])
        return steps, table.double().t().tolist()  # one row per weight, one column per sample


def _rise(row: list[float], steps: list[int]) -> tuple[int, float]:
    """Where the samples in a row that grew begin (an index of ``row``), and the growth per update over the
    last two samples (over the whole rise, when it is shorter)."""
    first = len(row) - 1
    while first > 0 and 0 < row[first - 1] < row[first]:
        first -= 1
    recent = max(first, len(row) - 3)
    span = steps[-1] - steps[recent]
    per_step = (row[-1] / row[recent]) ** (1 / span) if span > 0 and row[recent] > 0 else 1.0
    return first, per_step


def _growth(row: list[float]) -> float:
    """The last norm over the first, 0 when either is 0 or not finite."""
    start, now = row[0], row[-1]
    return now / start if 0 < start < math.inf and 0 < now < math.inf else 0.0
