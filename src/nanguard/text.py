"""Diagnoses, evidence and events in words: the one text layer for ``str(diag)``, the terminal and HTML.

A fact is worded here once, whoever shows it. This module imports nothing from nanguard at import
time, so the records in ``findings`` can use it for ``str(diag)`` without an import cycle; it reads a
diagnosis through ``DiagnosisFields``, the fields of ``findings.Diagnosis`` it words, and its evidence
through the typed records of ``nanguard.evidence`` (which import nothing from nanguard either).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from nanguard.evidence import Evidence


class DiagnosisFields(Protocol):
    """The fields of a ``findings.Diagnosis`` this module words (read only: a diagnosis is frozen)."""

    @property
    def cause(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def phase(self) -> str: ...
    @property
    def op(self) -> str | None: ...
    @property
    def module(self) -> str | None: ...
    @property
    def rank(self) -> int | None: ...
    @property
    def ranks(self) -> list[int]: ...
    @property
    def step(self) -> int | None: ...
    @property
    def source(self) -> str | None: ...
    @property
    def evidence(self) -> dict[str, Any]: ...
    @property
    def fixes(self) -> list[str]: ...
    @property
    def also(self) -> list[dict[str, str]]: ...

    @property
    def meaning(self) -> str: ...


__all__ = [
    "DRILL_COLUMNS",
    "HARDWARE_COLUMNS",
    "KIND_NAMES",
    "RANK_COLUMNS",
    "DiagnosisFields",
    "device_words",
    "diagnosis_text",
    "drill_rows",
    "event_words",
    "evidence_lines",
    "fmt",
    "hardware_rows",
    "kind_name",
    "number",
    "op_path",
    "rank_rows",
    "short_op",
    "summary",
    "tensor_words",
    "where_lines",
]

KIND_NAMES = {"nan": "NaN", "inf": "Inf", "invalid": "invalid value"}
_MAX_LISTED = 6


def kind_name(kind: str) -> str:
    """``"nan"`` -> ``"NaN"``, ``"inf"`` -> ``"Inf"``, ``"invalid"`` -> ``"invalid value"``; anything else as given."""
    return KIND_NAMES.get(kind, kind)


def short_op(op: Any) -> str:
    """An ATen op's name without namespace and overload; other names as given.

    Example:
        >>> short_op("aten._softmax.default"), short_op("aten.add.Tensor"), short_op(None)
        ('_softmax', 'add', '')
    """
    if not op:
        return ""
    parts = str(op).split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else str(op)


def number(value: Any) -> float | None:
    """Read a float written by the log back: ``"nan"``/``"inf"`` strings included.

    Example:
        >>> number("nan"), number(2), number("x")
        (nan, 2.0, None)
    """
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def fmt(value: Any, digits: int = 4) -> str:
    """A number in a few significant digits; NaN/Inf (also as strings) by name, None as ``-``.

    Example:
        >>> fmt(0.000123456), fmt("nan"), fmt(None)
        ('0.0001235', 'NaN', '-')
    """
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    num = number(value)
    if num is None:
        return str(value)
    if math.isnan(num):
        return "NaN"
    if math.isinf(num):
        return "Inf" if num > 0 else "-Inf"
    if isinstance(value, int):
        return str(value)
    return f"{num:.{digits}g}"


def tensor_words(stats: Mapping[str, Any]) -> str:
    """One tensor's recorded statistics as a phrase: dtype, shape, range and non-finite counts.

    Example:
        >>> tensor_words({"dtype": "float32", "shape": [8, 4], "min": -1.0, "max": 2.0, "nan": 3})
        'float32 [8, 4], finite range -1 .. 2, 3 NaN'
    """
    parts = []
    head = str(stats.get("dtype", "tensor"))
    if isinstance(stats.get("shape"), list):
        head += " [" + ", ".join(str(s) for s in stats["shape"]) + "]"
    if stats.get("path"):
        head = f"{stats['path']}: {head}"
    parts.append(head)
    if "min" in stats and "max" in stats:
        parts.append(f"finite range {fmt(stats['min'])} .. {fmt(stats['max'])}")
    counts = [(stats.get("nan"), "NaN"), (stats.get("posinf"), "+Inf"), (stats.get("neginf"), "-Inf")]
    counts += [(stats.get("zeros"), "zeros")]
    parts += [f"{n} {label}" for n, label in counts if isinstance(n, int) and n > 0]
    return ", ".join(parts)


def _listed(items: Sequence[Any], total: int | None = None) -> str:
    shown = ", ".join(str(i) for i in items[:_MAX_LISTED])
    more = (total if total is not None else len(items)) - min(len(items), _MAX_LISTED)
    return shown + (f" and {more} more" if more > 0 else "")


def summary(diag: DiagnosisFields) -> str:
    """One line: cause, what was created and where.

    Example:
        >>> summary(Diagnosis(cause="op.log_domain", op="aten.log.default", module="head", step=3))
        "op.log_domain: NaN in aten.log.default module 'head' (forward) step 3"
    """
    parts = []
    if diag.op:
        parts.append(f"in {diag.op}")
    if diag.module is not None:
        parts.append(f"module {diag.module or '<root>'!r}")
    parts.append(f"({diag.phase})")
    if diag.rank is not None:
        parts.append(f"rank {diag.rank}")
    if diag.step is not None:
        parts.append(f"step {diag.step}")
    return f"{diag.cause}: {kind_name(diag.kind)} {' '.join(parts)}"


def where_lines(diag: DiagnosisFields) -> list[tuple[str, str]]:
    """(label, value) pairs saying where the origin is: module, op, autograd node, input, source, phase, rank, step."""
    record = _record(diag)
    origin = record.origin_or_empty
    return [
        *_what_ran(diag, record, origin),
        *_where_in_the_graph(diag, record, origin),
        *_where_in_the_run(diag, record, origin),
    ]


def _what_ran(diag: DiagnosisFields, record: Evidence, origin: Any) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    if diag.module is not None:
        mtype = origin.module_type
        rows.append(("module", f"{diag.module or '<root>'}" + (f" ({mtype})" if mtype else "")))
    if diag.op:
        rows.append(("op", diag.op))
    if origin.get("user_op"):
        inner = f", where {origin.get('internal_op')} made it" if origin.get("internal_op") else ""
        rows.append(("inside", f"torch's implementation of {origin.get('user_op')}{inner}"))
    if origin.get("gradient_surgery"):
        read = ", ".join(str(g) for g in origin.get("gradients_of") or [])
        surgery = "an op on .grad after backward(), before the optimizer step"
        rows.append(("gradients", surgery + (f": {read}" if read else "")))
    raised = record.exception
    if isinstance(raised, Mapping):
        at = f" at {raised['raised_at']}" if raised.get("raised_at") else ""
        rows.append(("raised", f"{raised.get('type')}: {raised.get('message', '')}{at}"))
    return rows


def _where_in_the_graph(diag: DiagnosisFields, record: Evidence, origin: Any) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    if origin.node:
        fwd = origin.forward_op
        rows.append(("autograd", origin.node + (f" (backward of {fwd})" if fwd else "")))
    if origin.path:
        rows.append(("input", origin.path))
    if diag.source:
        rows.append(("your code", diag.source))
    rows.append(("phase", diag.phase))
    return rows


def _where_in_the_run(diag: DiagnosisFields, record: Evidence, origin: Any) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    if diag.rank is not None:
        ranks = ", ".join(str(r) for r in diag.ranks) if len(diag.ranks) > 1 else str(diag.rank)
        rows.append(("rank", ranks))
    if diag.step is not None:
        rows.append(("step", str(diag.step)))
    where = record.get("where")
    if isinstance(where, Mapping) and where.get("host"):
        rows.append(("host", device_words(where)))
    drill = "a fire drill (NANGUARD_INJECT), not a fault of the run"
    rows += [("injected", f"{f.get('fault')}: {drill}") for f in record.get("injected") or [] if isinstance(f, Mapping)]
    return rows


def _record(diag: DiagnosisFields) -> Evidence:
    # evidence.py imports nothing from nanguard: read here, at call time, it adds no edge findings -> text
    # could close into a cycle, and text's module-level imports stay free of nanguard (tests/test_layout.py).
    from nanguard.evidence import Evidence

    return Evidence.of(diag.evidence)


def device_words(where: Mapping[str, Any]) -> str:
    """Where a rank ran, in words: host, local rank, device and its ids.

    Example:
        >>> device_words({"host": "node7", "local_rank": 3, "device": "cuda:3", "uuid": "GPU-8f..."})
        'node7 local rank 3, cuda:3 (GPU-8f...)'
    """
    ids = [str(where[k]) if k == "uuid" else f"pci {where[k]}" for k in ("uuid", "pci_bus_id") if where.get(k)]
    device = f"{where.get('device')}" + (f" ({', '.join(ids)})" if ids else "")
    return f"{where.get('host')} local rank {where.get('local_rank')}, {device}"


def diagnosis_text(diag: DiagnosisFields, *, evidence: bool = True) -> str:
    """The diagnosis as plain lines: what was created and why, where, the evidence, and fixes.

    ``str(diag)`` is the short form, ``evidence=False``: of the evidence only the ``why`` line.
    The terminal prints the full form when its output is not a TTY.

    Example:
        >>> print(diagnosis_text(diag).splitlines()[0])
        nanguard: NaN created - op.masked_softmax (softmax over a row that is entirely -inf ...)
    """
    if evidence:
        facts = evidence_lines(diag)
    else:
        why = (diag.evidence or {}).get("why")
        facts = [("why", str(why))] if why else []
        facts += [("also", f"{a.get('cause')}: {a.get('why', '')}") for a in diag.also or [] if isinstance(a, Mapping)]
    rows = [*where_lines(diag), *facts]
    rows += [("try" if i == 1 else "", f"{i}. {fix}") for i, fix in enumerate(diag.fixes, start=1)]
    width = max((len(label) for label, _ in rows), default=5)
    lines = [f"nanguard: {kind_name(diag.kind)} created - {diag.cause} ({diag.meaning})"]
    lines += [f"  {label:<{width}}  {value}" for label, value in rows]
    return "\n".join(lines)


def evidence_lines(diag: DiagnosisFields) -> list[tuple[str, str]]:
    """(label, sentence) pairs saying what the evidence shows, most telling first.

    Example:
        >>> for label, text in evidence_lines(diag):
        ...     print(f"{label:>10}  {text}")
               why  128 of 1024 rows given to aten._softmax.default ... are entirely -inf
            output  float32 [8, 4, 32, 32], finite range 0 .. 1, 4096 NaN
    """
    ev = _record(diag)
    return [line for lines in _EVIDENCE_LINES for line in lines(diag, ev, ev.origin_or_empty)]


Lines = list[tuple[str, str]]


def _why(diag: DiagnosisFields, ev: Evidence, origin: Any) -> Lines:
    lines = [("why", str(ev.why))] if ev.why else []
    if ev.op_cause and ev.op_cause != diag.cause:
        lines.append(("first op", f"the op-level cause was {ev.op_cause}; the history points further back"))
    if "loss" in ev.extra or "grad_norm" in ev.extra:
        lines.append(("values", f"loss {fmt(ev.get('loss'))}, gradient norm {fmt(ev.get('grad_norm'))}"))
    return lines


def _batch_findings(diag: DiagnosisFields, ev: Evidence, origin: Any) -> Lines:
    found = [f for f in ev.get("findings") or [] if isinstance(f, Mapping) and f.get("message")]
    return [("check_batch", f"{f.get('where', '')}: {f['message']}".lstrip(": ")) for f in found]


def _tensors(diag: DiagnosisFields, ev: Evidence, origin: Any) -> Lines:
    is_op = origin.category not in ("data", "parameters")
    lines: Lines = []
    for key, name in (("inputs", "op input" if is_op else "values"), ("outputs", "op output")):
        items = [s for s in getattr(origin, key) or [] if isinstance(s, Mapping)]
        lines += [(name if len(items) == 1 else f"{name} {i + 1}", tensor_words(st)) for i, st in enumerate(items)]
    size = origin.indexed_size
    valid = f"; valid ids are [0, {size - 1}]" if isinstance(size, int) else ""
    lines += [("ids", tensor_words(st) + valid) for st in origin.index_inputs or [] if isinstance(st, Mapping)]
    return lines


def _in_float32(diag: DiagnosisFields, ev: Evidence, origin: Any) -> Lines:
    fp32 = origin.get("fp32_recompute")
    if not (isinstance(fp32, Mapping) and fp32.get("finite")):
        return []
    past = f"past the {fp32.get('dtype')} max {fmt(fp32.get('dtype_max'))}"
    return [("in float32", f"the same op is finite with absmax {fmt(fp32.get('absmax'))}, {past}")]


def _masked_rows(diag: DiagnosisFields, ev: Evidence, origin: Any) -> Lines:
    masked, rows = origin.get("fully_masked_rows"), origin.get("rows")
    if not (isinstance(masked, int) and isinstance(rows, int)):
        return []
    return [("masked rows", f"{masked} of {rows} rows are fully masked")]


def _history(diag: DiagnosisFields, ev: Evidence, origin: Any) -> Lines:
    history = ev.history
    if not (isinstance(history, Mapping) and history.get("growth") is not None):
        return []
    metric = str(history.get("metric", "grad_norm")).replace("_", " ")
    verdict = "diverging" if history.get("diverging") else "not diverging"
    lr = f", lr {fmt(history['lr'])}" if history.get("lr") is not None else ""
    growth = fmt(history["growth"], 3)
    return [("history", f"{metric} grew {growth}x over the last {history.get('window')} steps{lr}: {verdict}")]


def _ranks(diag: DiagnosisFields, ev: Evidence, origin: Any) -> Lines:
    if ev.get("flagged_ranks") is None:
        return []
    flagged = ", ".join(str(r) for r in ev.get("flagged_ranks")) or "none"
    text = f"non-finite after the step on rank(s) {flagged}"
    received = ev.get("received_ranks")
    if diag.ranks and isinstance(received, list):  # the ranks replayed together, communicating
        text += f"; made by the own compute of rank(s) {', '.join(str(r) for r in diag.ranks)}"
        if received:
            text += f", it reached rank(s) {', '.join(str(r) for r in received)} through communication"
    elif diag.ranks and "per_rank_causes" in ev.extra:  # written only when some rank's replay reproduced it
        text += f"; replayed alone, it reproduces on rank(s) {', '.join(str(r) for r in diag.ranks)}"
    return [("ranks", text)]


def _stage(diag: DiagnosisFields, ev: Evidence, origin: Any) -> Lines:
    stage = ev.get("stage")
    if not (isinstance(stage, Mapping) and stage.get("index") is not None):
        return []
    created = stage.get("created")
    made = f": in {created} it received finite values, sent non-finite ones" if created else ""
    return [("stage", f"pipeline stage {stage['index']} of {stage.get('stages', '?')}{made}")]


def _per_rank(diag: DiagnosisFields, ev: Evidence, origin: Any) -> Lines:
    causes, received = ev.get("per_rank_causes"), ev.get("received_ranks")
    if isinstance(causes, Mapping) and isinstance(received, list):
        causes = {r: "received" if int(r) in received else c for r, c in causes.items()}
    if not (isinstance(causes, Mapping) and len(set(causes.values())) > 1):
        return []
    return [("per rank", ", ".join(f"rank {r}: {c}" for r, c in causes.items()))]


def _reached(diag: DiagnosisFields, ev: Evidence, origin: Any) -> Lines:
    results, lines = ev.results, []
    if isinstance(results, list) and results:
        total = ev.nonfinite_results if ev.nonfinite_results is not None else len(results)
        names = [r.get("path") for r in results if isinstance(r, Mapping)]
        lines.append(("reached", f"{total} non-finite result(s): {_listed(names, total)}"))
    after = ev.after
    if isinstance(after, list) and after:
        ops = [short_op(a.get("op")) or "?" for a in after if isinstance(a, Mapping)]
        lines.append(("then", " -> ".join(ops[:_MAX_LISTED]) + (" -> ..." if len(ops) > _MAX_LISTED else "")))
    if ev.get("parameters"):
        lines.append(("parameters", _listed(ev.get("parameters"), ev.get("nonfinite_parameters"))))
    return lines


def _init(diag: DiagnosisFields, ev: Evidence, origin: Any) -> Lines:
    scale = ev.weight_scale
    if not (isinstance(scale, Mapping) and scale.get("max_ratio") is not None and float(scale["max_ratio"]) > 3):
        return []
    return [("init", f"weight rms*sqrt(fan_in) reaches {fmt(scale['max_ratio'], 3)} in {scale.get('module')}")]


def _reduced(diag: DiagnosisFields, ev: Evidence, origin: Any) -> Lines:
    count, correction = origin.get("reduced_elements"), origin.get("correction")
    if not (isinstance(count, int) and isinstance(correction, (int, float)) and count - correction <= 0):
        return []
    divisor = fmt(count - correction)
    return [("reduced", f"{count} element(s), correction {fmt(correction)}: divides by {divisor}")]


def _denominator(diag: DiagnosisFields, ev: Evidence, origin: Any) -> Lines:
    denom, lines = origin.get("denominator"), []
    if isinstance(denom, Mapping) and denom.get("what"):
        zeros = f"{denom.get('zeros')} of {denom['size']} are 0" if "size" in denom else f"{fmt(denom.get('value'))}"
        lines.append(("denominator", f"{denom['what']}: {zeros}"))
    if origin.get("statistic") and origin.get("normalizes"):
        own = f"divides a tensor by its own {origin.get('statistic')} (read from the autograd graph)"
        lines.append(("normalizes", own))
    return lines


def _closing(diag: DiagnosisFields, ev: Evidence, origin: Any) -> Lines:
    lines = [("also", f"{o.get('cause')}: {o.get('why', '')}") for o in diag.also or [] if isinstance(o, Mapping)]
    if ev.get("error"):
        lines.append(("error", str(ev.get("error"))))
    elif origin.error:
        lines.append(("error", str(origin.error)))
    if ev.get("bundle"):
        lines.append(("bundle", str(ev.get("bundle"))))
    return lines


# The evidence's lines in the order they are shown, most telling first: each reads its own part.
_EVIDENCE_LINES = (
    _why,
    _batch_findings,
    _tensors,
    _in_float32,
    _masked_rows,
    _history,
    _ranks,
    _stage,
    _per_rank,
    _reached,
    _init,
    _reduced,
    _denominator,
    _closing,
)


def op_path(diag: DiagnosisFields) -> list[dict[str, Any]]:
    """The ops around the origin: ``before`` (the ops just before), the ``origin``, then ``after``.

    Each row has ``role``, ``op``, ``module``, ``phase`` and ``carries``: what non-finite
    value the op's output holds ("NaN", "Inf"), or "" for the ops before the origin.

    Example:
        >>> [(r["role"], r["op"]) for r in op_path(diag)][-3:]
        [('origin', 'aten._softmax.default'), ('after', 'aten.detach.default'), ...]
    """
    ev = _record(diag)
    origin = ev.origin_or_empty
    rows: list[dict[str, Any]] = []
    for item in ev.before or []:
        if isinstance(item, Mapping):
            rows.append(_row("before", item, ""))
    rows.append(
        {
            "role": "origin",
            "op": diag.op or origin.op or f"({origin.category or 'input'})",
            "module": diag.module if diag.module is not None else origin.module,
            "phase": diag.phase,
            "carries": kind_name(diag.kind),
        }
    )
    for item in ev.after or []:
        if isinstance(item, Mapping):
            rows.append(_row("after", item, "NaN" if item.get("nan") else "Inf"))
    return rows


def _row(role: str, item: Mapping[str, Any], carries: str) -> dict[str, Any]:
    return {
        "role": role,
        "op": str(item.get("op") or "?"),
        "module": item.get("module"),
        "phase": item.get("phase"),
        "carries": carries,
    }


def event_words(kind: str, fields: Mapping[str, Any]) -> str:
    """A skip, rollback, spike, warning or overflow event's fields as a short phrase.

    Example:
        >>> event_words("rollback", {"restored_step": 40, "skip_batches": 1, "reason": "op.log_domain"})
        'back to step 40, dropping 1 batch(es): op.log_domain'
    """
    f = fields
    if kind == "skip":
        return str(f.get("reason", ""))
    if kind == "rollback":
        return f"back to step {f.get('restored_step')}, dropping {f.get('skip_batches')} batch(es): {f.get('reason')}"
    if kind == "spike":
        return f"{f.get('metric')} {fmt(f.get('value'))} (median {fmt(f.get('median'))}, z={fmt(f.get('score'), 3)})"
    if kind == "warning":
        where = f" in {f.get('module')}" if f.get("module") else ""
        level = f"level {fmt(f.get('level'))}, lr {f.get('lr')}"
        if f.get("steps_left") is not None and f.get("trend") is not None:
            level += f", x{fmt(f.get('trend'))} a step, {f.get('steps_left')} steps left"
        return f"{f.get('signal')}{where} {fmt(f.get('value'))} ({level}): {f.get('fix')}"
    if kind == "overflow":
        return f"GradScaler scale {fmt(f.get('scale'))} -> {fmt(f.get('new_scale'))}"
    return ""


RANK_COLUMNS = ("rank", "steps logged", "skipped", "last loss", "last grad norm", "trips started here", "closed")


def rank_rows(data: dict[str, Any]) -> list[list[str]]:
    """One row per rank of ``RunReport.to_dict()["per_rank"]``, in ``RANK_COLUMNS`` order."""
    return [
        [
            f"rank {r}",
            str(d["steps_logged"]),
            str(d["skipped"]),
            fmt(d["last_loss"]),
            fmt(d["last_grad_norm"]),
            str(d["trips_originated"]),
            "yes" if d["finished"] else "no",
        ]
        for r, d in data["per_rank"].items()
    ]


REMEDY_COLUMNS = ("step", "cause", "remedy", "target", "reason")
HEADROOM_COLUMNS = ("step", "module", "dtype", "absmax")


def remedy_rows(markers: Any) -> list[list[str]]:
    """One row a remedy event (``.step``, ``.fields``), in ``REMEDY_COLUMNS`` order.

    Example:
        >>> remedy_rows(report.remedies)[0]
        ['3', 'data.nonfinite', 'quarantine', 'ids 5, 9', 'rows [1, 2] of the batch hold the bad values']
    """
    return [
        [
            str(m.step),
            str(m.fields.get("cause")),
            str(m.fields.get("action")),
            _target(m.fields.get("target")),
            str(m.fields.get("reason")),
        ]
        for m in markers
    ]


def headroom_rows(markers: Any) -> list[list[str]]:
    """One row a headroom event close to overflow, in ``HEADROOM_COLUMNS`` order."""
    return [
        [
            str(m.step),
            str(m.fields.get("module")),
            str(m.fields.get("dtype")),
            f"{m.fields.get('absmax'):.4g} of {m.fields.get('limit'):.4g}",
        ]
        for m in markers
        if m.fields.get("close")
    ]


def _target(target: object) -> str:
    if isinstance(target, list):
        shown = ", ".join(map(str, target[:8]))
        return f"ids {shown}" + (f" (+{len(target) - 8})" if len(target) > 8 else "")
    return "-" if target is None else str(target)


DRILL_COLUMNS = ("step", "fault", "detected as", "every rank's action", "agreed", "recovered in")


def drill_rows(drills: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """One row a planted fault (``Drill.to_dict()``), in ``DRILL_COLUMNS`` order.

    Example:
        >>> drill_rows([d.to_dict() for d in report.drills])[0]
        ['15', 'nan_grad@step=15,rank=1', 'op.nan_write', '0:skip 1:skip', 'yes', '0.041 s']
    """
    rows = []
    for d in drills:
        actions = d.get("actions") or {}
        detected = d.get("cause") or (
            "-" if d.get("kind") == "stall" else "yes" if d.get("detected") else "NOT DETECTED"
        )
        seconds = d.get("seconds")
        rows.append(
            [
                str(d.get("step")),
                str(d.get("fault")),
                str(detected),
                " ".join(f"{r}:{a}" for r, a in actions.items()),
                "yes" if d.get("agreed") else "NO",
                f"{seconds:.3g} s" if isinstance(seconds, (int, float)) else "-",
            ]
        )
    return rows


HARDWARE_COLUMNS = ("host", "device", "id", "trips", "not reproduced", "reproduced", "drill", "causes")


def hardware_rows(rows: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """One row a host and device (``nanguard.hardware.device_rows``), in ``HARDWARE_COLUMNS`` order.

    Example:
        >>> hardware_rows(device_rows(records))[0]
        ['node7', 'cuda:3', 'GPU-8f..', '3', '2', '1', '0', 'distributed.transient x2, op.log_domain']
    """
    out = []
    for r in rows:
        causes = r.get("causes") or {}
        named = ", ".join(c if n == 1 else f"{c} x{n}" for c, n in causes.items())
        counts = [str(r.get(k)) for k in ("trips", "transient", "reproduced", "injected")]
        out.append([str(r.get("host")), str(r.get("device")), str(r.get("id")), *counts, named or "-"])
    return out
