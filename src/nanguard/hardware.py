"""The run's hardware tracker, end to end: where each rank runs, and ``run_dir/hardware.jsonl``,
which counts each trip per host and device across restarts.

At scale most trips that do not reproduce are hardware: the user needs to know which node to
drain, across restarts. Every guard diagnosis carries ``evidence["where"]`` (host, local rank,
device, and on CUDA the device's UUID and PCI bus id) of the rank it started on, and every
trip event the ``where`` of the rank that wrote it.

``run_dir/hardware.jsonl`` is the tracker: one line per trip and rank, appended by every rank
with one ``O_APPEND`` write (whole lines, never interleaved), so it survives restarts into the
same ``run_dir``; a guard reads it back when it starts. A device whose flagged trips did not
reproduce ``warn_after`` times (``GuardConfig.hardware_warn_after``, default 2) is named in a
warning. Each record carries its run's id (``run``), and each trip is counted once (one per run, step
and device); a warning and the evidence say how many of the trips are this run's and how many earlier
runs' in the same ``run_dir`` left. Injected trips (``nanguard.inject``) are counted apart and never warned
about. A device proven faulty (``hardware.faulty_device``: a peer re-computed its step finite) is counted
as ``faulty`` and ranked first, and its guard warns at once.

The guard's side is ``Tracker`` (one rank's trips, appended and counted, the warnings) and ``where``;
the report's side, offline, is ``read_tracker`` and ``device_rows``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from nanguard import dist

__all__ = ["FAULTY", "NOT_REPRODUCED", "TRACKER", "Tracker", "device_key", "device_rows", "read_tracker", "where"]

log = logging.getLogger("nanguard")

_MAX_LINE = 4000  # below PIPE_BUF: one O_APPEND write of a line is never split by another rank's

TRACKER = "hardware.jsonl"
NOT_REPRODUCED = frozenset({"distributed.transient", "step.not_reproduced"})
"""Causes that say the step's replay was finite: a transient fault, often the hardware."""
FAULTY = "hardware.faulty_device"
"""The cause of a device proven faulty: a peer computed the same step finite (``guard/proof.py``)."""


def device_key(w: Mapping[str, Any]) -> tuple[str, str]:
    """(host, device) that one physical device is counted under: its UUID, else its PCI bus id,
    else the device name (on CPU with the local rank: ranks sharing a host's CPU count apart).

    Example:
        >>> device_key({"host": "node7", "device": "cuda:3", "uuid": "GPU-8f.."})
        ('node7', 'GPU-8f..')
    """
    host = str(w.get("host"))
    for key in ("uuid", "pci_bus_id"):
        if w.get(key):
            return host, str(w[key])
    name = str(w.get("device"))
    return host, f"{name}#{w.get('local_rank')}" if name == "cpu" else name


