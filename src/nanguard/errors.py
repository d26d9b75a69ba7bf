"""Exceptions nanguard raises.

NanguardError            base of everything below
├── NonFiniteError       a guarded step went non-finite; ``.diagnosis`` says why
├── OutOfStepError       under torch.distributed the ranks' guards are at different steps
├── BundleError          a repro bundle is missing, corrupt, truncated or foreign
└── EventLogError        an event log cannot be read at all
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanguard.findings import Diagnosis

__all__ = ["BundleError", "EventLogError", "NanguardError", "NonFiniteError", "OutOfStepError"]


class NanguardError(Exception):
    """Base class of nanguard's own errors."""


class NonFiniteError(NanguardError):
    """A step produced NaN/Inf and the policy says stop.

    Example:
        >>> try:
        ...     guard.step(closure)
        ... except NonFiniteError as err:
        ...     print(err.diagnosis.cause)
    """

    def __init__(self, diagnosis: Diagnosis | None, message: str | None = None) -> None:
        self.diagnosis = diagnosis
        text = message or (str(diagnosis) if diagnosis is not None else "non-finite values")
        super().__init__(text)


class OutOfStepError(NanguardError):
    """The ranks' guards agreed on one step while at different steps: one rank's loop skipped a
    ``Guard.step`` call (or called it again) and every collective since pairs the wrong steps.

    Every rank raises it at the same call, so none hangs. ``steps`` maps each rank to the index of
    its ``Guard.step``/``check`` call (each call counts, including one whose closure raised).

    Example:
        >>> try:
        ...     guard.step(closure)
        ... except OutOfStepError as err:
        ...     err.steps
        {0: 3, 1: 4}
    """

    def __init__(self, steps: dict[int, int]) -> None:
        self.steps = dict(steps)
        groups: dict[int, list[int]] = {}
        for r, s in sorted(self.steps.items()):
            groups.setdefault(s, []).append(r)
        parts = "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} at call {s}"
            for s, rs in sorted(groups.items())
        )
        super().__init__(
            f"nanguard: the ranks are out of step ({parts}): a rank's loop skipped or repeated a guarded "
            "step, so its gradients were averaged with another step's; every rank stops here"
        )


class BundleError(NanguardError):
    """A repro bundle cannot be read: the message names the file and what is wrong."""

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class EventLogError(NanguardError):
    """An event log or run directory cannot be read: names the file and the problem."""

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")
