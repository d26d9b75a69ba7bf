"""``BufferBackup``: preallocated copies of buffers, so a skipped step can leave them as they were.

A bad forward has already updated BatchNorm-style running statistics by the time a check
sees the step; restoring the copies undoes it. The guard, the framework callbacks and the
tracer's replays use this one backup.
"""

from __future__ import annotations

import torch

from nanguard import compat

__all__ = ["BufferBackup"]


class BufferBackup:
    """Copies of buffers (BatchNorm running stats), kept so a skipped step leaves them as they were.

    The copies are allocated once; ``save()`` refreshes them with one foreach copy per step.

    Example:
        >>> backup = BufferBackup(list(model.buffers()))
        >>> backup.save(); model(bad_batch); backup.restore()
    """

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers
        self.copies = [torch.empty_like(b) for b in buffers]
        self.saved = False

    def save(self) -> None:
        if self.buffers:
            with torch.no_grad():
                compat.foreach_copy_(self.copies, self.buffers)
        self.saved = True

    def restore(self) -> None:
        """Put the saved values back (nothing happens before the first ``save``)."""
        if self.buffers and self.saved:
            with torch.no_grad():
                compat.foreach_copy_(self.buffers, self.copies)
