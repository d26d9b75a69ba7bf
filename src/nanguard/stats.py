"""Tensor health: non-finite flags, norms and summary statistics, fused where it matters."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from nanguard import compat

__all__ = [
    "INIT_RATIO_HIGH",
    "INIT_RATIO_LOW",
    "fan_in",
    "float_groups",
    "init_ratio",
    "is_float",
    "local",
    "tensor_stats",
    "total_norm",
]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2, tensor parallel), else ``t``: health checks never
    communicate."""
    inner = compat.inner_tensor(t) if hasattr(t, "_local_tensor") else None
    return inner if inner is not None else t


def is_float(t: object) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def tensor_stats(t: torch.Tensor) -> dict[str, Any]:
    """Summary statistics of one tensor, of any dtype torch has: three passes over a finite tensor,
    eight over one that is not. It never raises: statistics it could not take are left out, and
    ``stats_error`` says why (describing evidence must never cost a diagnosis).

    min/max/absmax are taken over the finite values, so a NaN does not hide the scale. 16- and
    8-bit floats are counted in float32; float64 keeps its range. Integers and bools give min, max,
    zeros and negative; complex tensors absmax (of the modulus), zeros and the non-finite counts.

    Example:
        >>> tensor_stats(torch.tensor([0.0, 1.0, float("nan")]))["nan"]
        1
        >>> tensor_stats(torch.tensor([7, 65531], dtype=torch.uint16))["max"]
        65531
    """
    out: dict[str, Any] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    if t.numel() == 0:
        return out
    try:
        x = local(t).detach()
        if x.is_complex():
            out.update(_complex_stats(x))
        elif not x.is_floating_point():
            out.update(_integer_stats(x))
        else:
            out.update(_float_stats(x))
    except Exception as err:  # evidence only: the diagnosis goes on without these numbers
        out["stats_error"] = f"{type(err).__name__}: {err}"[:200]
    return out


# Integer dtypes torch's reductions do not cover on every device (min/max of uint16-uint64 on CPU),
# counted in int64, which holds every value; uint64 is read as int64 with its top bit flipped, which
# orders the values as unsigned, then shifted back.
_WIDER = {torch.bool: torch.int64, torch.uint16: torch.int64, torch.uint32: torch.int64}
_TOP_BIT = -(2**63)


def _integer_stats(x: torch.Tensor) -> dict[str, Any]:
    if x.dtype == torch.uint64:
        y = x.view(torch.int64) ^ _TOP_BIT
        lo, hi, zeros = torch.stack([y.min(), y.max(), (y == _TOP_BIT).sum()]).tolist()
        return {"min": lo + 2**63, "max": hi + 2**63, "zeros": zeros, "negative": 0}
    x = x.to(_WIDER[x.dtype]) if x.dtype in _WIDER else x
    lo, hi, zeros, negative = torch.stack([x.min(), x.max(), (x == 0).sum(), (x < 0).sum()]).tolist()
    return {"min": lo, "max": hi, "zeros": zeros, "negative": negative}


def _complex_stats(x: torch.Tensor) -> dict[str, Any]:
    parts = torch.view_as_real(x).float()  # complex32's halves too
    nan = torch.isnan(parts).any(-1)
    modulus = parts.pow(2).sum(-1).sqrt().nan_to_num(0.0, 0.0, 0.0)
    zeros, nans, infs, absmax = torch.stack(
        [(x == 0).sum(), nan.sum(), (torch.isinf(parts).any(-1) & ~nan).sum(), modulus.amax()]
    ).tolist()
    return {"absmax": absmax, "zeros": int(zeros), "nan": int(nans), "inf": int(infs)}


