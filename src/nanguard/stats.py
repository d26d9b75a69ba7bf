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
    "init_ratios",
    "is_float",
    "local",
    "tensor_stats",
    "total_norm",
]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2, tensor parallel), else ``t``: health checks never
    communicate."""
    if type(t) in _PLAIN:  # the tracer asks for every op's output: no attribute lookup that fails
        return t
    inner = compat.inner_tensor(t) if hasattr(t, "_local_tensor") else None
    return inner if inner is not None else t


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def is_float(t: object) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def tensor_stats(t: torch.Tensor) -> dict[str, Any]:
    """Summary statistics of one tensor, of any dtype torch has (a float tensor's from float passes, no
    bool mask, and two host reads). It never raises: statistics it could not take are left out, and
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
    if x.element_size() < 4:
        x = x.float()
    lo, hi = torch.stack(torch.aminmax(x)).tolist()
    if math.isfinite(lo) and math.isfinite(hi):
        (zeros, negative), nan, posinf, neginf = _sign_counts(x), 0, 0, 0
    else:
        lo, hi, zeros, negative, nan, posinf, neginf = _nonfinite_stats(x)
    if nan + posinf + neginf == x.numel():
        lo = hi = None
    return {
        "min": lo,
        "max": hi,
        "absmax": 0.0 if lo is None or hi is None else max(abs(lo), abs(hi)),
        "zeros": zeros,
        "negative": negative,
        "nan": nan,
        "posinf": posinf,
        "neginf": neginf,
    }


# The counts are sums of small integer codes (a sign, -1/1/2 for the non-finite values) in float arithmetic: a
# comparison writes a bool mask and sums it as int64, several times slower on CPU than a float pass. Every
# partial sum is an integer of at most 4 x numel, exact in float32 up to 2**24; past that they sum in float64.
_EXACT_FLOAT32 = 2**24


def _accumulate(x: torch.Tensor) -> torch.dtype | None:
    return None if 4 * x.numel() <= _EXACT_FLOAT32 else torch.float64


def _sign_counts(x: torch.Tensor) -> tuple[int, int]:
    """(zeros, negative) of a finite float tensor, in one host read."""
    acc = _accumulate(x)
    signs = torch.sign(x)
    balance = signs.sum(dtype=acc)  # positive - negative (stream order: read before the abs_ below)
    nonzero, balance = torch.stack([signs.abs_().sum(dtype=acc), balance]).tolist()
    return x.numel() - int(nonzero), (int(nonzero) - int(balance)) // 2


def _nonfinite_stats(x: torch.Tensor) -> tuple[float | None, float | None, int, int, int, int, int]:
    """(min, max of the finite values, zeros, negative, nan, posinf, neginf) of a float tensor holding
    NaN or Inf, in one host read."""
    acc = _accumulate(x)
    # A NaN/Inf read as the far end of the range cannot move the finite min or max.
    big = torch.finfo(x.dtype).max
    bounds = torch.stack([x.nan_to_num(big, big, big).amin(), x.nan_to_num(-big, -big, -big).amax()])
    finite = x.nan_to_num(0.0, 0.0, 0.0)
    code = x.nan_to_num(2.0, 1.0, -1.0).sub_(finite)  # 2 at NaN, 1 at +Inf, -1 at -Inf, else 0
    signs = finite.sign_()  # of the finite values; 0 at NaN/Inf
    # In stream order, each sum reads its tensor before the in-place op after it.
    sums = [signs.sum(dtype=acc), signs.abs_().sum(dtype=acc), code.sum(dtype=acc), code.abs_().sum(dtype=acc)]
    sums.append(code.mul_(code).sum(dtype=acc))
    values = torch.cat([bounds.to(torch.float64), torch.stack(sums).to(torch.float64)]).tolist()
    lo, hi = values[:2]
    balance, nonzero, coded, magnitude, squared = (int(v) for v in values[2:])
    # sum(code) = 2 nan + posinf - neginf, sum(|code|) = 2 nan + posinf + neginf, sum(code^2) = 4 nan + posinf + neginf
    nan = (squared - magnitude) // 2
    infs = magnitude - 2 * nan
    posinf = (infs + coded - 2 * nan) // 2
    neginf = infs - posinf
    zeros = x.numel() - nonzero - nan - infs
    return lo, hi, zeros, (nonzero - balance) // 2 + neginf, nan, posinf, neginf


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
    for g in groups:  # the guard's groups are never empty: its two reads a step make no comprehension
        if not g:
            groups = [g for g in groups if g]
            break
    if not groups:
        return torch.zeros((), dtype=torch.float32)
    first = groups[0][0]
    device = first.device
    one = len(groups) == 1
    # float64 norms cannot narrow to float32 (one group: its dtype, without a generator's calls)
    wide = first.dtype == torch.float64 if one else any(g[0].dtype == torch.float64 for g in groups)
    kind = device.type
    acc = torch.float64 if wide else _ACCUMULATE.get(kind, torch.float32)
    if one and len(groups[0]) > 1:  # ``_norm_of_norms``'s common case, inline (the guard's two reads a step)
        total = torch.linalg.vector_norm(torch.stack(compat.foreach_norm(groups[0], 2.0, dtype=acc)))
    else:
        total = _norm_of_norms(groups, device, acc)
    # A norm is never negative: == inf is isinf.
    if acc == torch.float32 and kind == "cpu" and total.item() == math.inf:
        acc, total = torch.float64, _norm_of_norms(groups, device, torch.float64)
    if acc == torch.float32:
        return total
    big = torch.finfo(torch.float32).max
    return torch.where(torch.isinf(total), total, total.clamp(max=big)).float()


_ACCUMULATE = {"cuda": torch.float64}


def _norm_of_norms(groups: Sequence[Sequence[torch.Tensor]], device: torch.device, acc: torch.dtype) -> torch.Tensor:
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


def init_ratios(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """``init_ratio`` of each of ``weights`` as one float32 tensor on the first one's device: the same
    arithmetic, with one division and one product for all of them.

    Example:
        >>> init_ratios([torch.nn.Linear(256, 64).weight, torch.nn.Linear(64, 8).weight]).shape
        torch.Size([2])
    """
    ws = [local(w).detach() for w in weights]
    device = ws[0].device
    if any(w.device != device for w in ws):
        return torch.stack([init_ratio(w).to(device) for w in weights])
    acc = torch.float32 if device.type == "mps" else torch.float64
    norms = torch.stack([torch.linalg.vector_norm(w, 2, dtype=acc) for w in ws])
    sizes = [math.sqrt(max(w.numel(), 1)) for w in ws]
    fans = [math.sqrt(fan_in(w)) for w in weights]
    roots = torch.tensor([sizes, fans], dtype=acc, device=device)
    return (norms / roots[0] * roots[1]).float()
