"""Stream one rank's event log: step lines into bounded aggregates, every other event checked.

Memory follows what the report shows, not the log's size: a step line leaves its step number
(8 bytes, for the count of distinct steps), a place in a thinned series for the plots (at most
about ``2 * MAX_POINTS`` records, plus every skipped or non-finite step), and counters. The
other events (trips, skips, rollbacks, spikes, overflows) are few and are kept whole. A line
that cannot be read, or whose fields the report could not use, is a warning naming file:line;
the rest of the file is read.

Speed: the step lines of a block are split on commas into columns, each checked against its key
and parsed as one text by numpy; loss, grad norm and scale are parsed only at the rows the thinned
series keeps, and elsewhere checked to be made of a number's characters, null, or "nan"/"inf".
"""

from __future__ import annotations

import json
import math
import warnings
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from math import isfinite
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from nanguard import stepline
from nanguard.events import KNOWN_KINDS, field_error, is_int, is_int_list
from nanguard.findings import Diagnosis, jsonable
from nanguard.text import diagnosis_text, op_path, summary

__all__ = ["MAX_LINE_BYTES", "MAX_POINTS", "MAX_STEP", "Span", "StepRecord", "StepSeries", "read_rank_log", "run_spans"]

MAX_POINTS = 10_000
MAX_LINE_BYTES = 16 * 2**20
MAX_STEP = 2**62  # step numbers are kept as int64
_MAX_NOTES = 200  # per file: a log of garbage should not become a flood of warnings

_BLOCK_BYTES = 2**20  # a block's split into cells stays small (and in cache)
# Step lines exactly as EventLog writes them are read by columns (``stepline.split_run``). A run of lines
# that is not goes through ``stepline.LINE``, one match per line, and the others take the slow, checked path.


@dataclass
class StepRecord:
    """One ``step`` event: ``loss``/``grad_norm`` are None when not logged, NaN/Inf when non-finite."""

    step: int
    loss: float | None
    grad_norm: float | None
    skipped: bool
    scale: float | None = None

    @property
    def nonfinite(self) -> int:
        """How many of loss and grad norm are logged and non-finite."""
        return sum(1 for v in (self.loss, self.grad_norm) if v is not None and not math.isfinite(v))


_Row = tuple[int, "float | None", "float | None", bool, "float | None"]


