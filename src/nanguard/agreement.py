"""The layouts of the small float32 vectors the ranks exchange each step, one owner for each.

Every vector starts with one code slot per rank (``world`` slots: a rank writes its own, so
every rank learns which ranks flagged), then named scalar slots. Code reads and writes a slot
as ``vec[world + Layout.NAME]``; a layout that extends another starts where it ends (``SIZE``),
so adding a slot to one shifts the layouts built on it.

- ``Agreed``: what ``dist.agree`` returns, and every decision reads: the mean loss, the global
  gradient norm.
- ``Riding``: what the guard adds to DDP's last gradient bucket (``HealthCheck.riding``): the
  summed loss and how many ranks knew theirs; ``Carried`` is that after the all-reduce, with the
  comm watch's flag for a non-finite averaged bucket.
- ``Read``: ``Agreed`` plus this rank's own values, read to the host in the step's one read.

Imports nothing from nanguard: ``dist`` and ``guard.health`` both use it.
"""

from __future__ import annotations

from typing import ClassVar

import torch

__all__ = ["Agreed", "Carried", "Layout", "Read", "Riding"]


class Layout:
    """Named slots after ``world`` code slots; subclasses set one int offset per name and ``SIZE``.

    Example:
        >>> vec = Agreed.zeros(world=4, device=torch.device("cpu"))
        >>> vec[4 + Agreed.GRAD_NORM] = 2.5
        >>> Agreed.decode(vec.tolist(), world=4)
        {'codes': [0.0, 0.0, 0.0, 0.0], 'loss': 0.0, 'grad_norm': 2.5}
    """

    SIZE: ClassVar[int] = 0
    NAMES: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def size(cls, world: int) -> int:
        return world + cls.SIZE

    @classmethod
    def zeros(cls, world: int, device: torch.device | None) -> torch.Tensor:
        return torch.zeros(world + cls.SIZE, dtype=torch.float32, device=device)

    @classmethod
    def decode(cls, values: list[float], world: int) -> dict[str, float | list[float]]:
        """The named slots of ``values`` (a vector read to the host), for errors and tests."""
        if len(values) != world + cls.SIZE:
            raise ValueError(
                f"a {cls.__name__} vector of world {world} has {world + cls.SIZE} slots, got {len(values)}"
            )
        out: dict[str, float | list[float]] = {"codes": list(values[:world])}
        out.update({name: values[world + getattr(cls, name.upper())] for name in cls.NAMES})
        return out


class Agreed(Layout):
    """``[code x world, mean loss, global grad norm]``."""

    LOSS = 0
    GRAD_NORM = 1
    SIZE = 2
    NAMES = ("loss", "grad_norm")


class Read(Layout):
    """``Agreed``, then this rank's scale, own loss and own grad norm: the step's one host read."""

    LOSS = Agreed.LOSS
    GRAD_NORM = Agreed.GRAD_NORM
    SCALE = Agreed.SIZE
    OWN_LOSS = Agreed.SIZE + 1
    OWN_GRAD_NORM = Agreed.SIZE + 2
    SIZE = Agreed.SIZE + 3
    NAMES = ("loss", "grad_norm", "scale", "own_loss", "own_grad_norm")


class Riding(Layout):
    """``[one-hot code x world, loss, 1 if the loss was known]``: each rank's part of the extras
    that ride in the gradient all-reduce (summed over ranks by it)."""

    LOSS_SUM = 0
    LOSS_KNOWN = 1
    SIZE = 2
    NAMES = ("loss_sum", "loss_known")


class Carried(Layout):
    """``Riding`` after the all-reduce, then 1.0 when an averaged gradient bucket was non-finite."""

    LOSS_SUM = Riding.LOSS_SUM
    LOSS_KNOWN = Riding.LOSS_KNOWN
    SYNCED_BAD = Riding.SIZE
    SIZE = Riding.SIZE + 1
    NAMES = ("loss_sum", "loss_known", "synced_bad")
