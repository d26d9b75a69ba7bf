"""Taint bookkeeping: which tensors hold NaN/Inf, and which origins put it there.

Each tensor seen gets a status at its version counter: its NaN/Inf flags and its taint,
the set of origin ids behind its non-finite values. A status is trusted while the version
is unchanged; after an in-place write the tensor is read again. Taint is also kept per
storage, so a fresh view of a tainted tensor inherits it.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nanguard.stats import local

__all__ = ["Inputs", "Status", "TaintMap", "has_inf_created", "many_nonfinite_flags", "nonfinite_flags", "storage_key"]


@dataclass
class Status:
    """A tensor's flags at its version: ``inf`` is "Inf and no NaN" (``nonfinite_flags``)."""

    version: int
    nan: bool
    inf: bool
    taint: frozenset[int]


@dataclass
class Inputs:
    """What an op's inputs carry: any NaN/Inf (tensors or float scalars), and their taints."""

    nan: bool
    inf: bool
    taint: frozenset[int]
    inf_taint: frozenset[int]  # of inputs holding Inf but no NaN
    written: tuple[float, ...] = ()  # the NaN/Inf Python numbers among them (a fill value)


class TaintMap:
    """Status per tensor seen, and taint per storage.

    ``new_source(t, nan, inf)`` is called for a tensor that arrives non-finite with no taint
    known (user data, a parameter, a constant) and returns the id of the origin it names.
    """

    def __init__(self, new_source: Callable[[torch.Tensor, bool, bool], int]) -> None:
        self.new_source = new_source
        # Keyed by id with a weak reference to check the tensor is still the same one: a
        # tensor hashes in Python, and this map is read for every input of every op.
        self.status: dict[int, tuple[weakref.ref[torch.Tensor], Status]] = {}
        self.storage: dict[int, frozenset[int]] = {}

    def inputs(self, flat: list[Any]) -> Inputs:
        nan = inf = False
        taint: set[int] = set()
        inf_taint: set[int] = set()
        written: list[float] = []
        for x in flat:
            if isinstance(x, torch.Tensor):
                if not (x.is_floating_point() or x.is_complex()):
                    continue
                st = self.status_of(x)
                if st.nan or st.inf:
                    taint |= st.taint
                    if st.inf and not st.nan:
                        inf_taint |= st.taint
                nan |= st.nan
                inf |= st.inf
            elif isinstance(x, float) and not math.isfinite(x):
                nan |= math.isnan(x)
                inf |= math.isinf(x)
                written.append(x)
        return Inputs(nan, inf, frozenset(taint), frozenset(inf_taint), tuple(written))

    def status_of(self, t: torch.Tensor) -> Status:
        version = _version(t)
        st = self._get(t)
        if st is not None and st.version == version:
            return st
        nan, inf = nonfinite_flags(t)
        taint: frozenset[int] = frozenset()
        if nan or inf:
            # Written through a view since last seen: the view's writer tainted the storage.
            taint = (st.taint if st is not None else frozenset()) | self.storage.get(storage_key(t), frozenset())
            if not taint:
                taint = frozenset({self.new_source(t, nan, inf)})
        st = Status(version, nan, inf, taint)
        self._put(t, st)
        return st

    def set(self, t: torch.Tensor, nan: bool, inf: bool, taint: frozenset[int]) -> None:
        self._put(t, Status(_version(t), nan, inf, taint))
        if taint:
            self.storage[storage_key(t)] = taint

    def taint_of(self, t: torch.Tensor) -> frozenset[int]:
        """The origins behind a non-finite tensor: its own taint and its storage's."""
        st = self._get(t)
        own = st.taint if st is not None and (st.nan or st.inf) else frozenset()
        return own | self.storage.get(storage_key(t), frozenset())

    def _get(self, t: torch.Tensor) -> Status | None:
        entry = self.status.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _put(self, t: torch.Tensor, st: Status) -> None:
        self.status[id(t)] = (weakref.ref(t), st)


_SUMMED = (torch.float32, torch.float64)


def nonfinite_flags(t: torch.Tensor, likely: bool = False) -> tuple[bool, bool]:
    """(has NaN, has Inf and no NaN) of ``t``'s local values, from one pass in the common cases.

    A finite sum proves a float32/float64 tensor finite, and sums run several times faster
    than a min/max on tensors that fit in cache. Past it, a max (NaN-propagating) tells NaN,
    and +Inf, by itself; only a tensor without either needs its min. ``likely`` (the op's
    inputs were non-finite) skips the sum. The Inf of a tensor that also holds NaN is not
    reported: the tracer never reads it (a NaN input rules out any creation), and telling it
    would cost another pass.

    Example:
        >>> nonfinite_flags(torch.tensor([1.0, float("inf")]))
        (False, True)
    """
    t = local(t)
    if t.dtype in _SUMMED and t.layout == torch.strided and t.numel():
        if not likely and math.isfinite(t.sum().item()):
            return False, False
        hi = t.amax().item()
        if math.isnan(hi):
            return True, False
        return False, math.isinf(hi) or math.isinf(t.amin().item())
    bounds = _bounds(t)
    return (False, False) if bounds is None else _flags(*bounds.tolist())


def many_nonfinite_flags(ts: Sequence[torch.Tensor]) -> list[tuple[bool, bool]]:
    """``nonfinite_flags`` of each tensor, with one host read for all of them."""
    bounds = [_bounds(local(t)) for t in ts]
    present = [b for b in bounds if b is not None]
    if not present:
        return [(False, False)] * len(ts)
    if len(present) == 1:
        rows = present[0][None]
    else:
        rows = torch.stack([b.to(present[0].device, torch.float64) for b in present])
    values = iter(rows.tolist())
    return [(False, False) if b is None else _flags(*next(values)) for b in bounds]


def _flags(lo: float, hi: float) -> tuple[bool, bool]:
    nan = math.isnan(lo) or math.isnan(hi)
    return nan, not nan and (math.isinf(lo) or math.isinf(hi))


def _bounds(t: torch.Tensor) -> torch.Tensor | None:
    """[min, max] of ``t`` as one device tensor, NaN when it holds any NaN; None when empty.

    A min/max reduction reads each element once and writes no temporary, where
    ``isfinite``/``isnan``/``isinf`` each write a mask as large as the tensor."""
    if t.numel() == 0:
        return None
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    if t.element_size() == 1:  # float8 has no min/max kernel
        t = t.float()
    return torch.stack(torch.aminmax(t.detach()))


def has_inf_created(out: torch.Tensor, inputs: list[Any]) -> bool:
    """Did an elementwise op make Inf where all its inputs were finite? ``exp`` of a masked
    row turns finite scores into +Inf beside the mask's -Inf: that is a creation."""
    if any(isinstance(x, float) and math.isinf(x) for x in inputs):
        return False  # an explicit +-inf fill value
    finite = torch.ones(out.shape, dtype=torch.bool, device=out.device)
    try:
        for x in inputs:
            if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
                finite &= torch.isfinite(x).broadcast_to(out.shape)
    except RuntimeError:
        return False  # not elementwise: fall back to "any Inf input means not created"
    return bool((torch.isinf(out) & finite).any())


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return -1


def storage_key(t: torch.Tensor) -> int:
    """The address of ``t``'s storage: views and ``.data`` aliases share it (-1 when there is none)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return -1
