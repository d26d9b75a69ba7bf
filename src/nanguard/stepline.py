"""The ``step`` event line: its byte layout, its writer's field order and its fast reader's split.

A healthy run writes one step line per logged step, so the report reads millions of them; it
reads the lines exactly as ``EventLog`` writes them by columns, not as JSON. The layout:

    {"kind":"step","step":S,"rank":R,"run":"ID","loss":L,"grad_norm":G,"skipped":B,"scale":C}

(a log written before run ids has no ``run`` cell; it is read as well). ``EventLog.write`` puts
``kind``, ``step``, ``rank`` and ``run`` first and ``Recorder.step`` the rest in
``KEYS`` order (a test reads a written line back against ``KEYS``; the writer adds no call per
step for it). ``split_run`` cuts a run of such lines into one column of cells per key, and ``LINE``
matches one line in any other layout (the reader's checked path).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["KEYS", "LINE", "NOT_STEP", "PREFIX", "Columns", "cell", "split_run"]

KEYS = ("kind", "step", "rank", "run", "loss", "grad_norm", "skipped", "scale")
"""The keys of a step line, in the order they are written."""
_COMMAS = len(KEYS) - 1  # no value of a step line holds a comma (a run id neither)


def cell(key: str) -> bytes:
    """How a key's cell starts: ``b'"loss":'``."""
    return b'"%s":' % key.encode()


KIND = b'{"kind":"step"'
_RANK = cell("rank")
_RUN = cell("run")
_NULL_SCALE = cell("scale") + b"null"
"""The first cell of every step line."""
PREFIX = KIND + b"," + cell("step")
_NEXT_LINE = b"}\n" + KIND  # the last cell of one line runs into the first of the next
NOT_STEP = re.compile(rb"\n(?!" + re.escape(PREFIX) + rb")")
"""A newline that starts another kind of line."""
LINE = re.compile(
    rb"^(?:"
    + PREFIX
    + rb"(\d{1,18}),"
    + cell("rank")
    + rb"-?\d{1,9},(?:"
    + cell("run")
    + rb'"[^",]*",)?'
    + cell("loss")
    + rb"([^,]*),"
    + cell("grad_norm")
    + rb"([^,]*),"
    + cell("skipped")
    + rb"(true|false),"
    + cell("scale")
    + rb"([^,}]*)\}[ \t\r]*|(.*))$",
    re.M,
)
"""One line: a step line in this layout, any spacing after it (groups 1-5: step, loss, grad_norm,
skipped, scale), or any other line (group 6)."""


@dataclass(frozen=True)
class Columns:
    """A run of step lines cut into one list of cells per key (each cell still starts with its key)."""

    step: list[bytes]
    loss: list[bytes]
    grad_norm: list[bytes]
    skipped: list[bytes]
    scale: list[bytes] | None
    """None when every scale is null (no GradScaler), the common case, checked at once."""


def split_run(run: bytes, lines: int, rank: int) -> Columns | None:
    """The cells of ``run``, ``lines`` step lines of ``rank`` each ending in a newline, cut by
    position, when every line has the layout's commas, kind and rank; else None. Each cell still
    starts with its key: the column's parser checks it (a line in another key order fails there).

    Example:
        >>> line = b'{"kind":"step","step":3,"rank":0,"loss":2.1,"grad_norm":0.5,"skipped":false,"scale":null}\\n'
        >>> split_run(line * 2, lines=2, rank=0).loss
        [b'"loss":2.1', b'"loss":2.1']
    """
    parts = run.split(b",")
    with_run = len(parts) > 3 and parts[3].startswith(_RUN)  # a log from before run ids has no run cell
    n = _COMMAS if with_run else _COMMAS - 1
    if len(parts) != n * lines + 1 or parts[0] != KIND or b"".join(parts[2::n]) != (_RANK + b"%d" % rank) * lines:
        return None
    if with_run and b"".join(parts[3::n]) != parts[3] * lines:  # one run's lines: the same run cell
        return None
    tails = b"".join(parts[n::n])  # '"scale":S}\n{"kind":"step"' per line, the last one '"scale":S}\n'
    if not tails.endswith(b"}\n") or tails.count(_NEXT_LINE) != lines - 1:
        return None
    scale = (
        None
        if tails == (_NULL_SCALE + _NEXT_LINE) * (lines - 1) + _NULL_SCALE + b"}\n"
        else tails[:-2].split(_NEXT_LINE)
    )
    o = 3 + with_run  # where the loss cell is
    return Columns(
        step=parts[1::n], loss=parts[o::n], grad_norm=parts[o + 1 :: n], skipped=parts[o + 2 :: n], scale=scale
    )