def read_tracker(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``hardware.jsonl``; a torn or foreign line is skipped with a warning naming file:line.

    Example:
        >>> [r["cause"] for r in read_tracker("runs/job7/hardware.jsonl")]
        ['distributed.transient', 'distributed.transient']
    """
    path = Path(path)
    records = []
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        warnings.warn(f"{path}: cannot read the hardware tracker ({err.strerror or err})", stacklevel=2)
        return []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            warnings.warn(f"{path}:{lineno}: skipping unreadable tracker line", stacklevel=2)
            continue
        if not isinstance(record, dict) or not isinstance(record.get("host"), str) or "device" not in record:
            warnings.warn(f"{path}:{lineno}: skipping a tracker line without host and device", stacklevel=2)
            continue
        records.append(record)
    return records


def _trip_key(r: Mapping[str, Any]) -> tuple[Any, ...]:
    """One trip on one device: a record written twice for it (a retried step, two guards) counts once.
    A record without a step (not a guard's) is a trip of its own."""
    step = r.get("step")
    return (r.get("run"), step, *device_key(r)) if isinstance(step, int) else (id(r),)


def device_rows(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Trips per host and device, most transient first: the table ``nanguard report`` shows. A trip
    recorded twice (the same run, step and device) counts once.

    Example:
        >>> device_rows(read_tracker("runs/job7/hardware.jsonl"))[0]
        {'host': 'node7', 'device': 'cuda:3', 'id': 'GPU-8f..', 'trips': 3, 'transient': 2, 'reproduced': 1, ...}
    """
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    seen: set[tuple[Any, ...]] = set()
    for r in records:
        if _trip_key(r) in seen:
            continue
        seen.add(_trip_key(r))
        key = device_key(r)
        empty: dict[str, Any] = {
            "host": key[0],
            "device": r.get("device"),
            "id": key[1],
            "local_rank": r.get("local_rank"),
            "trips": 0,
            "transient": 0,
            "reproduced": 0,
            "faulty": 0,
            "injected": 0,
            "causes": {},
            "steps": [],
        }
        row = rows.setdefault(key, empty)
        if r.get("injected"):
            row["injected"] += 1
            continue
        if not r.get("flagged"):
            continue
        row["trips"] += 1
        row["reproduced" if r.get("reproduced") else "transient"] += 1
        row["faulty"] += 1 if r.get("cause") == FAULTY else 0
        cause = str(r.get("cause"))
        row["causes"][cause] = row["causes"].get(cause, 0) + 1
        row["steps"].append(r.get("step"))
    return sorted(
        rows.values(), key=lambda row: (-row["faulty"], -row["transient"], -row["trips"], row["host"], row["id"])
    )


# -- the guard's side: where this rank runs, its trips appended and counted -----------------
def where(device: torch.device | None = None) -> dict[str, Any]:
    """Where this rank runs: host, rank, local rank, device, and on CUDA the device's UUID and PCI bus id.

    Example:
        >>> where(torch.device("cuda", 3))
        {'host': 'node7', 'local_rank': 3, 'device': 'cuda:3', 'uuid': 'GPU-8f..', 'pci_bus_id': '0000:41..'}
    """
    device = device or torch.device("cpu")
    found: dict[str, Any] = {
        "host": socket.gethostname(),
        "rank": dist.rank(),
        "local_rank": _local_rank(),
        "device": str(device) if device.type != "cuda" else f"cuda:{device.index or 0}",
        "uuid": None,
        "pci_bus_id": None,
    }
    if device.type == "cuda":
        try:
            props = torch.cuda.get_device_properties(device.index or 0)
            uuid = getattr(props, "uuid", None)
            found["uuid"] = f"GPU-{uuid}" if uuid is not None and not str(uuid).startswith("GPU-") else uuid
            bus = getattr(props, "pci_bus_id", None)
            if bus is not None:
                domain, dev = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
                found["pci_bus_id"] = f"{domain:04x}:{bus:02x}:{dev:02x}.0"
        except Exception as err:  # the ids are evidence only: never worth failing a trip
            found["uuid_error"] = repr(err)
    return found


def _local_rank() -> int:
    value = os.environ.get("LOCAL_RANK", "")
    return int(value) if value.isdigit() else dist.rank()


class Tracker:
    """One rank's view of ``run_dir/hardware.jsonl``: appends its trips, counts them per device.

    Example:
        >>> tracker = Tracker("runs/job7", here=where(), warn_after=2)
        >>> tracker.trip(diag, step=120, injected=False)["where"]   # appends one line; warns on the 2nd
        ...                                                           # non-reproducing trip here
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None,
        *,
        here: Mapping[str, Any],
        warn_after: int,
        run: str | None = None,
    ) -> None:
        self.path = Path(run_dir) / TRACKER if run_dir is not None else None
        self.here = dict(here)
        self.warn_after = warn_after
        self.run = run
        self._everyone: list[dict[str, Any]] | None = None
        self.records = read_tracker(self.path) if self.path is not None and self.path.exists() else []
        self.earlier = len(self._transient())  # every record read back is an earlier run's
        if warn_after and self.earlier >= warn_after:
            log.warning(
                "nanguard: %s had %d trips that did not reproduce in this run_dir before this start "
                "(earlier runs' trips, none of this run's yet): suspect its hardware",
                _named(self.here),
                self.earlier,
            )

    def _transient(self) -> set[tuple[Any, ...]]:
        """This device's flagged trips that did not reproduce, each once (by run, step and device)."""
        mine = device_key(self.here)
        return {
            _trip_key(r)
            for r in self.records
            if device_key(r) == mine and r.get("flagged") and not r.get("reproduced") and not r.get("injected")
        }

    def everyone(self) -> list[dict[str, Any]]:
        """Every rank's ``where``, by rank: gathered once, on the first trip (every rank trips together)."""
        if self._everyone is None:
            if dist.is_distributed():
                payload = json.dumps(self.here).encode()
                self._everyone = [json.loads(p) for p in dist._all_gather_bytes(payload, dist._comm_device())]
            else:
                self._everyone = [self.here]
        return self._everyone

    def trip(self, diag: Any, step: int, *, injected: bool) -> dict[str, Any]:
        """Append this rank's record of a trip; returns where it started, for its evidence: ``where``,
        and ``flagged_where`` and ``suspect_device`` when known. ``injected``: a fire drill planted it."""
        everyone = self.everyone()
        flagged = _flagged(diag)
        found: dict[str, Any] = {"where": everyone[_origin(diag, flagged, len(everyone))]}
        if len(everyone) > 1 and flagged:
            found["flagged_where"] = {str(r): everyone[r] for r in flagged if r < len(everyone)}
        me = dist.rank()
        record = {
            **self.here,
            "run": self.run,
            "time": time.time(),
            "step": step,
            "cause": diag.cause,
            "flagged": me in flagged if dist.is_distributed() else True,
            "reproduced": _reproduced(diag, me),
            "injected": injected,
        }
        self.records.append(record)
        self._append(record)
        if diag.cause == FAULTY and diag.rank == me and not injected:
            log.warning(
                "nanguard: %s: proven faulty at step %d (a peer computed the same step finite): drain it",
                _named(self.here),
                step,
            )
        if record["flagged"] and not record["reproduced"] and not injected:
            found.update(self._suspect(step))
        return found

    def _suspect(self, step: int) -> dict[str, Any]:
        """``{"suspect_device": ...}``, with a warning, once this device's trips that did not reproduce
        reach ``warn_after``; empty before."""
        keys = self._transient()
        transient = len(keys)
        if not self.warn_after or transient < self.warn_after:
            return {}
        this_run = sum(1 for key in keys if key[0] == self.run)
        log.warning(
            "nanguard: %s: %d trips flagged here did not reproduce on replay (%d in this run, %d in earlier "
            "runs in this run_dir; the latest at step %d): suspect the hardware; drain this node or run its "
            "diagnostics",
            _named(self.here),
            transient,
            this_run,
            transient - this_run,
            step,
        )
        return {
            "suspect_device": {
                **self.here,
                "transient_trips": transient,
                "this_run": this_run,
                "earlier_runs": transient - this_run,
            }
        }

    def _append(self, record: Mapping[str, Any]) -> None:
        if self.path is None:
            return
        line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
        if len(line) > _MAX_LINE:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError as err:  # the tracker is evidence: a full disk must not stop training
            warnings.warn(f"nanguard: cannot append to {self.path} ({err}); trip not tracked", stacklevel=4)


def _flagged(diag: Any) -> list[int]:
    """The ranks the diagnosis says held non-finite values (``evidence["flagged_ranks"]``)."""
    flagged = diag.evidence.get("flagged_ranks")
    return [r for r in flagged if isinstance(r, int)] if isinstance(flagged, list) else []


def _origin(diag: Any, flagged: list[int], world: int) -> int:
    """The rank a trip started on: the diagnosis's, else the first flagged one, else this rank."""
    if diag.rank is not None and diag.rank < world:
        return int(diag.rank)
    return flagged[0] if flagged else dist.rank()


def _reproduced(diag: Any, rank: int) -> bool:
    """Whether this rank's own replay made the value again."""
    if diag.cause in NOT_REPRODUCED:
        return False
    if dist.is_distributed() and diag.ranks:
        return rank in diag.ranks
    return True


def _named(w: Mapping[str, Any]) -> str:
    from nanguard.text import device_words

    return device_words(w)
