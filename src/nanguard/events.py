"""Per-rank JSONL event log: ``run_dir/events-rank{R}.jsonl``.

Each line is one JSON object with at least ``kind``, ``step`` and ``rank``. Kinds:

- ``start``: the guard's config and world size.
- ``step``: one compact line per logged step: ``loss``, ``grad_norm``, ``skipped`` and
  ``scale`` (``null`` without a GradScaler). Keys are short so a step costs a few dozen bytes.
- ``trip``: a non-finite step: ``action`` ("skip" | "rollback" | "raise"), ``ranks`` (the
  ranks whose own values were non-finite) and ``diagnosis`` (``Diagnosis.to_dict()``).
- ``skip``, ``rollback``: the recovery taken, with ``reason`` and, for rollbacks,
  ``restored_step`` (the step the restored snapshot was taken at), ``skip_batches`` and ``why``
  (why that snapshot: the last one, or the last before the run began to grow).
- ``spike``: a loss or grad-norm spike: ``metric``, ``value``, ``median``, ``score``; or the
  divergence warning: ``metric``, ``value``, ``growth`` and ``predicted_overflow_in``.
- ``overflow``: a GradScaler overflow step it skipped on purpose (normal, not a trip).
- ``drill``: a fault planted by ``NANGUARD_INJECT`` at this step (``nanguard.inject``), written by
  every rank: ``fault`` (its spec), ``fault_kind``, ``fault_rank`` (where it was planted), ``planted_here``,
  this rank's ``action``, ``detected`` (null for a stall: nothing to detect, the step must
  only finish), the diagnosed ``cause`` ("spike" for a spike) and ``seconds`` from planting to
  the decision.

Every line is flushed as it is written, so a crash loses at most the line in flight.
Non-finite floats are written as the strings ``"nan"``, ``"inf"`` and ``"-inf"``.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from nanguard.errors import EventLogError
from nanguard.findings import jsonable

__all__ = ["KNOWN_KINDS", "EventLog", "event_path", "read_events"]

KNOWN_KINDS = frozenset(
    {"start", "step", "trip", "skip", "rollback", "spike", "overflow", "end", "remedy", "headroom", "drill"}
)


def event_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / f"events-rank{rank}.jsonl"


class EventLog:
    """Append-only JSONL writer for one rank; it never raises.

    A full or unwritable disk (or a field that cannot be written) costs the log, not the
    run: the first failure warns once and the log stops.

    Example:
        >>> log = EventLog("runs/a", rank=0)
        >>> log.write("step", 3, loss=2.1, grad_norm=0.5)
    """

    def __init__(self, run_dir: str | Path, rank: int = 0) -> None:
        self.rank = rank
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
        record = {"kind": kind, "step": step, "rank": self.rank, **fields}
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
