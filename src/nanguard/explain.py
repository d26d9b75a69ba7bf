"""``str(diagnosis)``: a short, readable explanation in plain text."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanguard.findings import Diagnosis

__all__ = ["explain", "where_lines"]

_CREATED = {"nan": "NaN", "inf": "Inf"}


def where_lines(diag: Diagnosis) -> list[tuple[str, str]]:
    """(label, value) pairs for where the origin is: shared by the text and rich renderers."""
    origin = diag.evidence.get("origin") or {}
    rows: list[tuple[str, str]] = []
    if diag.module is not None:
        mtype = origin.get("module_type")
        rows.append(("module", f"{diag.module or '<root>'}" + (f" ({mtype})" if mtype else "")))
    if diag.op:
        rows.append(("op", diag.op))
    if origin.get("node"):
        fwd = origin.get("forward_op")
        rows.append(("autograd", origin["node"] + (f" (backward of {fwd})" if fwd else "")))
    if origin.get("path"):
        rows.append(("input", origin["path"]))
    if diag.source:
        rows.append(("your code", diag.source))
    rows.append(("phase", diag.phase))
    if diag.rank is not None:
        ranks = ", ".join(str(r) for r in diag.ranks) if len(diag.ranks) > 1 else str(diag.rank)
        rows.append(("rank", ranks))
    if diag.step is not None:
        rows.append(("step", str(diag.step)))
    return rows


def explain(diag: Diagnosis) -> str:
    """What was created, where, why, and what to try, in a few lines."""
    lines = [f"nanguard: {_CREATED.get(diag.kind, diag.kind)} created - {diag.cause} ({diag.meaning})"]
    width = max((len(k) for k, _ in where_lines(diag)), default=5)
    lines += [f"  {k:<{width}}  {v}" for k, v in where_lines(diag)]
    why = diag.evidence.get("why")
    if why:
        lines.append(f"  {'why':<{width}}  {why}")
    for i, fix in enumerate(diag.fixes, start=1):
        label = "try" if i == 1 else ""
        lines.append(f"  {label:<{width}}  {i}. {fix}")
    return "\n".join(lines)
