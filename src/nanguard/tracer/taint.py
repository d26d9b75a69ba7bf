"""Taint bookkeeping: which tensors hold NaN/Inf, and which origins put it there.

Each tensor seen gets a status at its version counter: its NaN/Inf flags and its taint,
the set of origin ids behind its non-finite values. A status is trusted while the version
is unchanged; after an in-place write the tensor is read again. Taint is also kept per
storage, so a fresh view of a tainted tensor inherits it.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch

from nanguard import compat
from nanguard.stats import float_groups, local, total_norm

__all__ = [
    "CLEAN",
    "Inputs",
    "Status",
    "TaintMap",
    "has_inf_created",
    "many_nonfinite_flags",
    "nonfinite_flags",
    "storage_key",
    "version",
]


class Status(NamedTuple):
    """A tensor's flags at its version: ``inf`` is "Inf and no NaN" (``nonfinite_flags``)."""

    version: int
    nan: bool
    inf: bool
    taint: frozenset[int]


class Inputs(NamedTuple):
    """What an op's inputs carry: any NaN/Inf (tensors or float scalars), and their taints."""

    nan: bool
    inf: bool
    taint: frozenset[int]
    inf_taint: frozenset[int]  # of inputs holding Inf but no NaN
    written: tuple[float, ...] = ()  # the NaN/Inf Python numbers among them (a fill value)


_NONE: frozenset[int] = frozenset()
CLEAN = Inputs(False, False, _NONE, _NONE)


_Entry = tuple[weakref.ref, int, bool, bool, frozenset[int], "int | None"]


