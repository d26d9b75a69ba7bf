"""Counts the batch made: tensors computed from its integer/bool tensors (labels, masks, ids).

``mask.sum()`` of the labels is such a count: a division by it that is 0 is the batch's doing
(no valid target), not the code's. A count is carried through ops none of whose inputs carry a
gradient, by tensor id with a weak reference.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["BatchCounts"]


class BatchCounts:
    """The batch path each count or selection was computed from.

    Example:
        >>> counts = BatchCounts([("batch['labels']", labels)])
        >>> counts.note([labels], [valid])       # valid = labels != -100
        >>> counts.path(valid)
        "batch['labels']"
    """

    def __init__(self, sources: list[tuple[str, torch.Tensor]]) -> None:
        self.known: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {
            id(t): (weakref.ref(t), path) for path, t in sources if not (t.is_floating_point() or t.is_complex())
        }
        """The counts by id: an op none of whose inputs is here carries none (the tracer's test before ``note``)."""

    def __bool__(self) -> bool:
        return bool(self.known)

    def note(self, flat_in: Sequence[Any], flat_out: list[torch.Tensor]) -> None:
        """Carry the batch path of a count through an op whose inputs carry no gradient."""
        path = None
        known = self.known
        for x in flat_in:
            if isinstance(x, torch.Tensor):
                if x.requires_grad:
                    return
                entry = None if path else known.get(id(x))
                if entry is not None and entry[0]() is x:
                    path = entry[1]
        if path is not None:
            for o in flat_out:
                self.known[id(o)] = (weakref.ref(o), path)

    def path(self, t: torch.Tensor) -> str | None:
        """The batch tensor (labels, a mask) that ``t`` was counted or selected from, if any."""
        entry = self.known.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None
