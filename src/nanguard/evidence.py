"""``OriginEvidence``: the origin a diagnosis carries (``diag.evidence["origin"]``), as a typed record.

The tracer writes the origin (``tracer.dispatch.Origin.to_evidence``) as plain JSON, so bundles,
events and reports carry it; the parts that read it back go through this record, so a key
renamed on the writing side fails a test (``tests/test_evidence.py``) instead of reading as None.
Keys this record does not name (a rule's own facts) are kept as they are in ``extra``.

Imports nothing from nanguard.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["OriginEvidence"]


@dataclass(frozen=True)
class OriginEvidence:
    """Where the first non-finite value (or the failing index op) was, as the tracer recorded it.

    Example:
        >>> origin = OriginEvidence.from_dict(diag.evidence.get("origin"))
        >>> origin.category, origin.op, origin.path
        ('data', None, "batch['x']")
    """

    category: str | None = None
    """"op", "data", "parameters", "write", "fill", or "index" (an index op raised)."""
    op: str | None = None
    module: str | None = None
    module_type: str | None = None
    phase: str | None = None
    node: str | None = None
    forward_op: str | None = None
    source: str | None = None
    library_source: str | None = None
    path: str | None = None
    """The input that held the value: ``batch['x']`` (data origins)."""
    inputs: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[dict[str, Any]] = field(default_factory=list)
    scalars: list[Any] = field(default_factory=list)
    error: str | None = None
    """category "index": the error the op raised."""
    index_inputs: list[dict[str, Any]] = field(default_factory=list)
    """category "index": statistics of the integer inputs, with their ``path``."""
    indexed_size: int | None = None
    """category "index": the size of the indexed dimension (ids must be below it)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Every other key, as written."""
    given: tuple[str, ...] = ()
    """The named keys the written form had, in its order (``to_dict`` writes them back)."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> OriginEvidence:
        """Read ``diag.evidence["origin"]`` (None or {} when the diagnosis has no origin)."""
        data = dict(data or {})
        named = {f.name for f in fields(cls)} - {"extra", "given"}
        order = list(data)
        known = {k: data.pop(k) for k in order if k in named}
        if not isinstance(known.get("indexed_size"), (int, type(None))) or isinstance(known.get("indexed_size"), bool):
            data["indexed_size"] = known.pop("indexed_size")  # not a size: kept as written, not used
        for name in ("inputs", "outputs", "index_inputs"):
            if name in known and not (isinstance(known[name], list) and all(isinstance(s, dict) for s in known[name])):
                data[name] = known.pop(name)
        return cls(**known, extra=data, given=tuple(k for k in order if k in known))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form ``from_dict`` reads: the keys as they were given."""
        return {**{name: getattr(self, name) for name in self.given}, **self.extra}

    @property
    def located(self) -> bool:
        return self.category is not None
