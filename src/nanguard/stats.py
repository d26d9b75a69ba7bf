"""Tensor health: non-finite flags, norms and summary statistics, fused where it matters."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from nanguard import compat

__all__ = [
    "INIT_RATIO_HIGH",
    "INIT_RATIO_LOW",
    "fan_in",
    "grad_health",
    "init_ratio",
    "is_float",
    "local",
    "tensor_stats",
]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2), else ``t``: health checks never communicate."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def is_float(t: object) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def tensor_stats(t: torch.Tensor) -> dict[str, Any]:
    """Summary statistics of one tensor in a single host read.

    min/max/absmax are taken over the finite values, so a NaN does not hide the scale.

    Example:
        >>> tensor_stats(torch.tensor([0.0, 1.0, float("nan")]))["nan"]
        1
    """
    out: dict[str, Any] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    if t.numel() == 0 or t.is_complex():
        return out
    x = local(t).detach()
    if not x.is_floating_point():
        if x.dtype == torch.bool:
            x = x.to(torch.int64)
        vals = torch.stack([x.min(), x.max(), (x == 0).sum(), (x < 0).sum()]).tolist()
        out.update(min=vals[0], max=vals[1], zeros=vals[2], negative=vals[3])
        return out
    x = x.float()
    finite = torch.isfinite(x)
    big = torch.finfo(torch.float32).max
    fx = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))
    vals = torch.stack(
        [
            torch.where(finite, x, big).min(),
            torch.where(finite, x, -big).max(),
            fx.abs().max(),
            (x == 0).sum().float(),
            (x < 0).sum().float(),
            torch.isnan(x).sum().float(),
            (x == math.inf).sum().float(),
            (x == -math.inf).sum().float(),
            finite.sum().float(),
        ]
    ).tolist()
    nfinite = int(vals[8])
    out.update(
        min=vals[0] if nfinite else None,
        max=vals[1] if nfinite else None,
        absmax=vals[2],
        zeros=int(vals[3]),
        negative=int(vals[4]),
        nan=int(vals[5]),
        posinf=int(vals[6]),
        neginf=int(vals[7]),
    )
    return out


def grad_health(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """Total L2 norm of ``grads`` as one float32 device scalar (NaN/Inf when any is non-finite).

    Uses ``torch._foreach_norm`` (through ``compat``) grouped by device and dtype: a handful
    of kernels, no Python loop of host reads.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        g = local(g)
        groups.setdefault((g.device, g.dtype), []).append(g)
    if not groups:
        return torch.zeros((), dtype=torch.float32)
    device = next(iter(groups))[0]
    # One norm per (device, dtype) group, then the norm of those norms: no per-tensor Python work.
    parts = [
        torch.linalg.vector_norm(torch.stack(compat.foreach_norm(ts, 2.0, dtype=torch.float32)), dtype=torch.float32)
        for ts in groups.values()
    ]
    if len(parts) == 1:
        return parts[0]
    return torch.linalg.vector_norm(torch.stack([p.to(device) for p in parts]))


# The init ratio is rms(weight) * sqrt(fan_in): PyTorch's default init gives ~0.58,
# Xavier/Kaiming 1-1.4, GPT-style std=0.02 0.5-1.1. Ten times too large compounds per layer
# into overflow; a thousand times too small leaves gradients that round to zero in 16 bits.
INIT_RATIO_HIGH = 10.0
INIT_RATIO_LOW = 1e-3


def fan_in(weight: torch.Tensor) -> int:
    """Inputs per output unit of a Linear/Conv weight: the product of all but the first dim."""
    return math.prod(weight.shape[1:])


def init_ratio(weight: torch.Tensor) -> torch.Tensor:
    """``rms(weight) * sqrt(fan_in)`` as a float32 device scalar: ~1 for a well-initialized layer.

    The sum of squares is accumulated in float32 at least: in 16 bits it overflows.

    Example:
        >>> w = torch.nn.Linear(256, 64).weight
        >>> 0.3 < init_ratio(w).item() < 1.0
        True
    """
    w = local(weight).detach()
    acc = torch.float32 if w.element_size() < 4 else w.dtype
    rms = torch.linalg.vector_norm(w, 2, dtype=acc) / math.sqrt(max(w.numel(), 1))
    return (rms * math.sqrt(fan_in(weight))).float()
