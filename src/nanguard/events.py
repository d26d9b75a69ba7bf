"""Per-rank JSONL event log: ``run_dir/events-rank{R}.jsonl``, and the one owner of its schema.

Each line is one JSON object with at least ``kind``, ``step`` and ``rank``, and ``run``: the id of the
run that wrote it (``new_run_id``; one id for every rank of a run), so runs that reuse a ``run_dir``
stay apart (a log written before run ids existed reads as one run). ``SCHEMA`` names each
kind's fields and what each must be; the writer (``guard/recorder.py``) writes those fields, the
report's reader (``report/stream.py``) checks them with ``field_error``, and a test holds the three
together. Kinds:

- ``start``: the guard's ``config``, ``world_size`` and ``path`` ("host" or "device").
- ``step``: one compact line per logged step: ``loss``, ``grad_norm``, ``skipped`` and
  ``scale`` (``null`` without a GradScaler). Keys are short so a step costs a few dozen bytes;
  the line's byte layout is ``nanguard.stepline``'s.
- ``trip``: a non-finite step: ``action`` ("skip" | "rollback" | "raise" | ...), ``ranks`` (the
  ranks whose own values were non-finite), ``diagnosis`` (``Diagnosis.to_dict()``), ``where``
  (where this rank runs) and ``module_stats`` (per-module statistics of the replay, when taken).
- ``skip``, ``rollback``: the recovery taken, with ``reason`` and, for rollbacks,
  ``restored_step`` (the step the restored snapshot was taken at), ``skip_batches`` and ``why``
  (why that snapshot: the last one, or the last before the run began to grow).
- ``spike``: a loss or grad-norm spike: ``metric``, ``value``, ``median``, ``score``, and ``own`` (true:
  this rank's own loss, on a step whose mean loss no collective agreed; written by that rank alone); or the
  divergence warning: ``metric``, ``value``, ``growth`` and ``predicted_overflow_in``.
- ``warning``: an early warning: ``signal`` ("loss", "grad_norm"), ``module`` (null: the whole run),
  ``value``, ``trend`` (growth per step), ``steps_left`` (to float32's overflow at that trend, or null),
  ``fix``, and for a run leaving its level, ``lr`` and ``level`` (the recent level it left).
- ``overflow``: a GradScaler overflow step it skipped on purpose (normal, not a trip): ``scale``,
  ``new_scale``, ``streak``.
- ``remedy``: a remedy applied (``policy="auto"``): ``cause``, ``action``, ``target``, ``reason``.
- ``headroom``: a low-precision module's outputs near its dtype's limit: ``module``, ``dtype``,
  ``absmax``, ``limit``, ``close``.
- ``drill``: a fault planted by ``NANGUARD_INJECT`` at this step (``nanguard.inject``), written by
  every rank: ``fault`` (its spec), ``fault_kind``, ``fault_rank`` (where it was planted), ``planted_here``,
  this rank's ``action``, ``detected`` (null for a stall: nothing to detect, the step must
  only finish), the diagnosed ``cause`` ("spike" for a spike) and ``seconds`` from planting to
  the decision.
- ``end``: the run's ``skipped`` and ``rollbacks``.

Every line is flushed as it is written, so a crash loses at most the line in flight.
Non-finite floats are written as the strings ``"nan"``, ``"inf"`` and ``"-inf"``.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, TypeGuard

from nanguard.errors import EventLogError
from nanguard.findings import jsonable

__all__ = ["KNOWN_KINDS", "SCHEMA", "EventLog", "Field", "event_path", "field_error", "new_run_id", "read_events"]


def is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A JSON number, null, or one of the strings non-finite floats are written as."""
    if value is None or is_int(value) or isinstance(value, float):
        return True
    return isinstance(value, str) and value in ("nan", "inf", "-inf")


def is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(is_int(v) for v in value)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _anything(value: Any) -> bool:
    return True


@dataclass(frozen=True)
class Field:
    """One field of an event kind: its name, and what the reader accepts (``check``, worded by ``what``)."""

    name: str
    check: Callable[[Any], bool] = _anything
    what: str = "any JSON value"


_NUMBER, _STRING = (is_number, "a number"), (_is_str, "a string")
_INT = (lambda v: v is None or is_int(v), "an int")
_OBJECT = (lambda v: v is None or isinstance(v, dict), "an object")

