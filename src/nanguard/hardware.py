"""The run-level hardware tracker's records: which host and device each trip ran on, counted per device.

At scale most trips that do not reproduce are hardware: the user needs to know which node to
drain, across restarts. Every guard diagnosis carries ``evidence["where"]`` (host, local rank,
device, and on CUDA the device's UUID and PCI bus id) of the rank it started on, and every
trip event the ``where`` of the rank that wrote it.

``run_dir/hardware.jsonl`` is the tracker: one line per trip and rank, appended by every rank
with one ``O_APPEND`` write (whole lines, never interleaved), so it survives restarts into the
same ``run_dir``; a guard reads it back when it starts. A device whose flagged trips did not
reproduce ``warn_after`` times (``GuardConfig.hardware_warn_after``, default 2) is named in a
warning. Injected trips (``nanguard.inject``) are counted apart and never warned about. A device proven
faulty (``hardware.faulty_device``: a peer re-computed its step finite) is counted as ``faulty`` and
ranked first, and its guard warns at once.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["FAULTY", "NOT_REPRODUCED", "TRACKER", "device_key", "device_rows", "read_tracker"]

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


def device_rows(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Trips per host and device, most transient first: the table ``nanguard report`` shows.

    Example:
        >>> device_rows(read_tracker("runs/job7/hardware.jsonl"))[0]
        {'host': 'node7', 'device': 'cuda:3', 'id': 'GPU-8f..', 'trips': 3, 'transient': 2, 'reproduced': 1, ...}
    """
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
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