@dataclass
class StepSeries:
    """One rank's step lines, folded as they stream by.

    ``points`` is the thinned series (sorted by ``finish()``): every ``stride``-th line, the
    first and the latest step, and every skipped or non-finite one. ``numbers`` holds every
    logged step number; ``nonfinite`` maps a step to its count of non-finite metrics.

    Example:
        >>> series = StepSeries()
        >>> series.add(1, 2.0, 0.5, False, None)
        >>> series.count, series.last_applied.loss
        (1, 2.0)
    """

    numbers: array[int] = field(default_factory=lambda: array("q"))
    points: list[StepRecord] = field(default_factory=list)
    nonfinite: dict[int, int] = field(default_factory=dict)
    skipped: set[int] = field(default_factory=set)
    stride: int = 1
    ordered: bool = True
    """Every step number is larger than the one before: the numbers are already sorted and distinct."""
    _applied: _Row | None = None
    _latest: _Row | None = None

    @property
    def count(self) -> int:
        return len(self.numbers)

    @property
    def last_applied(self) -> StepRecord | None:
        """The record of the highest step whose update was applied (not skipped)."""
        return StepRecord(*self._applied) if self._applied is not None else None

    @property
    def latest(self) -> StepRecord | None:
        """The record of the highest step logged."""
        return StepRecord(*self._latest) if self._latest is not None else None

    def add(self, step: int, loss: float | None, grad_norm: float | None, skipped: bool, scale: float | None) -> None:
        index = len(self.numbers)
        if index and step <= self.numbers[-1]:
            self.ordered = False
        self.numbers.append(step)
        row = (step, loss, grad_norm, skipped, scale)
        bad = (loss is not None and not isfinite(loss)) + (grad_norm is not None and not isfinite(grad_norm))
        if bad:
            self.nonfinite[step] = bad
        if skipped:
            self.skipped.add(step)
        elif self._applied is None or step >= self._applied[0]:
            self._applied = row
        if self._latest is None or step >= self._latest[0]:
            self._latest = row
        if bad or skipped or index % self.stride == 0:
            self.points.append(StepRecord(*row))
            if len(self.points) > 2 * MAX_POINTS:
                self._thin()

    def add_many(self, steps: np.ndarray, loss: Column, grad_norm: Column, skipped: np.ndarray, scale: Column) -> bool:
        """``add`` for a block of lines at once: int64 steps, bool skipped, and float columns read only at
        the rows the series keeps. False, and nothing added, when a value there is not a number."""
        n = len(steps)
        base = len(self.numbers)
        bad = loss.bad.astype(np.int64) + grad_norm.bad
        stride = self._stride_for(base + n)
        keep = np.flatnonzero((bad > 0) | skipped | ((base + np.arange(n)) % stride == 0))
        best = {
            attr: _last_highest(steps, rows)
            for attr, rows in (("_applied", np.flatnonzero(~skipped)), ("_latest", np.arange(n)))
        }
        block = _Kept.pick(
            steps, skipped, np.union1d(keep, [i for i in best.values() if i is not None]), (loss, grad_norm, scale)
        )
        if block is None:
            return False
        if n and ((base and steps[0] <= self.numbers[-1]) or (np.diff(steps) <= 0).any()):
            self.ordered = False
        self.numbers.frombytes(steps.astype(np.int64).tobytes())
        for i in np.flatnonzero(bad).tolist():
            self.nonfinite[int(steps[i])] = int(bad[i])
        self.skipped.update(steps[skipped].tolist())
        self._keep_highest(best, block)
        while self.stride < stride:
            self._thin()
        self.points.extend(StepRecord(*block.record(at)) for at in np.searchsorted(block.rows, keep).tolist())
        while len(self.points) > 2 * MAX_POINTS:
            self._thin()
        return True

    def _stride_for(self, count: int) -> int:
        """The stride that keeps ``count`` lines' series within ``MAX_POINTS`` (never below today's)."""
        stride = self.stride
        while stride * MAX_POINTS < count:
            stride *= 2
        return stride

    def _keep_highest(self, best: dict[str, int | None], block: _Kept) -> None:
        """``_applied`` and ``_latest`` from the block's rows ``best`` names, where their step is not lower."""
        for attr, i in best.items():
            current = getattr(self, attr)
            if i is not None and (current is None or block.steps[i] >= current[0]):
                setattr(self, attr, block.record(int(np.searchsorted(block.rows, i))))

    def finish(self) -> None:
        """Sort the thinned series and make sure it holds the latest step."""
        latest = self._latest
        if latest is not None and not any(p.step == latest[0] for p in self.points[-8:]):
            self.points.append(StepRecord(*latest))
        self.points.sort(key=lambda p: p.step)

    def _thin(self) -> None:
        self.stride *= 2
        kept: list[StepRecord] = []
        plain = 0
        for point in self.points:
            if point.skipped or point.step in self.nonfinite:
                kept.append(point)
                continue
            if plain % 2 == 0:
                kept.append(point)
            plain += 1
        self.points = kept


def _last_highest(steps: np.ndarray, rows: np.ndarray) -> int | None:
    """The row of ``rows`` with the highest step, the last such row on ties."""
    if not rows.size:
        return None
    return int(rows[len(rows) - 1 - int(np.argmax(steps[rows][::-1]))])


@dataclass
class _Kept:
    """The rows of a block of step lines that a series keeps, their float columns parsed."""

    steps: np.ndarray
    skipped: np.ndarray
    rows: np.ndarray
    columns: list[tuple[list[Any], list[Any]]]

    @classmethod
    def pick(
        cls, steps: np.ndarray, skipped: np.ndarray, rows: np.ndarray, columns: tuple[Column, ...]
    ) -> _Kept | None:
        """The columns' (values, is_null) at ``rows``; None when a value there is not a number."""
        picked = [column.pick(rows) for column in columns]
        parsed = [(p[0].tolist(), p[1].tolist()) for p in picked if p is not None]
        return cls(steps, skipped, rows, parsed) if len(parsed) == len(picked) else None

    def record(self, at: int) -> _Row:
        """The ``at``-th kept row as a series row: step, loss, grad norm, skipped, scale."""
        i = int(self.rows[at])
        values = [None if null[at] else float(vals[at]) for vals, null in self.columns]
        return int(self.steps[i]), values[0], values[1], bool(self.skipped[i]), values[2]


