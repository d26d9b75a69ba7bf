"""The agreement vector: the float32 values the ranks sum to agree on a guarded step, by named slot.

One layout for a world of ``W`` ranks, ``2 * W + 2`` values:

- ``codes``: one slot per rank, its ``HealthFlag`` bits (each rank writes only its own);
- ``loss``: the loss (the sum over ranks while it rides in the gradient all-reduce, then the mean);
- ``norm``: the global grad norm once agreed; while riding, the count of ranks whose loss was known;
- ``steps``: one slot per rank, ``step_slot(step)`` of its loop (0 for a rank that takes no step).

``dist.agree`` writes it, the guard's comm hook carries it (``guard.health``: in the last gradient
bucket's payload on 2 ranks; on 3 or more each rank keeps its own, summed only on a step some rank
flagged), a joined rank shadows it (``guard.join``); all of them index it through ``Layout``, so a
slot moved here moves for all. The host read appends this rank's own scale, loss and grad norm (``Layout.own_*``).

Imports nothing from nanguard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["STEP_PERIOD", "Agreed", "Layout", "step_slot"]

STEP_PERIOD = 2**24 - 1
"""Step slots hold ``step % STEP_PERIOD + 1``: exact in float32, and 0 for a rank that takes no step."""


def step_slot(step: int | None) -> float:
    """The value a rank writes into its step slot of the agreement (0.0: it takes no step, as a joined rank).

    Example:
        >>> step_slot(0), step_slot(None)
        (1.0, 0.0)
    """
    return 0.0 if step is None else float(step % STEP_PERIOD + 1)


@dataclass(frozen=True)
class Agreed:
    """The agreement read on the host, by slot."""

    codes: tuple[int, ...]
    loss: float
    norm: float
    steps: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """Where each value of the agreement of a ``world`` of ranks lies.

    Example:
        >>> layout = Layout(world=2)
        >>> vec = layout.vector(rank=1, code=4, loss=0.5, norm=9.0, step=7)
        >>> layout.read(vec.tolist())
        Agreed(codes=(0, 4), loss=0.5, norm=9.0, steps=(0, 8))
    """

    world: int

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"world must be a positive number of ranks, got {self.world}")

    @classmethod
    def for_size(cls, size: int) -> Layout:
        """The layout of an agreement of ``size`` values (``2 * world + 2``)."""
        if size < 4 or size % 2:
            raise ValueError(f"size must be 2 * world + 2 for a world of >= 1 ranks, got {size}")
        return cls((size - 2) // 2)

    @property
    def size(self) -> int:
        return 2 * self.world + 2

    @property
    def codes(self) -> slice:
        return slice(0, self.world)

    @property
    def loss(self) -> int:
        return self.world

    @property
    def norm(self) -> int:
        """The grad norm's slot; while riding, the count of ranks whose loss was known."""
        return self.world + 1

    @property
    def steps(self) -> slice:
        return slice(self.world + 2, self.size)

    def code(self, rank: int) -> int:
        return rank

    def step(self, rank: int) -> int:
        return self.world + 2 + rank

    @property
    def own_scale(self) -> int:
        """After the agreement, in the host read: this rank's own loss scale, loss, grad norm."""
        return self.size

    @property
    def own_loss(self) -> int:
        return self.size + 1

    @property
    def own_norm(self) -> int:
        return self.size + 2

    def zeros(self, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.zeros(self.size, dtype=torch.float32, device=device)

    def vector(
        self,
        *,
        rank: int,
        code: float | torch.Tensor = 0.0,
        loss: float | torch.Tensor = 0.0,
        norm: float | torch.Tensor = 0.0,
        step: int | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """This rank's part: its code and step slot, the loss and norm it adds (zeros elsewhere)."""
        vec = self.zeros(device)
        vec[self.code(rank)] = code.float() if isinstance(code, torch.Tensor) else code
        vec[self.loss] = loss.float() if isinstance(loss, torch.Tensor) else loss
        vec[self.norm] = norm.float() if isinstance(norm, torch.Tensor) else norm
        vec[self.step(rank)] = step_slot(step)
        return vec

    def read(self, values: Sequence[float]) -> Agreed:
        """The agreement (and anything appended after it) read back by slot."""
        return Agreed(
            codes=tuple(int(c) for c in values[self.codes]),
            loss=float(values[self.loss]),
            norm=float(values[self.norm]),
            steps=tuple(int(s) for s in values[self.steps]),
        )
