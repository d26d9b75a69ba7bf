"""Where a guarded run stands: the one record the guard's parts share instead of the guard.

``Guard.step_count``, ``last_action``, ``last_diagnosis`` and ``last_grad_norm`` read it. The parts
that report where the run is (the apply, the DDP ``join()`` shadow, the fire drill's injector) are
handed this record, never the guard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanguard.errors import NonFiniteError
from nanguard.findings import Diagnosis
from nanguard.guard.recovery import Recovery
from nanguard.guard.remedies import Remedies

__all__ = ["Outcome", "PolicyView", "Progress"]


@dataclass
class Progress:
    """The run's counters and its latest outcome.

    Example:
        >>> progress = Progress()
        >>> progress.step, progress.action
        (0, None)
    """

    step: int = 0
    """Steps checked so far (``Guard.step_count``): the index the next step is checked as."""
    calls: int = 0
    """``Guard.step``/``check`` calls, undone by nothing: the step index the ranks agree on."""
    action: str | None = None
    """The latest step's action (``Guard.last_action``)."""
    diagnosis: Diagnosis | None = None
    """The latest trip's diagnosis (``Guard.last_diagnosis``)."""
    grad_norm: float | torch.Tensor | None = None
    """The latest checked step's gradient norm, across ranks, before clipping (``Guard.last_grad_norm``);
    a tensor until read, where a disabled guard computed it."""

    def fold(self, outcome: Outcome) -> None:
        """Take in where an applied step left the run (its fields that are not None)."""
        if outcome.step is not None:
            self.step = outcome.step
        if outcome.action is not None:
            self.action = outcome.action
        if outcome.diagnosis is not None:
            self.diagnosis = outcome.diagnosis
        if outcome.grad_norm is not None:
            self.grad_norm = outcome.grad_norm


@dataclass(frozen=True, slots=True)
class Outcome:
    """Where a step's applied action leaves the run (``guard/apply.py``); None leaves a field as it was.

    Example:
        >>> progress.fold(Outcome(step=8, action="skip"))
        >>> progress.step, progress.action
        (8, 'skip')
    """

    step: int | None = None
    action: str | None = None
    diagnosis: Diagnosis | None = None
    grad_norm: float | None = None
    update: bool = False
    """The optimizer update goes ahead."""
    error: NonFiniteError | None = None
    """The policy stopped the run: the guard raises it once the outcome is folded in."""


class PolicyView:
    """What the policy reads of the other parts (``policy.State``), read only when it asks.

    Example:
        >>> PolicyView(recovery, remedies, progress).has_snapshot
        True
    """

    def __init__(self, recovery: Recovery, remedies: Remedies, progress: Progress) -> None:
        self._recovery, self._remedies, self._progress = recovery, remedies, progress

    @property
    def has_snapshot(self) -> bool:
        return self._recovery.snapshot is not None

    @property
    def consecutive_skips(self) -> int:
        return self._recovery.consecutive_skips

    @property
    def upcast(self) -> list[str]:
        return self._remedies.upcast

    @property
    def last_diagnosis(self) -> Diagnosis | None:
        return self._progress.diagnosis

    def can_upcast(self, module: str | None) -> str | None:
        return self._remedies.can_upcast(module)
