"""The ``Verdict``: what measuring one step found (``guard/measure.py``), before the policy decides
(``guard/policy.py``) and the apply stage acts (``guard/apply.py``)."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any, Literal, get_args

from nanguard.findings import Diagnosis
from nanguard.guard.health import HostCopy, StepHealth
from nanguard.guard.history import Departure, Forecast
from nanguard.spikes import Spike

__all__ = ["KINDS", "Verdict", "VerdictKind"]

VerdictKind = Literal["healthy", "spike", "trip", "overflow", "collapse", "replicas", "deferred"]
"""What a ``Verdict`` can say about a step."""
KINDS: tuple[VerdictKind, ...] = get_args(VerdictKind)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What measuring one step found, before anything is decided. Frozen: built once by the measure.

    Example:
        >>> Verdict("trip", 7, health, diagnosis=diag).kind
        'trip'
    """

    kind: VerdictKind
    step: int
    health: StepHealth | None = None
    _: KW_ONLY
    diagnosis: Diagnosis | None = None
    """The step's diagnosis: a trip, a collapsed loss scale, replicas that differ."""
    spikes: list[Spike] | None = None
    module_stats: dict[str, Any] | None = None
    source: int | None = None
    """replicas: the finite majority rank to copy from, None when no replica is finite."""
    queued: HostCopy | None = None
    """deferred: the step's health on its way to the host, read with the next call."""
    forecast: Forecast | None = None
    """A finite step's metric growing towards the float32 overflow (recorded as a warning)."""
    departure: Departure | None = None
    """A finite step's loss or grad norm leaving its recent level tenfold (recorded as a warning)."""
    overflow: float | None = None
    """overflow, collapse: the scale the GradScaler's own step set (it skipped the update)."""
    own_spike: Spike | None = None
    """A spike of this rank's own loss where the mean loss was not agreed (``History.own_spike``): recorded
    by this rank alone, decided on by no one."""
