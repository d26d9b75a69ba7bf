"""``Evidence`` and ``OriginEvidence``: a diagnosis's evidence (``diag.evidence``) as typed records.

The evidence stays plain JSON in the public contract (``Diagnosis.to_dict``, events, bundles);
these records are the one place its keys are agreed. The tracer builds them
(``tracer.dispatch.Origin.to_evidence``, ``tracer.api``), the rules (``diagnose``) read them,
and the text layer and remedies read a written dict back through ``from_dict``, so a key renamed
on one side fails (a TypeError where a record is built, a test in ``tests/test_evidence.py``)
instead of reading as None. Keys a record does not name (a rule's own facts, what the guard adds
later) are kept as they are in ``extra`` and read with ``get``.

Imports nothing from nanguard.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["Evidence", "OriginEvidence", "RunFacts"]


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
        """The JSON form ``from_dict`` reads: the keys as they were given, or for a record built
        in code the tracer's form (the location and statistics always, the index facts when set)."""
        names = self.given or _ORIGIN_ALWAYS
        names += tuple(
            n for n in (*_ORIGIN_ALWAYS, *_ORIGIN_INDEX) if n not in names and getattr(self, n) not in (None, [])
        )
        return {**{name: getattr(self, name) for name in names}, **self.extra}

    def get(self, key: str, default: Any = None) -> Any:
        """A fact the record does not name (``reduced_elements``, ``fully_masked_rows``, ...)."""
        return _extra(self, key, default)

    @property
    def located(self) -> bool:
        return self.category is not None


_ORIGIN_ALWAYS: tuple[str, ...] = ("category", "op", "module", "module_type", "phase", "node", "forward_op")
_ORIGIN_ALWAYS += ("source", "library_source", "path", "inputs", "outputs", "scalars")
_ORIGIN_INDEX = ("error", "index_inputs", "indexed_size")


def _extra(record: OriginEvidence | Evidence, key: str, default: Any) -> Any:
    if key in {f.name for f in fields(record)}:
        raise KeyError(f"{key!r} is a field of {type(record).__name__}: read .{key}")
    return record.extra.get(key, default)


@dataclass(frozen=True)
class Evidence:
    """``diag.evidence``: what the tracer saw and what the rules read (the history, the weight scale).

    Example:
        >>> ev = Evidence(origin=OriginEvidence(category="op", op="aten.log.default", inputs=[{"zeros": 3}]))
        >>> diagnose(ev).cause
        'op.log_domain'
        >>> Evidence.from_dict(ev.to_dict()) == Evidence.from_dict(ev.to_dict())
        True
    """

    origin: OriginEvidence | None = None
    kind: str | None = None
    """"nan" or "inf": what the origin op created."""
    before: list[dict[str, Any]] | None = None
    after: list[dict[str, Any]] | None = None
    """The ops that ran just before and after the origin (``op`` each)."""
    results: list[dict[str, Any]] | None = None
    nonfinite_results: int | None = None
    library_source: str | None = None
    communication: dict[str, Any] | None = None
    exception: dict[str, Any] | None = None
    weight_scale: dict[str, Any] | None = None
    """The model's weights against 1/sqrt(fan_in) now: ``max_ratio``, ``module``."""
    initial_weight_scale: dict[str, Any] | None = None
    """The same at the guard's first step; when given the rules read it instead of ``weight_scale``."""
    history: dict[str, Any] | None = None
    """The guard's run history: ``diverging``, ``metric``, ``growth``, ``window``, ``lr``."""
    why: str | None = None
    op_cause: str | None = None
    """The op-level cause, when the history names another one."""
    created_in: dict[str, Any] | None = None
    rows: list[int] | None = None
    """The batch rows holding the bad values (a data cause, ``guard.remedies.with_bad_rows``)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Every other key, as written (``where``, ``rows``, ``flagged_ranks``, ...)."""
    given: tuple[str, ...] = ()

    @classmethod
    def of(cls, evidence: Evidence | Mapping[str, Any] | None) -> Evidence:
        """The record, from a record or a written dict."""
        return evidence if isinstance(evidence, Evidence) else cls.from_dict(evidence)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Evidence:
        """Read ``diag.evidence``; a key whose value is not of the record's kind stays in ``extra``."""
        data = dict(data or {})
        order = list(data)
        named = {f.name for f in fields(cls)} - {"extra", "given", "origin"}
        known: dict[str, Any] = {}
        for key in order:
            if key == "origin" and isinstance(data[key], Mapping):
                known["origin"] = OriginEvidence.from_dict(data.pop(key))
            elif key in named and _fits(key, data[key]):
                known[key] = data.pop(key)
        return cls(**known, extra=data, given=tuple(k for k in order if k in known))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form ``from_dict`` reads: the keys as given, then those set since (or built in code)."""
        names = self.given + tuple(
            f.name
            for f in fields(self)
            if f.name not in ("extra", "given", *self.given) and getattr(self, f.name) is not None
        )
        out = {name: getattr(self, name) for name in names}
        if isinstance(out.get("origin"), OriginEvidence):
            out["origin"] = out["origin"].to_dict()
        return {**out, **self.extra}

    def get(self, key: str, default: Any = None) -> Any:
        """A key the record does not name."""
        return _extra(self, key, default)

    @property
    def origin_or_empty(self) -> OriginEvidence:
        return self.origin if self.origin is not None else _NO_ORIGIN

    @property
    def scale(self) -> dict[str, Any]:
        """The weight scale the rules judge: the initial one when the guard gave it."""
        if "initial_weight_scale" in self.given or self.initial_weight_scale is not None:
            return self.initial_weight_scale or {}
        return self.weight_scale or {}


_NO_ORIGIN = OriginEvidence()
_KINDS: dict[str, tuple[type, ...]] = {
    "kind": (str,),
    "before": (list,),
    "after": (list,),
    "results": (list,),
    "nonfinite_results": (int,),
    "library_source": (str,),
    "communication": (dict,),
    "exception": (dict,),
    "weight_scale": (dict,),
    "initial_weight_scale": (dict,),
    "history": (dict,),
    "why": (str,),
    "op_cause": (str,),
    "created_in": (dict,),
    "rows": (list,),
}


def _fits(key: str, value: Any) -> bool:
    return value is None or (isinstance(value, _KINDS[key]) and not isinstance(value, bool))


@dataclass(frozen=True)
class RunFacts:
    """What only the guard knows about the run, for the one diagnosis of a trip: the ``history``
    (``guard.history.History.evidence``, {} with too few steps) and the weight scale the run
    started from (``initial_weight_scale``; None: not measured, the current scale is not judged).

    Example:
        >>> run = RunFacts(history={"diverging": True, "metric": "loss", "growth": 40.0, "window": 5})
        >>> run.written()
        {'initial_weight_scale': None, 'history': {'diverging': True, 'metric': 'loss', 'growth': 40.0, 'window': 5}}
    """

    history: dict[str, Any]
    initial_weight_scale: dict[str, Any] | None = None

    def written(self) -> dict[str, Any]:
        """The evidence keys a located diagnosis judged with these facts carries."""
        return {
            "initial_weight_scale": self.initial_weight_scale,
            **({"history": self.history} if self.history else {}),
        }

    @staticmethod
    def judged(evidence: Mapping[str, Any]) -> bool:
        """Was this located evidence already judged with the run's facts?"""
        return "initial_weight_scale" in evidence