def _float_stats(x: torch.Tensor) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if x.element_size() < 4:
        x = x.float()
    lo, hi = torch.stack(torch.aminmax(x)).tolist()
    # NaN and Inf are neither zero nor (but -Inf) negative: these count finite values without a copy.
    counts = [(x == 0).sum(), (x < 0).sum()]
    finite = math.isfinite(lo) and math.isfinite(hi)
    if not finite:
        counts += [torch.isnan(x).sum(), torch.isposinf(x).sum(), torch.isneginf(x).sum()]
        # A NaN/Inf read as the far end of the range cannot move the finite min or max.
        big = torch.finfo(x.dtype).max
        lo, hi = torch.stack([x.nan_to_num(big, big, big).amin(), x.nan_to_num(-big, -big, -big).amax()]).tolist()
    zeros, negative, nan, posinf, neginf = [*torch.stack(counts).tolist(), 0, 0, 0][:5]
    if nan + posinf + neginf == x.numel():
        lo = hi = None
    out.update(
        min=lo,
        max=hi,
        absmax=0.0 if lo is None or hi is None else max(abs(lo), abs(hi)),
        zeros=zeros,
        negative=negative,
        nan=nan,
        posinf=posinf,
        neginf=neginf,
    )
    return out


def float_groups(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` as local, dense tensors grouped by device and dtype: one foreach kernel each.

    A sparse gradient counts by its coalesced values (an uncoalesced one may repeat an index).

    Example:
        >>> [len(g) for g in float_groups([torch.ones(2), torch.ones(3), torch.ones(2, dtype=torch.float16)])]
        [2, 1]
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        t = local(t)
        if t.is_sparse:
            t = t.coalesce().values()
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def total_norm(groups: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """L2 norm over every tensor of ``groups`` (each of one device and dtype) as one float32 device
    scalar: NaN/Inf exactly when some element is, and finite for finite inputs (a norm past the
    float32 range reads as its max). Without any tensor, a CPU zero.

    Squares are summed in float64 where that costs nothing (CUDA: the kernel is memory-bound), and
    for float64 tensors. On CPU, where a value can be read without a device sync, a float32 sum
    that overflowed is summed again in float64; the common step pays one float32 pass. Other
    devices sum in float32.

    Example:
        >>> 1.9e20 < total_norm([[torch.full((4,), 1e20)]]).item() < 2.1e20
        True
    """
    groups = [g for g in groups if g]
    if not groups:
        return torch.zeros((), dtype=torch.float32)
    first = groups[0][0]
    device = first.device
    # float64 norms cannot narrow to float32 (one group: its dtype, without a generator's calls)
    wide = first.dtype == torch.float64 if len(groups) == 1 else any(g[0].dtype == torch.float64 for g in groups)
    acc = torch.float64 if wide else _ACCUMULATE.get(device.type, torch.float32)
    total = _norm_of_norms(groups, device, acc)
    if acc == torch.float32 and device.type == "cpu" and math.isinf(total.item()):
        acc, total = torch.float64, _norm_of_norms(groups, device, torch.float64)
    if acc == torch.float32:
        return total
    big = torch.finfo(torch.float32).max
    return torch.where(torch.isinf(total), total, total.clamp(max=big)).float()


_ACCUMULATE = {"cuda": torch.float64}


def _norm_of_norms(groups: list[Sequence[torch.Tensor]], device: torch.device, acc: torch.dtype) -> torch.Tensor:
    # One foreach kernel per group, then one stack of the per-tensor norms and their norm.
    if len(groups) == 1:
        if len(groups[0]) == 1:  # one tensor (an engine's flat partition): its norm, the same value in one kernel
            return torch.linalg.vector_norm(groups[0][0], 2.0, dtype=acc)
        return torch.linalg.vector_norm(torch.stack(compat.foreach_norm(groups[0], 2.0, dtype=acc)))
    norms: list[torch.Tensor] = []
    for ts in groups:
        norms.extend(n.to(device) for n in compat.foreach_norm(ts, 2.0, dtype=acc))
    return torch.linalg.vector_norm(torch.stack(norms))


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

    The sum of squares is accumulated in float64 (float32 where the device has none): weights grown past 1e19
    have a float32 sum of squares of Inf, and a grown weight is what the ratio is asked about.

    Example:
        >>> w = torch.nn.Linear(256, 64).weight
        >>> 0.3 < init_ratio(w).item() < 1.0
        True
    """
    w = local(weight).detach()
    acc = torch.float32 if w.device.type == "mps" else torch.float64
    rms = torch.linalg.vector_norm(w, 2, dtype=acc) / math.sqrt(max(w.numel(), 1))
    return (rms * math.sqrt(fan_in(weight))).float()
