"""Wild scenarios for causes no other wild scenario expects (see ``nanguard.zoo.wild``): weights
initialized far too large (``init.scale``), a backward that leaves part of a gradient allocated with
``new_empty`` unwritten (``op.uninitialized_read``), and a batch mask that emptied or corrupted a sample,
caught before the forward by ``check_batch`` (``data.fully_masked``, ``data.invalid_mask``: the
Guard's ``check_batch=True``, tested in ``tests/test_diagnosis_round4.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanguard.zoo.scenarios import Case, Expect, WildScenario
from nanguard.zoo.wild_losses import step

__all__ = ["SCENARIOS", "nan_memory"]


class DeepMLP(nn.Module):
    """Sixteen float32 linear layers whose custom init passes a gain (40) as the std."""

    def __init__(self, width: int = 64, depth: int = 16) -> None:
        super().__init__()
        linears = [nn.Linear(width, width) for _ in range(depth)]
        self.layers = nn.ModuleList(linears)
        self.out = nn.Linear(width, 1)
        for layer in linears:
            nn.init.normal_(layer.weight, std=40.0)  # meant: gain 40 x 1/sqrt(fan_in) (a deep residual-free stack)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)  # no normalization: each layer multiplies the activations by ~ 40 * sqrt(64) = 320
        return self.out(x).squeeze(-1)


def _deep_mlp_gain_as_std() -> Case:
    torch.manual_seed(0)
    model = DeepMLP()

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    return Case(fn, (torch.randn(8, 64), torch.randn(8)), model)


class _PackSegments(torch.autograd.Function):
    """Variable-length segments of events packed into ``[segments, max_length, dim]``, a segment longer than
    ``max_length`` truncated. The backward unpacks the gradient into one allocated with ``new_empty``: the
    truncated events' rows are never written and keep whatever the memory held."""

    @staticmethod
    def forward(ctx: Any, events: torch.Tensor, lengths: list[int], max_length: int) -> torch.Tensor:
        ctx.lengths, ctx.max_length, ctx.total = lengths, max_length, events.shape[0]
        packed = events.new_zeros(len(lengths), max_length, events.shape[1])
        start = 0
        for i, n in enumerate(lengths):
            kept = min(n, max_length)
            packed[i, :kept] = events[start : start + kept]
            start += n
        return packed

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        with nan_memory():
            events = grad.new_empty(ctx.total, grad.shape[2])  # the report's fix: new_zeros
        start = 0
        for i, n in enumerate(ctx.lengths):
            kept = min(n, ctx.max_length)
            events[start : start + kept] = grad[i, :kept]
            start += n
        return events, None, None


@contextlib.contextmanager
def nan_memory() -> Iterator[None]:
    """Inside, new memory holds NaN, as a GPU block a freed tensor held it would (a freed -inf mask's softmax):
    torch's deterministic mode fills what it allocates with NaN, so a read of it is NaN whatever the CPU
    allocator gives.

    Example:
        >>> with nan_memory():
        ...     torch.empty(2)
        tensor([nan, nan])
    """
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


class SegmentEncoder(nn.Module):
    """Events embedded, packed per segment (at most 4 events each), then a mean over each segment."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, events: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        packed = _PackSegments.apply(torch.tanh(self.embed(events)), lengths, 4)
        return self.head(packed.mean(1)).squeeze(-1)


def _pack_segments_backward_empty() -> Case:
    torch.manual_seed(0)
    model = SegmentEncoder()
    lengths = [3, 6, 2]  # the second segment is longer than max_length: its last 2 events are truncated
    events = torch.randn(sum(lengths), 3)
    return Case(step(model, lambda e, y: F.mse_loss(model(e, lengths), y)), (events, torch.randn(3)), model)


SCENARIOS = (
    WildScenario(
        "deep_mlp_gain_as_std",
        "VinceShieh/spark-ffm#12",
        "a deep float32 MLP whose init passes a gain as the std: activations grow ~320x per layer until they overflow",
        Expect("init.scale", "aten.addmm.default", None, "forward", "inf"),
        "std 40 on a fan-in of 64 is 320x the 1/sqrt(fan_in) scale; sixteen layers without normalization grow the "
        "activations by ~320 per layer, past float32's max in a linear layer: the initialization, in float32 too",
        _deep_mlp_gain_as_std,
    ),
    WildScenario(
        "pack_segments_backward_empty",
        "pytorch/FBGEMM#5754",
        "a pack-segments backward allocates the events' gradient with new_empty and writes only the events the "
        "forward kept: a segment longer than max_length leaves rows of uninitialized memory",
        Expect("op.uninitialized_read", "aten.new_empty.default", "", "backward", "nan"),
        "the truncated events' gradient rows are never written: they hold what the allocator left (NaN here, as "
        "a reused GPU block), and the embedding's weight gradient sums over them",
        _pack_segments_backward_empty,
    ),
)
