"""Where this rank runs, and its side of the run's hardware tracker (``nanguard.hardware``).

Every guard diagnosis gets ``evidence["where"]`` of the rank the trip started on (host, local
rank, device, and on CUDA the device's UUID and PCI bus id) and each trip event the ``where`` of
the rank that wrote it. Each rank appends its record of each trip to ``run_dir/hardware.jsonl``
with one ``O_APPEND`` write of a whole line (never interleaved with another rank's), so the
tracker survives restarts into the same ``run_dir``; a guard reads it back when it starts and
warns, naming host and device, once ``warn_after`` trips flagged on its device did not reproduce.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from nanguard import dist
from nanguard.hardware import FAULTY, NOT_REPRODUCED, TRACKER, device_key, read_tracker

__all__ = ["Tracker", "where"]

log = logging.getLogger("nanguard")

_MAX_LINE = 4000  # below PIPE_BUF: one O_APPEND write of a line is never split by another rank's


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
        >>> tracker.trip(diag, step=120)   # appends one line; warns on the 2nd non-reproducing trip here
    """

    def __init__(self, run_dir: str | os.PathLike[str] | None, *, here: Mapping[str, Any], warn_after: int) -> None:
        self.path = Path(run_dir) / TRACKER if run_dir is not None else None
        self.here = dict(here)
        self.warn_after = warn_after
        self._everyone: list[dict[str, Any]] | None = None
        self.records = read_tracker(self.path) if self.path is not None and self.path.exists() else []
        transient = self._transient()
        if warn_after and transient >= warn_after:
            log.warning(
                "nanguard: %s had %d trips that did not reproduce in this run_dir before this start: "
                "suspect its hardware",
                _named(self.here),
                transient,
            )

    def _transient(self) -> int:
        mine = device_key(self.here)
        return sum(
            1
            for r in self.records
            if device_key(r) == mine and r.get("flagged") and not r.get("reproduced") and not r.get("injected")
        )

    def everyone(self) -> list[dict[str, Any]]:
        """Every rank's ``where``, by rank: gathered once, on the first trip (every rank trips together)."""
        if self._everyone is None:
            if dist.is_distributed():
                payload = json.dumps(self.here).encode()
                self._everyone = [json.loads(p) for p in dist._all_gather_bytes(payload, dist._comm_device())]
            else:
                self._everyone = [self.here]
        return self._everyone

    def trip(self, diag: Any, step: int) -> None:
        """Put where the trip started in ``diag.evidence`` and append this rank's record of it."""
        everyone = self.everyone()
        origin = diag.rank if diag.rank is not None and diag.rank < len(everyone) else None
        flagged = diag.evidence.get("flagged_ranks")
        flagged = [r for r in flagged if isinstance(r, int)] if isinstance(flagged, list) else []
        if origin is None:
            origin = flagged[0] if flagged else dist.rank()
        diag.evidence["where"] = everyone[origin]
        if len(everyone) > 1 and flagged:
            diag.evidence["flagged_where"] = {str(r): everyone[r] for r in flagged if r < len(everyone)}
        me = dist.rank()
        record = {
            **self.here,
            "time": time.time(),
            "step": step,
            "cause": diag.cause,
            "flagged": me in flagged if dist.is_distributed() else True,
            "reproduced": _reproduced(diag, me),
            "injected": bool(diag.evidence.get("injected")),
        }
        self.records.append(record)
        self._append(record)
        if diag.cause == FAULTY and diag.rank == me and not record["injected"]:
            log.warning(
                "nanguard: %s: proven faulty at step %d (a peer computed the same step finite): drain it",
                _named(self.here),
                step,
            )
        transient = self._transient()
        suspect = record["flagged"] and not record["reproduced"] and not record["injected"]
        if suspect and self.warn_after and transient >= self.warn_after:
            log.warning(
                "nanguard: %s: %d trips flagged here did not reproduce on replay (the latest at step %d): "
                "suspect the hardware; drain this node or run its diagnostics",
                _named(self.here),
                transient,
                step,
            )
            diag.evidence["suspect_device"] = {**self.here, "transient_trips": transient}

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