class TaintMap:
    """Status per tensor seen, and taint per storage.

    ``new_source(t, nan, inf)`` is called for a tensor that arrives non-finite with no taint
    known (user data, a parameter, a constant) and returns the id of the origin it names.
    """

    def __init__(self, new_source: Callable[[torch.Tensor, bool, bool], int]) -> None:
        self.new_source = new_source
        # Keyed by id with a weak reference to check the tensor is still the same one: a
        # tensor hashes in Python, and this map is read for every input of every op. An entry
        # is a flat tuple (reference, version, nan, inf, taint, base version): the tracer writes
        # one per op output.
        self.status: dict[int, _Entry] = {}
        self.storage: dict[int, frozenset[int]] = {}

    def inputs(self, flat: Sequence[Any]) -> Inputs:
        """The flags and taints of an op's flat arguments; ``CLEAN`` when none is NaN/Inf."""
        bad: list[_Entry] = []
        written: tuple[float, ...] = ()
        status = self.status
        for x in flat:
            entry = status.get(id(x))
            if entry is not None and entry[0]() is x is not None:  # a tensor seen: read again only once written
                try:
                    stale = entry[1] != x._version
                except RuntimeError:  # an inference tensor keeps no version counter
                    stale = entry[1] != -1
                if stale:
                    entry = self._read(x, entry)
            elif isinstance(x, torch.Tensor):
                if not (x.is_floating_point() or x.is_complex()):
                    continue
                entry = self._read(x, entry)
            else:
                if isinstance(x, float) and not -math.inf < x < math.inf:  # NaN or +-Inf
                    written += (x,)
                continue
            if entry[2] or entry[3]:
                bad.append(entry)
        if not (bad or written):
            return CLEAN
        return _combined(bad, written)

    def status_of(self, t: torch.Tensor) -> Status:
        entry = self.status.get(id(t))
        if entry is None or entry[0]() is not t or entry[1] != version(t):
            entry = self._read(t, entry)
        return Status(*entry[1:5])

    def _read(self, t: torch.Tensor, old: _Entry | None) -> _Entry:
        """Read ``t``'s flags afresh (unseen, or written in place since)."""
        if old is not None and old[5] is not None and old[0]() is t and t._is_view() and old[5] == version(t):
            # A view made inside dispatch gets its base's version counter only afterwards: at the
            # base's version when the view was made, nothing has written to either since.
            entry = (old[0], old[5], old[2], old[3], old[4], None)
            self.status[id(t)] = entry
            return entry
        nan, inf = nonfinite_flags(t)
        taint: frozenset[int] = _NONE
        if nan or inf:
            # Written through a view since last seen: the view's writer tainted the storage.
            own = old[4] if old is not None and old[0]() is t else _NONE
            taint = own | self.storage.get(storage_key(t), _NONE)
            if not taint:
                taint = frozenset({self.new_source(t, nan, inf)})
        entry = (weakref.ref(t), version(t), nan, inf, taint, None)
        self.status[id(t)] = entry
        return entry

    def set(
        self, t: torch.Tensor, nan: bool, inf: bool, taint: frozenset[int], base_version: int | None = None
    ) -> None:
        """Record ``t``'s flags; ``base_version``: the version of the tensor ``t`` is a view of, if any."""
        try:
            current = t._version
        except RuntimeError:  # an inference tensor keeps no version counter
            current = -1
        self.status[id(t)] = (weakref.ref(t), current, nan, inf, taint, base_version)
        if taint:
            self.storage[storage_key(t)] = taint

    def set_finite(self, ts: Iterable[torch.Tensor], base_version: int | None = None) -> None:
        """Record the floating tensors among ``ts``, known to be finite, at their current versions (see ``set``)."""
        status = self.status
        try:
            for t in ts:
                if t.is_floating_point() or t.is_complex():
                    status[id(t)] = (weakref.ref(t), t._version, False, False, _NONE, base_version)
        except RuntimeError:  # an inference tensor keeps no version counter: the same again, -1 for it
            for t in ts:
                if t.is_floating_point() or t.is_complex():
                    status[id(t)] = (weakref.ref(t), version(t), False, False, _NONE, base_version)

    def aliases(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The other tensors seen that share ``t``'s storage (its base, views, ``.data`` aliases)."""
        key = storage_key(t)
        found = []
        for entry in self.status.values():
            other = entry[0]()
            if other is not None and other is not t and storage_key(other) == key:
                found.append(other)
        return found

    def written(self, t: torch.Tensor) -> list[torch.Tensor]:
        """``t`` was just written in place with NaN/Inf: every alias of its storage is read afresh at its
        next use. A view shares its base's version counter, but a ``.data`` alias has one of its own, so
        a write through it leaves the tensor it aliases at an unchanged version. Returns the aliases.
        Scans every status: called once per write that made a value, never per op."""
        found = self.aliases(t)
        for other in found:
            self.status.pop(id(other), None)
        return found

    def taint_of(self, t: torch.Tensor) -> frozenset[int]:
        """The origins behind a non-finite tensor: its own taint and its storage's."""
        entry = self.status.get(id(t))
        own = entry[4] if entry is not None and entry[0]() is t and (entry[2] or entry[3]) else _NONE
        return own | self.storage.get(storage_key(t), _NONE)


def _combined(bad: list[_Entry], written: tuple[float, ...]) -> Inputs:
    """The ``Inputs`` of an op's non-finite tensor entries ``bad`` and non-finite numbers ``written``."""
    nan = inf = False
    taint = inf_taint = _NONE
    for entry in bad:
        if entry[2]:
            nan = True
        elif entry[3]:
            inf_taint = entry[4] if not inf_taint else inf_taint | entry[4]
        inf = inf or entry[3]
        # Most inputs of a NaN-flooded step share one taint: no new set for them.
        if taint is not entry[4]:
            taint = entry[4] if not taint else taint | entry[4]
    for x in written:
        if math.isnan(x):
            nan = True
        else:
            inf = True
    return Inputs(nan, inf, taint, inf_taint, written)


_SUMMED = (torch.float32, torch.float64)
_PROBED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def nonfinite_flags(t: torch.Tensor, likely: bool = False) -> tuple[bool, bool]:
    """(has NaN, has Inf and no NaN) of ``t``'s local values, from one pass in the common cases.

    A finite sum proves a float32/float64 tensor finite, and sums run several times faster
    than a min/max on tensors that fit in cache. Past it, a max (NaN-propagating) tells NaN,
    and +Inf, by itself; only a tensor without either needs its min. ``likely`` (the op's
    inputs were non-finite) skips the sum, and a NaN first element answers with no pass at
    all. The Inf of a tensor that also holds NaN is not reported: the tracer never reads it
    (a NaN input rules out any creation), and telling it would cost another pass.

    Example:
        >>> nonfinite_flags(torch.tensor([1.0, float("inf")]))
        (False, True)
    """
    if type(t) not in _PLAIN:
        t = local(t)
    if t.dtype in _SUMMED and t.layout == torch.strided and t.numel():
        if likely:
            # NaN spreads through most of a tensor made from a NaN one: its first element
            # (read without a pass) usually tells.
            if math.isnan(t.as_strided((), ()).item()):
                return True, False
        elif math.isfinite(t.sum().item()):
            return False, False
        hi = t.amax().item()
        if math.isnan(hi):
            return True, False
        return False, math.isinf(hi) or math.isinf(t.amin().item())
    bounds = _bounds(t)
    return (False, False) if bounds is None else _flags(*bounds.tolist())


def many_nonfinite_flags(ts: Sequence[torch.Tensor]) -> list[tuple[bool, bool]]:
    """``nonfinite_flags`` of each tensor, with one host read for all of them on an accelerator.

    A CPU tensor whose first element is NaN needs no pass (reading it costs no device sync):
    the gradients of a step that went NaN usually are. The other CPU tensors, when all are
    finite (a healthy step's gradients), are shown so by one norm over all of them.

    Example:
        >>> many_nonfinite_flags([torch.tensor([float("nan"), 1.0]), torch.ones(2)])
        [(True, False), (False, False)]
    """
    ts = [local(t) for t in ts]
    known = [_first_is_nan(t) for t in ts]
    if _finite_together(ts, known):
        return [(nan, False) for nan in known]
    bounds = [None if nan else _bounds(t) for t, nan in zip(ts, known, strict=True)]
    present = [b for b in bounds if b is not None]
    values = iter(())
    if len(present) == 1:
        values = iter(present[0][None].tolist())
    elif present:
        values = iter(torch.stack([b.to(present[0].device, torch.float64) for b in present]).tolist())
    return [
        (True, False) if nan else (False, False) if b is None else _flags(*next(values))
        for nan, b in zip(known, bounds, strict=True)
    ]


def _finite_together(tensors: list[torch.Tensor], nan: list[bool]) -> bool:
    """Are the tensors not known to hold NaN (``nan``) CPU float tensors, all finite by one norm over them
    (``stats.total_norm``: NaN/Inf exactly when some element is)? False when that cannot be told so
    (another device, an error, fewer than two)."""
    ts = [t for t, known in zip(tensors, nan, strict=True) if not known]
    if len(ts) < 2 or not all(t.device.type == "cpu" and t.is_floating_point() for t in ts):
        return False
    try:
        return math.isfinite(total_norm(float_groups(ts)).item())
    except (RuntimeError, NotImplementedError):  # a tensor the foreach norm does not take: read one by one
        return False


def _first_is_nan(t: torch.Tensor) -> bool:
    """Is ``t`` a non-empty dense CPU float tensor whose first element is NaN?"""
    return (
        t.device.type == "cpu"
        and t.dtype in _PROBED
        and t.layout == torch.strided
        and t.numel() > 0
        and math.isnan(t.as_strided((), ()).item())
    )


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


def has_inf_created(out: torch.Tensor, inputs: Sequence[Any]) -> bool:
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


def version(t: torch.Tensor) -> int:
    """``t``'s version counter: it counts in-place writes to ``t`` and every view sharing it (-1 for none)."""
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return -1


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # wrap no other tensor


def storage_key(t: torch.Tensor) -> int:
    """The address of ``t``'s storage: views and ``.data`` aliases share it (-1 when there is none).
    A DTensor or a pending collective's result is keyed by the tensor it wraps, so taint crosses
    ``to_local``/``from_local`` and the functional collectives' wrappers."""
    if type(t) not in _PLAIN:
        while (inner := compat.inner_tensor(t)) is not None:
            t = inner
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return -1
