"""Quarantined samples: ``run_dir/quarantine.json`` and a sampler that never yields them.

The guard (``policy="auto"``) adds the dataset indices of rows that held bad values;
``QuarantineSampler`` rereads the file at the start of every epoch, so a continuing or
resumed run never sees a quarantined sample again.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from torch.utils.data import Sampler

from nanguard._io import atomic_write_text

__all__ = ["QuarantineSampler", "add_quarantined", "read_quarantined"]

QUARANTINE_FILE = "quarantine.json"


def read_quarantined(run_dir: str | Path) -> set[int]:
    """The quarantined ids under ``run_dir``; an empty set when there is no file yet.

    Example:
        >>> read_quarantined("runs/exp1")
        {17, 4031}
    """
    path = Path(run_dir) / QUARANTINE_FILE
    if not path.is_file():
        return set()
    data = json.loads(path.read_text(encoding="utf-8"))
    return {int(i) for i in data.get("ids", [])}


def add_quarantined(run_dir: str | Path, ids: Iterable[int], *, step: int, cause: str) -> list[int]:
    """Add ``ids`` to ``run_dir/quarantine.json`` (sorted, unique, written atomically);
    returns the ids that were new.

    Example:
        >>> add_quarantined("runs/exp1", [17], step=120, cause="data.nonfinite")
        [17]
    """
    path = Path(run_dir) / QUARANTINE_FILE
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    known = {int(i) for i in data.get("ids", [])}
    new = sorted({int(i) for i in ids} - known)
    if new:
        data["ids"] = sorted(known | set(new))
        data.setdefault("added", []).append({"step": step, "cause": cause, "ids": new})
        atomic_write_text(path, json.dumps(data, indent=1) + "\n")
    return new


class QuarantineSampler(Sampler[int]):
    """Yields ``inner``'s indices minus those in ``run_dir/quarantine.json``, reread each epoch.

    Example:
        >>> sampler = ng.QuarantineSampler(torch.utils.data.RandomSampler(dataset), "runs/exp1")
        >>> loader = DataLoader(dataset, batch_size=32, sampler=sampler)
        >>> for ids, (x, y) in loader:   # a dataset that returns its index with each row
        ...     guard.step(closure, batch=(x, y), sample_ids=ids)
    """

    def __init__(self, inner: Iterable[int], run_dir: str | Path) -> None:
        if not hasattr(inner, "__iter__"):
            raise ValueError(f"inner_sampler must be an iterable of dataset indices, got {type(inner).__name__}")
        if not isinstance(run_dir, (str, Path)):
            raise ValueError(f"run_dir must be a str or Path, got {type(run_dir).__name__}")
        self.inner = inner
        self.run_dir = Path(run_dir)
        self.quarantined = read_quarantined(self.run_dir)

    def __iter__(self) -> Iterator[int]:
        self.quarantined = read_quarantined(self.run_dir)
        return (int(i) for i in self.inner if int(i) not in self.quarantined)

    def __len__(self) -> int:
        # Known exactly only for a sized sampler; the count may still shrink during an epoch.
        return max(len(self.inner) - len(self.quarantined), 0)  # type: ignore[arg-type]