SCHEMA: dict[str, tuple[Field, ...]] = {
    "start": (
        Field("config"),
        Field("world_size", lambda v: v is None or (is_int(v) and 0 < v < 2**31), "a positive int"),
        Field("path"),
    ),
    "step": (
        Field("loss", *_NUMBER),
        Field("grad_norm", *_NUMBER),
        Field("skipped", lambda v: isinstance(v, bool), "true or false"),
        Field("scale", *_NUMBER),
    ),
    "trip": (
        Field("action", *_STRING),
        Field("ranks", is_int_list, "a list of ints"),
        Field("diagnosis", *_OBJECT),
        Field("where"),
        Field("module_stats", *_OBJECT),
    ),
    "skip": (Field("reason", *_STRING),),
    "rollback": (
        Field("restored_step", *_INT),
        Field("skip_batches", *_INT),
        Field("reason", *_STRING),
        Field("why"),
    ),
    "spike": (
        Field("metric", *_STRING),
        Field("value", *_NUMBER),
        Field("median", *_NUMBER),
        Field("score", *_NUMBER),
        Field("own", lambda v: isinstance(v, bool), "true or false"),
        Field("growth"),
        Field("predicted_overflow_in"),
    ),
    "warning": (
        Field("signal", *_STRING),
        Field("module", lambda v: v is None or isinstance(v, str), "a string or null"),
        Field("value", *_NUMBER),
        Field("trend", *_NUMBER),
        Field("steps_left", *_INT),
        Field("fix", *_STRING),
        Field("lr"),
        Field("level", *_NUMBER),
    ),
    "overflow": (Field("scale", *_NUMBER), Field("new_scale", *_NUMBER), Field("streak", *_INT)),
    "remedy": (
        Field("cause", *_STRING),
        Field("action", *_STRING),
        Field("target"),
        Field("reason", lambda v: v is None or isinstance(v, str), "a string"),
    ),
    "headroom": (
        Field("module", *_STRING),
        Field("dtype", *_STRING),
        Field("absmax", *_NUMBER),
        Field("limit", *_NUMBER),
        Field("close"),
    ),
    "drill": tuple(
        Field(name)
        for name in ("fault", "fault_kind", "fault_rank", "planted_here", "action", "detected", "cause", "seconds")
    ),
    "end": (Field("skipped"), Field("rollbacks")),
}
"""Each event kind and its fields besides ``kind``, ``step`` and ``rank``, in the order they are written."""
KNOWN_KINDS = frozenset(SCHEMA)


def field_error(kind: str, event: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first field of ``event`` the reader cannot take, as (its name, what it must be); None when
    all can be. Absent fields are fine."""
    for f in SCHEMA.get(kind, ()):
        if f.name in event and not f.check(event[f.name]):
            return f.name, f.what
    return None


def new_run_id() -> str:
    """A new run's id: the UTC time it started, then 4 random hex digits; ids sort by start time.

    Example:
        >>> new_run_id()
        '20261202-143501-9f3a'
    """
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(2)


def event_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / f"events-rank{rank}.jsonl"


class EventLog:
    """Append-only JSONL writer for one rank; it never raises.

    A full or unwritable disk (or a field that cannot be written) costs the log, not the
    run: the first failure warns once and the log stops.

    ``run`` (the run's id) is written into every line after ``rank``; None writes none.

    Example:
        >>> log = EventLog("runs/a", rank=0, run=new_run_id())
        >>> log.write("step", 3, loss=2.1, grad_norm=0.5)
    """

    def __init__(self, run_dir: str | Path, rank: int = 0, run: str | None = None) -> None:
        self.rank = rank
        self._head = {"rank": rank} if run is None else {"rank": rank, "run": run}
        self.path = event_path(run_dir, rank)
        self._file: TextIO | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        except OSError as err:
            self._disable(err)

    @property
    def enabled(self) -> bool:
        """False once a write failed: the rest of the run is not logged."""
        return self._file is not None

    def write(self, kind: str, step: int, **fields: Any) -> None:
        if self._file is None:
            return
        record = {"kind": kind, "step": step, **self._head, **fields}
        try:
            line = json.dumps(jsonable(record), separators=(",", ":"), allow_nan=False)
            self._file.write(line + "\n")
            self._file.flush()
        except Exception as err:  # the log must never kill training
            self._disable(err)

    def close(self) -> None:
        handle, self._file = self._file, None
        if handle is None:
            return
        try:
            handle.close()
        except OSError as err:
            self._disable(err)

    def _disable(self, err: BaseException) -> None:
        """Warn once and stop logging; a buffered line that cannot be flushed is dropped."""
        handle, self._file = self._file, None
        if handle is not None:
            with contextlib.suppress(OSError):
                handle.close()
        warnings.warn(f"nanguard: cannot write {self.path} ({err}); event log disabled", stacklevel=3)


def read_events(path: str | Path) -> Iterator[dict[str, Any]]:
    """Yield the events of one JSONL file.

    A truncated or garbage line is skipped with a warning naming the file and line; an
    unknown ``kind`` is skipped with a warning. A missing file raises ``EventLogError``.
    """
    path = Path(path)
    try:
        handle = path.open(encoding="utf-8", errors="replace")
    except OSError as err:
        raise EventLogError(path, f"cannot open event log ({err.strerror or err})") from None
    with handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                warnings.warn(f"{path}:{lineno}: skipping unreadable event line ({err.msg})", stacklevel=2)
                continue
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                warnings.warn(f"{path}:{lineno}: skipping event without an integer step", stacklevel=2)
                continue
            if record.get("kind") not in KNOWN_KINDS:
                warnings.warn(f"{path}:{lineno}: ignoring unknown event kind {record.get('kind')!r}", stacklevel=2)
                continue
            yield record