@dataclass
class Parsed:
    """A float column of a block of step lines, every value parsed."""

    values: np.ndarray
    null: np.ndarray

    @property
    def bad(self) -> np.ndarray:
        """Where a value is logged and non-finite."""
        return ~self.null & ~np.isfinite(self.values)

    def pick(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.values[rows], self.null[rows]


@dataclass
class Cells:
    """A float column of a block of step lines kept as its raw ``key`` + value cells.

    Where a value is null or non-finite is known from the text ("nan", "inf" and "-inf" are
    strings); the numbers themselves are parsed only at the rows the series keeps, and every
    other cell is checked to hold only the characters of a number.
    """

    cells: list[bytes]
    key: bytes
    null: np.ndarray
    bad: np.ndarray

    def pick(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(values, is_null) at ``rows``; None when one of them is not a number."""
        return _values([self.cells[i] for i in rows.tolist()], self.key, len(rows))


Column = Parsed | Cells


@dataclass
class RankEvents:
    """What ``read_rank_log`` found in one file."""

    steps: StepSeries = field(default_factory=StepSeries)
    events: list[dict[str, Any]] = field(default_factory=list)
    count: int = 0
    starts: int = 0
    world_size: int | None = None
    end: dict[str, Any] | None = None


@dataclass(frozen=True)
class Span:
    """One run's lines in one rank's log: bytes ``begin`` to ``end`` (None: the end of the file), the
    first of them line ``lineno``, ``lines`` of them; ``run`` its id, None for a log written before run ids."""

    run: str | None
    begin: int
    end: int | None
    lineno: int
    lines: int


_START = b'{"kind":"start"'


def run_spans(path: Path) -> list[Span]:
    """The runs in one rank's log, in the order they were appended: each begins at its ``start`` line.

    Lines before the first ``start`` belong to the first run; the runs written before run ids are one
    run (``run`` None); a ``start`` line that cannot be read starts no run. An unreadable file has none.

    Example:
        >>> [s.run for s in run_spans(Path("runs/exp1/events-rank0.jsonl"))]
        ['20261202-101500-3f2a', '20261202-143501-9f3a']
    """
    try:
        handle = path.open("rb")
    except OSError:
        return []
    with handle:
        starts, lines = _start_lines(handle)
    spans: list[tuple[str | None, int, int]] = []
    for run, begin, first in starts:
        if spans and spans[-1][0] is None and run is None:
            continue  # the runs before run ids: one run
        spans.append((run, begin, first) if spans else (run, 0, 1))
    if not spans and lines:
        spans.append((None, 0, 1))
    bounds = [*(begin for _, begin, _ in spans[1:]), None]
    lasts = [*(first - 1 for _, _, first in spans[1:]), lines]
    return [
        Span(run, begin, end, first, last - first + 1)
        for (run, begin, first), end, last in zip(spans, bounds, lasts, strict=True)
    ]


def _start_lines(handle: BinaryIO) -> tuple[list[tuple[str | None, int, int]], int]:
    """Every readable ``start`` line of a log as (run, byte offset, line number), and the log's line count."""
    starts: list[tuple[str | None, int, int]] = []
    offset, lines, carry = 0, 0, b""
    while chunk := handle.read(_BLOCK_BYTES):
        data = carry + chunk
        cut = data.rfind(b"\n") + 1
        block, carry = data[:cut], data[cut:]
        for at, run in _starts_in(block):
            starts.append((run, offset + at, lines + 1 + block.count(b"\n", 0, at)))
        offset += len(block)
        lines += block.count(b"\n")
    return starts, lines + (1 if carry else 0)


def _starts_in(block: bytes) -> Iterator[tuple[int, str | None]]:
    """(byte offset, run id) of each readable ``start`` line in a block of whole lines."""
    at = 0 if block.startswith(_START) else block.find(b"\n" + _START) + 1
    while at > 0 or (at == 0 and block.startswith(_START)):
        end = block.index(b"\n", at)
        read = _run_of(block[at:end])
        if read is not None:
            yield at, read[0]
        at = block.find(b"\n" + _START, end) + 1
        if at == 0:
            break


def _run_of(line: bytes) -> tuple[str | None] | None:
    """(the run id of a ``start`` line,), the id None when written before run ids; None when it cannot be read."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    if not isinstance(event, dict):
        return None
    run = event.get("run")
    return (run if isinstance(run, str) else None,)


class _Bounded:
    """Reads ``handle`` from where it stands up to byte ``end`` (None: to its end)."""

    def __init__(self, handle: BinaryIO, end: int | None) -> None:
        self.handle, self.left = handle, None if end is None else end - handle.tell()

    def read(self, n: int) -> bytes:
        if self.left is None:
            return self.handle.read(n)
        data = self.handle.read(min(n, self.left))
        self.left -= len(data)
        return data


def read_rank_log(path: Path, rank: int, notes: list[str], spans: list[Span] | None = None) -> RankEvents:
    """Read ``rank``'s ``events-rank{R}.jsonl`` (only ``spans``, one run's, when given); each bad line
    adds a note ``path:line: why``.

    A file that cannot be opened adds one note and reads as empty. Every kept non-step event
    gets ``_line`` (its line number) and, for a trip, ``_diagnosis`` (a checked ``Diagnosis`` or None).

    Example:
        >>> notes = []
        >>> found = read_rank_log(Path("runs/exp1/events-rank0.jsonl"), 0, notes)
        >>> found.steps.count, [e["kind"] for e in found.events]
        (200, ['trip', 'skip'])
    """
    found = RankEvents()
    bad = 0

    def note(lineno: int, why: str) -> None:
        nonlocal bad
        bad += 1
        if bad <= _MAX_NOTES:
            notes.append(f"{path}:{lineno}: {why}")

    try:
        handle = path.open("rb")
    except OSError as err:
        notes.append(f"{path}: cannot open event log ({err.strerror or err})")
        return found
    tail: dict[str, int] = {}  # the line the file ends in without a newline, and its length
    with handle:
        for span in spans if spans is not None else [Span(None, 0, None, 1, 0)]:
            handle.seek(span.begin)
            reader: Any = _Bounded(handle, span.end)
            blocks = _blocks(reader, lambda lineno: note(lineno, "skipping a line over 16 MB"), tail, span.lineno)
            for first, block in blocks:
                for lineno, raw in _fold_block(block, first, rank, found):
                    why = _read_other(raw, lineno, found)
                    if why is not None:
                        note(lineno, _cut_short(why) if lineno == tail.get("lineno") else why)
    if bad > _MAX_NOTES:
        notes.append(f"{path}: {bad - _MAX_NOTES} more unreadable lines not listed")
    found.steps.finish()
    return found


def _cut_short(why: str) -> str:
    return (
        "the log's last line is cut short (no newline: the run was killed while writing it?), so that event "
        f"is left out; a trip's bundle still shows it ({why})"
    )


def _blocks(
    handle: BinaryIO, too_long: Callable[[int], None], tail: dict[str, int] | None = None, lineno: int = 1
) -> Iterator[tuple[int, bytes]]:
    """(number of its first line, whole lines ending in a newline) for the file, a block at a time, the
    first line numbered ``lineno``. A last line without its newline is yielded too, and its number put
    in ``tail["lineno"]``."""
    carry = b""
    while chunk := handle.read(_BLOCK_BYTES):
        data = carry + chunk
        cut = data.rfind(b"\n") + 1
        block, carry = data[:cut], data[cut:]
        if block:
            yield lineno, block
            lineno += block.count(b"\n")
        if len(carry) > MAX_LINE_BYTES:
            too_long(lineno)
            carry = _rest_after_newline(handle)
            lineno += 1
    if carry:
        if tail is not None:
            tail["lineno"] = lineno
        yield lineno, carry + b"\n"


def _rest_after_newline(handle: BinaryIO) -> bytes:
    while chunk := handle.read(_BLOCK_BYTES):
        newline = chunk.find(b"\n")
        if newline >= 0:
            return chunk[newline + 1 :]
    return b""


def _fold_block(block: bytes, first: int, rank: int, found: RankEvents) -> Iterator[tuple[int, bytes]]:
    """Fold a block's step lines into ``found`` in bulk; yield (line number, line) for the others."""
    runs: list[tuple[int, bytes]] = []
    start, lineno = 0, first
    others = [0] if not block.startswith(stepline.PREFIX) else []
    others += [m.end() for m in stepline.NOT_STEP.finditer(block) if m.end() < len(block)]
    for begin in others:
        run = block[start:begin]
        runs.append((lineno, run))
        lineno += run.count(b"\n")
        start = block.index(b"\n", begin) + 1
        line = block[begin:start]
        if line.strip():
            yield lineno, line
        lineno += 1
    runs.append((lineno, block[start:]))
    whole = b"".join(run for _, run in runs) if len(runs) > 1 else runs[0][1]
    if _fold_table(whole, rank, found):
        return
    for lineno, run in runs:
        yield from _fold_run(run, lineno, rank, found)


def _fold_run(run: bytes, first: int, rank: int, found: RankEvents) -> Iterator[tuple[int, bytes]]:
    """Lines that all start like a step line: parsed in one go when they are exactly what EventLog
    writes, else matched line by line; yields the lines that are not step lines after all."""
    if _fold_table(run, rank, found):
        return
    lines = run.count(b"\n")
    rows = stepline.LINE.findall(run)[:lines]
    if not rows:
        return
    steps_c, loss_c, grad_c, skipped_c, scale_c, other_c = zip(*rows, strict=True)
    numbers = np.array(steps_c)
    is_step = numbers != b""
    for i in np.flatnonzero(~is_step).tolist():
        yield first + i, other_c[i]
    if not is_step.any():
        return
    pick = np.flatnonzero(is_step)

    def column(values: tuple[bytes, ...]) -> np.ndarray:
        return np.array(values)[pick]

    try:
        loss, grad, scale = [Parsed(*_floats(column(c))) for c in (loss_c, grad_c, scale_c)]
    except ValueError:  # a value that is not a number: read these lines one by one, with warnings
        texts = run.split(b"\n")
        for i in pick.tolist():
            yield first + i, texts[i]
        return
    steps = column(steps_c).astype(np.int64)
    found.count += len(steps)
    found.steps.add_many(steps, loss, grad, column(skipped_c) == b"true", scale)


def _fold_table(run: bytes, rank: int, found: RankEvents) -> bool:
    """Fold ``run`` (lines that start like step lines) in one go; False when it must be read line by line."""
    lines = run.count(b"\n")
    if not lines:
        return True
    columns = _parse_run(run, lines, rank)
    if columns is None or not found.steps.add_many(*columns):
        return False
    found.count += lines
    return True


_STEP, _LOSS, _GRAD_NORM, _SKIPPED, _SCALE = (
    stepline.cell(k) for k in ("step", "loss", "grad_norm", "skipped", "scale")
)
_NUMBER_CHARS = b"0123456789.eE+-,"
_NON_FINITE = (b'"nan"', b'"inf"', b'"-inf"')


def _parse_run(run: bytes, lines: int, rank: int) -> tuple[np.ndarray, Column, Column, np.ndarray, Column] | None:
    """Steps, loss, grad_norm, skipped and scale of ``run`` when every line is a step line of ``rank`` exactly
    as EventLog writes it (these keys in this order, nothing else); else None.

    A step line has six commas, so the run split on commas lays its fields out in columns: each
    column is checked against its key as one text, not line by line.
    """
    columns = stepline.split_run(run, lines, rank)
    if columns is None:
        return None
    scale: Column | None
    if columns.scale is None:  # no GradScaler
        scale = Parsed(np.full(lines, math.nan), np.ones(lines, dtype=bool))
    else:
        scale = _cells(columns.scale, _SCALE, lines)
    text = _column(columns.step, _STEP, lines)
    steps = _numbers(text, lines, np.int64) if text is not None else None
    loss = _cells(columns.loss, _LOSS, lines)
    grad_norm = _cells(columns.grad_norm, _GRAD_NORM, lines)
    skipped = _flags(columns.skipped, lines)
    if steps is None or loss is None or grad_norm is None or skipped is None or scale is None:
        return None
    in_range = (steps >= 0).all() and (steps < MAX_STEP).all()  # numpy clamps what int64 cannot hold
    return (steps, loss, grad_norm, skipped, scale) if in_range else None


def _column(cells: list[bytes], key: bytes, lines: int) -> bytes | None:
    """The cells' values as one comma-separated text, if each of the ``lines`` cells has ``key``."""
    text = b"".join(cells)
    return text.replace(key, b",")[1:] if text.count(key) == lines else None


def _cells(cells: list[bytes], key: bytes, lines: int) -> Cells | None:
    """The column, if each cell holds ``key`` and a number, null, or "nan", "inf" or "-inf"."""
    text = _column(cells, key, lines)
    if text is None or b",," in text or text.startswith(b",") or text.endswith(b","):
        return None
    null = bad = np.zeros(lines, dtype=bool)
    if b'"' in text or b"null" in text:
        words = {word: n for word in (b"null", *_NON_FINITE) if (n := text.count(word))}
        found = {word: _where(cells, key + word, n, lines) for word, n in words.items()}
        masks = {word: mask for word, mask in found.items() if mask is not None}
        if len(masks) < len(found):  # a cell that holds one of these words and more
            return None
        null = masks.pop(b"null", null)
        bad = np.logical_or.reduce([bad, *masks.values()])
        for word in words:
            text = text.replace(word, b"")
    if text.translate(None, _NUMBER_CHARS):  # anything else: the line-by-line path names the line
        return None
    return Cells(cells, key, null, bad)


def _where(cells: list[bytes], cell: bytes, count: int, lines: int) -> np.ndarray | None:
    """Where ``cells`` equal ``cell``, which the text holds ``count`` times; None if one of those is not a
    whole cell. Found by ``list.index``: a scan in C, as these cells are few."""
    found = np.zeros(lines, dtype=bool)
    at = -1
    try:
        for _ in range(count):
            at = cells.index(cell, at + 1)
            found[at] = True
    except ValueError:
        return None
    return found


def _values(cells: list[bytes], key: bytes, lines: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(values, is_null) of cells holding ``key`` and a JSON number, null, or "nan", "inf" or "-inf"."""
    text = _column(cells, key, lines)
    if text is None:
        return None
    if b'"' in text:
        if text.count(b'"') != 2 * sum(text.count(word) for word in _NON_FINITE):
            return None
        text = text.translate(None, b'"')
    null = np.zeros(lines, dtype=bool)
    if b"null" in text:
        null = np.array(text.split(b",")) == b"null"
        text = text.replace(b"null", b"nan")
    values = _numbers(text, lines, np.float64)
    return None if values is None else (values, null)


def _numbers(text: bytes, lines: int, dtype: type) -> np.ndarray | None:
    """``lines`` comma-separated numbers parsed by numpy; None when the text holds anything else."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # numpy < 2 warns and stops at text it cannot read
        try:
            values: np.ndarray = np.fromstring(text, dtype=dtype, sep=",")
        except ValueError:
            return None
    return values if values.size == lines else None


def _flags(cells: list[bytes], lines: int) -> np.ndarray | None:
    """The ``skipped`` cells as bools; None unless each says true or false."""
    text = b"".join(cells)
    yes, no = _SKIPPED + b"true", _SKIPPED + b"false"
    true, false = text.count(yes), text.count(no)
    if true + false != lines or len(text) != len(yes) * true + len(no) * false:
        return None
    return _where(cells, yes, true, lines)


def _floats(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values, is_null) of a column of JSON numbers, ``null`` and quoted ``"nan"``/``"inf"``/``"-inf"``."""
    missing = raw == b"null"
    raw[missing] = b"nan"
    for quoted in (b'"nan"', b'"inf"', b'"-inf"'):
        raw[raw == quoted] = quoted[1:-1]
    return raw.astype(np.float64), missing


def _read_other(raw: bytes, lineno: int, found: RankEvents) -> str | None:
    """Fold one line that is not a plain step line into ``found``; the reason it was skipped, or None."""
    try:
        event = json.loads(raw)
    except (ValueError, RecursionError) as err:  # JSONDecodeError, bad UTF-8, a 5000-digit number, deep nesting
        return f"skipping unreadable event line ({_short(err)})"
    if not isinstance(event, dict):
        return f"skipping event line: a JSON {type(event).__name__}, not an object"
    kind = event.get("kind")
    if not isinstance(kind, str) or kind not in KNOWN_KINDS:
        return f"ignoring unknown event kind {_short(kind)}"
    step = event.get("step")
    if not is_int(step) or not 0 <= step < MAX_STEP:
        return f"skipping {kind} event: 'step' must be an int in [0, 2**62), got {_short(step)}"
    why = _check(kind, event)
    if why is not None:
        return f"skipping {kind} event at step {step}: {why}"
    found.count += 1
    if kind == "step":
        found.steps.add(
            step,
            _number(event.get("loss")),
            _number(event.get("grad_norm")),
            bool(event.get("skipped")),
            _number(event.get("scale")),
        )
    elif kind == "start":
        found.starts += 1
        if event.get("world_size") is not None:
            found.world_size = event["world_size"]
    elif kind == "end":
        found.end = event
    else:
        event["_line"] = lineno
        if kind == "trip":
            event["_diagnosis"], why = _diagnosis(event.get("diagnosis"))
            if why is not None:
                found.events.append(event)
                return f"trip at step {step}: diagnosis could not be read ({why}); the trip is kept without it"
        found.events.append(event)
    return None


def _check(kind: str, event: dict[str, Any]) -> str | None:
    wrong = field_error(kind, event)  # the schema's owner: nanguard.events
    if wrong is not None:
        name, what = wrong
        return f"{name!r} must be {what}, got {_short(event[name])}"
    if kind != "step":
        try:
            json.dumps(jsonable(event), allow_nan=False)  # the --json report must be able to write it back
        except (ValueError, TypeError, RecursionError) as err:
            return f"fields cannot be written back as JSON ({_short(err)})"
    return None


_DIAGNOSIS_FIELDS: tuple[tuple[str, Any, str], ...] = (
    ("cause", lambda v: isinstance(v, str), "a string"),
    ("kind", lambda v: isinstance(v, str), "a string"),
    ("phase", lambda v: isinstance(v, str), "a string"),
    ("op", lambda v: v is None or isinstance(v, str), "a string"),
    ("module", lambda v: v is None or isinstance(v, str), "a string"),
    ("rank", lambda v: v is None or is_int(v), "an int"),
    ("ranks", is_int_list, "a list of ints"),
    ("step", lambda v: v is None or is_int(v), "an int"),
    ("source", lambda v: v is None or isinstance(v, str), "a string"),
    ("evidence", lambda v: isinstance(v, dict), "an object"),
    ("fixes", lambda v: isinstance(v, list) and all(isinstance(f, str) for f in v), "a list of strings"),
)


def _diagnosis(data: Any) -> tuple[Diagnosis | None, str | None]:
    """The trip's diagnosis, checked by rendering it once the ways the report will; else (None, why)."""
    if data is None:
        return None, None
    for name, ok, what in _DIAGNOSIS_FIELDS:
        if name in data and not ok(data[name]):
            return None, f"{name!r} must be {what}, got {_short(data[name])}"
    try:
        diag = Diagnosis.from_dict(data)
        diagnosis_text(diag)
        summary(diag)
        op_path(diag)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError) as err:
        return None, _short(err)
    return diag, None


def _number(value: Any) -> float | None:
    if value is None:
        return None
    return float(value)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value) if not isinstance(value, BaseException) else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
