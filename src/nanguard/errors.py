"""Exceptions nanguard raises.

NanguardError            base of everything below
├── NonFiniteError       a guarded step went non-finite; ``.diagnosis`` says why
├── BundleError          a repro bundle is missing, corrupt, truncated or foreign
└── EventLogError        an event log cannot be read at all
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanguard.findings import Diagnosis

__all__ = ["BundleError", "EventLogError", "NanguardError", "NonFiniteError"]


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
