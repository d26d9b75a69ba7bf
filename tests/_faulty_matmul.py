"""A faulty device below the model, for the peer-proof tests: one rank's matmul kernels corrupt one
element of every output (forward and backward), whoever runs them: the step, its replays, a proof.
Nothing in the model, the loop or nanguard is told; a peer rank's kernels compute correctly."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
MATMULS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})


class FaultyMatmul(TorchDispatchMode):
    """While ``armed``, the first element of every matmul's output is NaN (``factor=None``) or
    multiplied by ``factor`` (a finite corruption). Enter it on the faulty rank only."""

    def __init__(self, factor: float | None = None) -> None:
        super().__init__()
        self.factor = factor
        self.armed = False
        self.hits = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.armed and func in MATMULS and isinstance(out, torch.Tensor) and out.numel():
            self.hits += 1
            out = out.clone()
            flat = out.view(-1)
            flat[0] = math.nan if self.factor is None else flat[0] * self.factor
        return out
