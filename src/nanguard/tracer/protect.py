"""``Backup``: parameters and buffers put back after a replay, whatever the replay wrote.

Buffers are small and copied up front: ``native_batch_norm`` updates the running stats
without declaring the write in its schema. Parameters are copied on write: cloning all of
them would double the model's memory, so the first op whose schema writes into a
protected storage (a ``weight.data.mul_``, a write through a view) saves a copy of every
protected tensor on that storage, just before it runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from nanguard.tracer.taint import storage_key

__all__ = ["Backup"]


class Backup:
    """Copies of ``now`` taken at once, of ``on_write`` when an op is about to write into them.

    Example:
        >>> backup = Backup(on_write=list(model.parameters()), now=list(model.buffers()))
        >>> backup.before(ops.info(aten.add_.Tensor).writes, (model.weight, 1.0), {})   # saved, then the op runs
        >>> backup.restore()
    """

    def __init__(self, on_write: Iterable[torch.Tensor] = (), now: Iterable[torch.Tensor] = ()) -> None:
        self.ids = {id(t): t for t in on_write}
        # Tensors sharing a storage (tied weights, FSDP's flat parameter) are saved together.
        self.by_storage: dict[int, list[torch.Tensor]] = {}
        for t in self.ids.values():
            key = storage_key(t)
            if key > 0:
                self.by_storage.setdefault(key, []).append(t)
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for t in now:
            self._save(t)

    def protects(self, t: torch.Tensor) -> bool:
        return id(t) in self.ids

    def before(self, writes: Sequence[tuple[int, str]], args: tuple, kwargs: dict) -> None:
        """Save what an op is about to write into, if it is protected and not saved yet:
        ``writes`` holds the (position, name) of the arguments its schema writes (``ops.info``)."""
        for i, name in writes:
            target = args[i] if i < len(args) else kwargs.get(name)
            if isinstance(target, torch.Tensor):
                for t in self._owners(target):
                    self._save(t)

    def _owners(self, target: torch.Tensor) -> list[torch.Tensor]:
        key = storage_key(target)
        if key > 0:
            return self.by_storage.get(key, [])
        own = self.ids.get(id(target))
        return [own] if own is not None else []

    def _save(self, t: torch.Tensor) -> None:
        if id(t) not in self.saved:
            self.saved[id(t)] = (t, t.detach().clone())

    def restore(self) -> None:
        """Put every saved tensor back; the backup is empty afterwards."""
        with torch.no_grad():
            for t, copy in self.saved.values():
                t.copy_(copy)
        self.saved.clear()
