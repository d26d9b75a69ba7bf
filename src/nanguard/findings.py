"""The records every part of nanguard speaks: ``Diagnosis``, ``Finding`` and ``CAUSES``.

They are plain data: JSON-safe through ``to_dict``/``from_dict``, so events, bundles and
reports can carry them to disk and back without pickle.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any

from nanguard.causes import TABLE
from nanguard.text import diagnosis_text, summary

__all__ = ["CAUSES", "KINDS", "PHASES", "Diagnosis", "Finding", "jsonable"]

CAUSES: Mapping[str, str] = MappingProxyType({cause.id: cause.meaning for cause in TABLE.values()})
"""Every cause id and its meaning, read from the cause table (``nanguard.causes``)."""

PHASES = ("data", "parameters", "forward", "backward", "optimizer", "communication")
KINDS = ("nan", "inf", "invalid")
"""``Diagnosis.kind``: what the origin created. "invalid" when nothing non-finite exists at the origin: an
index out of range (the op raised) or replicas whose finite parameters differ."""


def jsonable(value: Any) -> Any:
    """Turn ``value`` into plain JSON values; non-finite floats become strings."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return jsonable(value.item())
    return str(value)


@dataclass(frozen=True)
class Diagnosis:
    """Where the first non-finite value was created, why, and what to try. Frozen: a different
    diagnosis is a new one (``dataclasses.replace(diag, step=3)``).

    Example:
        >>> diag = ng.locate(closure, model=model)
        >>> diag.cause, diag.op, diag.module, diag.phase
        ('op.log_domain', 'aten.log.default', 'head', 'forward')
        >>> [a["cause"] for a in diag.also]   # other causes that fit, most likely first
        []
        >>> print(diag)
    """

    cause: str
    kind: str = "nan"
    phase: str = "forward"
    op: str | None = None
    module: str | None = None
    rank: int | None = None
    ranks: list[int] = field(default_factory=list)
    step: int | None = None
    source: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    fixes: list[str] = field(default_factory=list)
    also: list[dict[str, str]] = field(default_factory=list)
    """Other causes that fit the evidence, most likely first: ``{"cause": id, "why": one line}`` each."""

    def __post_init__(self) -> None:
        if self.cause not in CAUSES:
            raise ValueError(f"cause must be one of {sorted(CAUSES)}, got {self.cause!r}")
        for other in self.also:
            if not isinstance(other, Mapping) or other.get("cause") not in CAUSES:
                raise ValueError(f"also must hold {{'cause': one of ng.CAUSES, 'why': str}} dicts, got {other!r}")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")

    @property
    def meaning(self) -> str:
        return CAUSES[self.cause]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict; ``Diagnosis.from_dict`` reads it back."""
        return jsonable(asdict(self))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Diagnosis:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in names})

    def summary(self) -> str:
        """One line: cause, what was created and where."""
        return summary(self)

    def __str__(self) -> str:
        return diagnosis_text(self, evidence=False)


@dataclass
class Finding:
    """One problem an audit found before it hurt.

    Example:
        >>> [f.cause for f in ng.check_batch({"input_ids": ids}, vocab_size=100)]
        ['data.index_out_of_range']
    """

    cause: str
    where: str
    message: str
    fix: str = ""
    severity: str = "error"
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.cause not in CAUSES:
            raise ValueError(f"cause must be one of {sorted(CAUSES)}, got {self.cause!r}")
        if self.severity not in ("error", "warning"):
            raise ValueError(f"severity must be 'error' or 'warning', got {self.severity!r}")

    def to_dict(self) -> dict[str, Any]:
        return jsonable(asdict(self))

    def __str__(self) -> str:
        text = f"[{self.cause}] {self.where}: {self.message}"
        return f"{text} Fix: {self.fix}" if self.fix else text
