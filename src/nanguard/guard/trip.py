"""A trip as the guard records it: one typed record, built once from what the parts report.

The measured diagnosis comes from the replay (``guard/measure.py``); the guard then learns which
planted faults it answers (``nanguard.inject``), where it ran (``nanguard.hardware``) and where its
bundle went (``guard/recorder.py``). Each part returns what it found; none writes into the diagnosis.
``Trip.diagnosis`` is the measured one with what they found in its evidence, under the keys the
evidence contract documents (``injected``, ``where``, ``flagged_where``, ``suspect_device``,
``bundle``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from nanguard.findings import Diagnosis

__all__ = ["Trip"]


@dataclass(frozen=True)
class Trip:
    """One trip: the measured diagnosis and what the guard adds to it.

    Example:
        >>> trip = Trip(measured, step=7, action="skip", injected=[], hardware={"where": here})
        >>> trip.diagnosis.evidence["where"] == here
        True
    """

    measured: Diagnosis
    step: int
    action: str
    injected: list[dict[str, Any]] = field(default_factory=list)
    """The planted faults the trip answers (a fire drill); [] for a real one."""
    hardware: dict[str, Any] = field(default_factory=dict)
    """Where it ran: ``where``, and under torch.distributed ``flagged_where``, ``suspect_device``."""
    bundle: str | None = None
    """The repro bundle's path, once written."""
    diagnosis: Diagnosis = field(init=False, compare=False)
    """The measured diagnosis with what the trip adds in its evidence: built once, with the record."""

    def __post_init__(self) -> None:
        added = {
            **({"injected": self.injected} if self.injected else {}),
            **self.hardware,
            **({"bundle": self.bundle} if self.bundle is not None else {}),
        }
        built = replace(self.measured, evidence={**self.measured.evidence, **added}) if added else self.measured
        object.__setattr__(self, "diagnosis", built)

    def with_bundle(self, path: str | None) -> Trip:
        """The same trip, its bundle written at ``path`` (None: none was)."""
        return self if path is None else replace(self, bundle=path)
