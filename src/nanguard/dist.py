"""Rank/world helpers that work with no process group, flag agreement, replay and fingerprints.

With no process group every helper acts as a world of one, so callers never branch on
whether they run distributed.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import json
import logging
import math
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from nanguard import compat
from nanguard.agreement import STEP_PERIOD, Layout, step_slot
from nanguard.findings import Diagnosis
from nanguard.stats import local

log = logging.getLogger("nanguard")

__all__ = [
    "STEP_PERIOD",
    "CommWatch",
    "ReplicaCheck",
    "WireOverflow",
    "agree",
    "agree_flag",
    "backward_roots",
    "broadcast_state",
    "fingerprint",
    "gather_diagnosis",
    "is_distributed",
    "observing",
    "rank",
    "rank_or_none",
    "rank_zeros",
    "replay_locally",
    "replica_mismatch",
    "step_slot",
    "sum_across",
    "unobserved",
    "unwrap",
    "watch_communication",
    "world_size",
    "zero_grad",
]


def _initialized() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def is_distributed() -> bool:
    return _initialized() and tdist.get_world_size() > 1


def rank() -> int:
    return tdist.get_rank() if _initialized() else 0


def world_size() -> int:
    return tdist.get_world_size() if _initialized() else 1


def rank_or_none() -> int | None:
    """The rank under torch.distributed, or None in a plain single process."""
    return rank() if _initialized() else None


def agree(
    code: torch.Tensor, loss: torch.Tensor, grad_sq: torch.Tensor, *, sharded: bool = False, step: int | None = 0
) -> torch.Tensor:
    """One all-reduce that gives every rank the same view of the step, as a float32 device tensor
    laid out by ``agreement.Layout``: ``[code of rank 0, ..., code of rank W-1, mean loss, global
    grad norm, step slot of rank 0, ..., step slot of rank W-1]``.

    Each rank writes its own code and step slot (small ints, exact in float32; see ``step_slot``), so
    all ranks learn *which* ranks flagged and where each rank's loop is; the loss is averaged and the
    squared grad norm summed (over shards for FSDP2; over identical replicas under DDP, hence divided
    back), both over the ranks that take a step (``step`` None: a rank that has joined under DDP's
    ``join()`` and only shadows the collectives). 2 x world_size + 2 floats.
    """
    world = world_size()
    at = Layout(world)
    vec = at.vector(rank=rank() if world > 1 else 0, code=code, loss=loss, norm=grad_sq, step=step, device=loss.device)
    if world > 1:
        tdist.all_reduce(vec)
        stepping = (vec[at.steps] > 0).sum().clamp_min(1).float()
        vec[at.loss] = vec[at.loss] / stepping
        if not sharded:
            vec[at.norm] = vec[at.norm] / stepping
    vec[at.norm] = vec[at.norm].sqrt()
    return vec


def sum_across(values: torch.Tensor) -> torch.Tensor:
    """``values`` summed over every rank in place (one all-reduce; a world of one needs none).

    Example:
        >>> dist.sum_across(torch.ones(2))   # on 3 ranks
        tensor([3., 3.])
    """
    if is_distributed():
        tdist.all_reduce(values)
    return values


def agree_flag(flag: bool) -> list[int]:
    """The ranks whose ``flag`` is set, agreed by one small all-reduce (a world of one needs none)."""
    if not is_distributed():
        return [0] if flag else []
    flags = torch.zeros(world_size(), dtype=torch.int32, device=_comm_device())
    flags[rank()] = int(flag)
    tdist.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]


class CommWatch:
    """Watches this rank's gradients before they are communicated; the null version sees nothing."""

    def reset(self) -> None:
        pass

    def local_flag(self, device: torch.device) -> torch.Tensor | None:
        """Device bool: were this rank's own gradients non-finite? None when not watched.
        Reading it closes the step: the next backward's buckets start a new one."""
        return None

    def wire_flag(self, device: torch.device) -> torch.Tensor | None:
        """Device bool, after ``local_flag``: did a finite local bucket of the step overflow
        the comm hook's wire dtype (a float16 compression hook)? None when not watched."""
        return None

    def overflowed(self) -> WireOverflow | None:
        """On a trip only (host reads): the step's buckets that overflowed the wire dtype."""
        return None

    rides = False
    """Can the guard's extras ride in this watch's gradient all-reduce (see ``ride``)?"""

    @contextlib.contextmanager
    def ride(self, extras: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
        """While open, the step's last gradient bucket may carry ``extras(pre_comm_flag)`` (float32,
        ``2 * world_size + 2`` values) in its own all-reduce; ``carried`` then returns their sum."""
        yield

    def carried(self) -> torch.Tensor | None:
        """The extras summed over ranks by the step's gradient all-reduce (``summed``; else this rank's
        own, which only poisoned the bucket), then 1.0 when an averaged gradient bucket was non-finite
        (else 0.0); once. None when they did not ride (then the caller agrees by its own collective)."""
        return None

    summed = True
    """Were the extras ``carried`` returned last summed over ranks? False when they were this rank's own
    and reached the others only as a NaN poisoning its bucket (``DDPCommWatch._poison``)."""


@dataclass(frozen=True)
class WireOverflow:
    """This rank's gradient buckets whose finite values overflowed a compression hook's dtype."""

    hook: str
    dtype: str
    parameters: list[str]
    absmax: float


class DDPCommWatch(CommWatch):
    """Wraps a DDP comm hook: each local bucket is summed in float32 before it is sent.

    A finite sum proves the bucket finite, so one small reduction per bucket, accumulated
    on the device, says whether *this* rank's gradients held NaN/Inf before averaging
    spread them to every rank. No host sync. Under a compression hook (float16/bfloat16 on
    the wire) each bucket's absmax is kept too: cast to the wire dtype, a finite absmax that
    becomes Inf means the hook's cast, not this rank's compute, made the Inf. While
    ``local`` is set (a replay) the hook sends nothing and returns this rank's own bucket,
    whatever the loop does to ``require_backward_grad_sync``.

    Riding (DDP's default all-reduce only): inside ``ride``, the last bucket of the backward
    (``bucket.is_last()``: DDP sends buckets in order, so every bucket's local sum is in by then)
    carries the guard's extras (one-hot flag slots, loss, step slots; ``agreement.Layout``) with no
    added collective. On 2 ranks they ride in the bucket's own payload, where every element sums two
    terms, the same bits in either order (``_ride``). On 3 or more (or a float16/bfloat16 bucket) a
    longer payload would move gloo's ring chunks and with them the last bit of the averaged
    gradients, so the extras poison instead (``_poison``): a rank whose own flags are set writes a NaN
    into its bucket, and the averaged bucket is non-finite on every rank exactly when some rank
    flagged; the extras stay this rank's own (``summed`` False), summed only on such a step. The
    gradient part is divided by the world first, as DDP's built-in all-reduce does, so gradients
    come out as without the guard. Two cases keep the summed extras every step, in one small
    all-reduce beside the bucket's on 3 or more ranks: a policy that acts on the mean loss
    (``agree_loss``: ``skip_spikes``) and DDP's ``join()`` (a joined rank's shadow must match a
    payload it cannot foresee). Which path a step takes depends only on whether DDP ran this hook
    (on every rank or none), the world, the bucket's dtype and the guard's configuration (the same
    on every rank), so all ranks take the same path. A user hook (whose wire format is its own)
    does not ride. Each bucket's averaged result is summed too: it is the same on every rank,
    so a non-finite average (say, corrupted in transit) is known alike everywhere.
    """

    def __init__(self, ddp: nn.parallel.DistributedDataParallel, hook: Callable[..., Any], state: Any) -> None:
        self._acc: torch.Tensor | None = None
        self.local = False
        self.hook_name = getattr(hook, "__qualname__", type(hook).__name__)
        self.wire = _wire_dtype(hook)
        self._names = {id(p): n for n, p in unwrap(ddp).named_parameters()}
        self._buckets: list[tuple[torch.Tensor, list[str]]] = []
        self._measured: list[tuple[torch.Tensor, list[str]]] = []
        self._extras: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._carried: torch.Tensor | None = None
        self._received: list[torch.Tensor] = []  # appended by the futures' callbacks
        self._ddp = weakref.ref(ddp)
        self.agree_loss = False
        """Does the guard's policy act on the mean loss (``skip_spikes``)? Then, on 3 or more ranks, the
        extras keep their own all-reduce beside the last bucket's, which sums the loss."""
        self.shadowing: Callable[[], torch.Tensor] | None = None
        """Set while a joined rank's DDP join hook shadows a backward: the extras its last bucket sends."""
        group = (state if state is not None else tdist.group.WORLD) if hook is _default_hook() else None
        same_slots = group is not None and group.size() == world_size() and tdist.get_rank(group) == rank()
        self.rides = same_slots  # the extras' slots are indexed by global rank
        # The world group is named by None: a reference kept here would outlive
        # destroy_process_group() and be torn down with the interpreter.
        self._group = None if group is None or group == tdist.group.WORLD else group
        self._size = group.size() if group is not None else 1
        # DDP's built-in all-reduce (no hook) scales each bucket by 1 / world before sending; torch's
        # Python ``allreduce_hook`` divides instead, which rounds differently when the world is not a
        # power of two: the guard sends as the built-in does, so a guarded run equals an unguarded one.
        self._inner = self._builtin if hook is _default_hook() else hook

        # DDP inspects a hook's annotations and accepts only GradBucket/Future or none.
        def watched(state, bucket):
            return self._on_bucket(state, bucket)

        watched.__qualname__ = f"nanguard_watch({self.hook_name})"
        ddp.register_comm_hook(state, watched)
        _WATCHES[ddp] = self

    def _on_bucket(self, state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        """One bucket through the watch: summed (and its absmax kept under a compression hook), then sent
        as the hook sends it, the last one carrying the guard's extras (``_ride``, ``_poison``) when they ride."""
        if self.local:
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done
        buffer = bucket.buffer()
        part = buffer.sum(dtype=torch.float32)
        self._acc = part if self._acc is None else self._acc + part
        if self.wire is not None:
            names = [self._names.get(id(p), "?") for p in bucket.parameters()]
            self._buckets.append((torch.linalg.vector_norm(buffer, ord=math.inf).float(), names))
        is_last = self.rides and bucket.is_last()
        last = is_last and _exact(buffer)
        if self.shadowing is not None:  # a joined rank's zero buckets, shadowing the others' backward
            return self._ride(buffer, self.shadowing(), keep=True) if last else self._relay(self._inner(state, bucket))
        if self._extras is not None and is_last and self._poisons(buffer):
            return self._poison(buffer, self._extras(~torch.isfinite(self._acc)))
        if self._extras is None or not self.rides:
            return self._unridden(state, bucket, last=last)
        if last:
            return self._ride(buffer, self._extras(~torch.isfinite(self._acc)), keep=True)
        return self._relay(self._inner(state, bucket))

    def _unridden(self, state: Any, bucket: Any, *, last: bool) -> torch.futures.Future[torch.Tensor]:
        """A bucket sent without the guard's extras: as the hook sends it, but under ``join()`` the last
        one with the extras' room (a joined rank's shadow cannot know whether the others ride, so they
        always make room)."""
        if last and self._join_enabled():
            buffer = bucket.buffer()
            return self._ride(buffer, buffer.new_zeros(Layout(world_size()).size), keep=False)
        return self._inner(state, bucket)

    def _builtin(self, state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        buffer.mul_(1.0 / self._size)
        fut = tdist.all_reduce(buffer, group=self._group, async_op=True).get_future()
        return fut.then(lambda done: done.value()[0])

    def _poisons(self, buffer: torch.Tensor) -> bool:
        """Does the last bucket carry the flags by poisoning (``_poison``) rather than in its payload?
        Where the payload cannot ride exactly: 3 or more ranks, or a bucket whose dtype would round the
        loss. Not under ``join()``, whose joined rank's shadow must match the payload it cannot foresee."""
        if self.agree_loss:
            return False  # the policy acts on the mean loss: it rides (2 ranks), goes beside, or agrees apart
        return (self._size > 2 or not _exact(buffer)) and buffer.numel() > 0 and not self._join_enabled()

    def _poison(self, buffer: torch.Tensor, extras: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """The last bucket as DDP's built-in all-reduce sends it, except that a rank whose own flags are
        set (its loss or its own gradients non-finite, its parameters as updated or loaded) writes a NaN
        into the bucket's first element first: the averaged bucket is then non-finite on every rank exactly
        when some rank flagged, with no value added to the wire. A healthy rank's bucket is left as it is
        (``masked_fill_`` with a false mask writes nothing), so a healthy run is the unguarded one bit for
        bit. The extras stay this rank's own (``summed`` False): gathered only on a step that tripped."""
        own_flagged = extras[Layout(world_size()).codes].amax() > 0
        buffer.mul_(1.0 / self._size)
        buffer[:1].masked_fill_(own_flagged, math.nan)
        fut = tdist.all_reduce(buffer, group=self._group, async_op=True).get_future()

        def unpack(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            done.value()  # raises a failed all-reduce's error here
            self._received.append(buffer.sum(dtype=torch.float32))
            self._carried, self.summed = extras.float(), False
            return buffer

        return fut.then(unpack)

    def _join_enabled(self) -> bool:
        ddp = self._ddp()
        return ddp is not None and compat.ddp_join_enabled(ddp)

    def _ride(self, buffer: torch.Tensor, extras: torch.Tensor, *, keep: bool) -> torch.futures.Future[torch.Tensor]:
        """The last bucket's all-reduce with the guard's extras summed: in one payload on 2 ranks, where
        every element is the sum of two terms, the same bits in either order; on 3 or more (``agree_loss``,
        ``join()``), in one small all-reduce of their own right after the bucket's, which is then reduced
        exactly as without the guard (a longer payload moves gloo's ring chunks, and with them the order
        of each element's terms: the last bit of the averaged gradients would change)."""
        if self._size > 2:
            return self._beside(buffer, extras, keep=keep)
        n = buffer.numel()
        payload = buffer.new_empty(n + extras.numel())
        torch.mul(buffer, 1.0 / self._size, out=payload[:n])  # averaged first, as DDP's built-in does
        payload[n:] = extras
        fut = tdist.all_reduce(payload, group=self._group, async_op=True).get_future()

        def unpack(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            out = done.value()[0]
            buffer.copy_(out[:n])
            self._received.append(buffer.sum(dtype=torch.float32))
            if keep:
                self._carried, self.summed = out[n:].float(), True
            return buffer

        return fut.then(unpack)

    def _beside(self, buffer: torch.Tensor, extras: torch.Tensor, *, keep: bool) -> torch.futures.Future[torch.Tensor]:
        """The bucket as DDP's built-in all-reduce sends it, then the extras in their own all-reduce."""
        buffer.mul_(1.0 / self._size)
        sent = tdist.all_reduce(buffer, group=self._group, async_op=True).get_future()
        riding = extras.to(buffer.dtype).clone()
        side = tdist.all_reduce(riding, group=self._group, async_op=True).get_future()

        def unpack(done: torch.futures.Future[list[torch.futures.Future[Any]]]) -> torch.Tensor:
            for part in done.value():
                part.value()  # raises a failed all-reduce's error here
            self._received.append(buffer.sum(dtype=torch.float32))
            if keep:
                self._carried, self.summed = riding.float(), True
            return buffer

        return torch.futures.collect_all([sent, side]).then(unpack)

    def _relay(self, sent: torch.futures.Future[torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
        return sent.then(self._receive)

    def _receive(self, done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        out = done.value()
        self._received.append(out.sum(dtype=torch.float32))
        return out

    @contextlib.contextmanager
    def ride(self, extras: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
        self._extras, self._carried, self._received = extras, None, []
        try:
            yield
        finally:
            self._extras = None

    def carried(self) -> torch.Tensor | None:
        carried, self._carried = self._carried, None
        received, self._received = self._received, []
        if carried is None:
            return None
        bad = ~torch.isfinite(torch.stack([r.to(carried.device) for r in received]).sum())
        return torch.cat([carried, bad.float().reshape(1)])

    def reset(self) -> None:
        self._acc = None
        self._buckets = []
        self._carried = None
        self._received = []

    def local_flag(self, device: torch.device) -> torch.Tensor | None:
        acc, self._acc = self._acc, None
        self._measured, self._buckets = self._buckets, []
        if acc is None:
            return torch.zeros((), dtype=torch.bool, device=device)
        return ~torch.isfinite(acc.to(device))

    def wire_flag(self, device: torch.device) -> torch.Tensor | None:
        if self.wire is None:
            return None
        if not self._measured:
            return torch.zeros((), dtype=torch.bool, device=device)
        absmax = torch.stack([a for a, _ in self._measured]).to(device)
        return (torch.isfinite(absmax) & ~torch.isfinite(absmax.to(self.wire))).any()

    def overflowed(self) -> WireOverflow | None:
        if self.wire is None:
            return None
        bad = [
            (float(a), names)  # a trip: host reads are fine here
            for a, names in self._measured
            if bool(torch.isfinite(a) & ~torch.isfinite(a.to(self.wire)))
        ]
        if not bad:
            return None
        params = [n for _, names in bad for n in names]
        return WireOverflow(self.hook_name, str(self.wire).removeprefix("torch."), params, max(a for a, _ in bad))


def _exact(buffer: torch.Tensor) -> bool:
    """A bucket whose dtype holds the riding loss exactly (float16/bfloat16 would round it)."""
    return buffer.dtype in (torch.float32, torch.float64)


def _default_hook() -> Callable[..., Any]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook


def _wire_dtype(hook: Callable[..., Any]) -> torch.dtype | None:
    """The dtype a known compression hook sends gradients in; None for any other hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    wires = {default_hooks.fp16_compress_hook: torch.float16, default_hooks.bf16_compress_hook: torch.bfloat16}
    return wires.get(hook)


_WATCHES: weakref.WeakKeyDictionary[nn.Module, DDPCommWatch] = weakref.WeakKeyDictionary()
"""The watch on each guarded DDP model, so a replay can turn its communication off."""


def watch_communication(model: nn.Module, comm_hook: tuple[Any, Callable[..., Any]] | None = None) -> CommWatch:
    """Install the pre-communication check on a DDP model.

    ``comm_hook`` is ``(state, hook)`` for a custom DDP comm hook: pass it here instead of
    calling ``register_comm_hook`` yourself, since DDP takes only one hook and the guard's
    wraps yours. Without one the guard wraps DDP's default all-reduce. A hook registered
    before the guard cannot be wrapped: attribution then falls back to the local loss.
    """
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        if comm_hook is not None:
            raise ValueError("comm_hook is for DistributedDataParallel models only")
        return CommWatch()
    if compat.ddp_has_comm_hook(model):
        warnings.warn(
            "nanguard: this DDP model already has a comm hook, which cannot be wrapped; pass it as "
            "Guard(..., comm_hook=(state, hook)) instead. Rank attribution falls back to the local loss.",
            stacklevel=3,
        )
        return CommWatch()
    if comm_hook is None:
        comm_hook = (model.process_group, _default_hook())
    state, hook = comm_hook
    return DDPCommWatch(model, hook, state)


@dataclass(frozen=True)
class ReplicaCheck:
    """What a fingerprint comparison across ranks found.

    Example:
        >>> check = replica_mismatch(model)
        >>> check.ranks, check.source, check.nonfinite_ranks
        ([0], 1, [0])
    """

    ranks: list[int] = field(default_factory=list)
    """Ranks whose parameters are non-finite or differ from the source's."""
    first_parameter: str | None = None
    """The first parameter (in ``named_parameters`` order) where a rank differs from the source."""
    source: int | None = None
    """The rank to resync from: the lowest rank holding the majority digest among the ranks
    whose parameters are all finite; None when no rank is finite."""
    nonfinite_ranks: list[int] = field(default_factory=list)
    """Ranks whose parameters hold NaN/Inf."""


def replica_mismatch(model: nn.Module) -> ReplicaCheck:
    """Compare a per-parameter fingerprint across ranks and pick a rank to resync from.

    One all-gather of two float64 per rank (all parameters finite?, a weighted sum of
    parameter norms); only when they differ are the full per-parameter vectors gathered to
    name the first parameter that differs. A non-finite rank is never the source, so a
    resync never copies NaN/Inf onto a healthy replica.
    """
    if not is_distributed():
        return ReplicaCheck()
    inner = unwrap(model)
    if any(local(p) is not p for p in inner.parameters()):
        return ReplicaCheck()  # sharded (FSDP2): ranks hold different shards by design
    norms = torch.tensor(fingerprint(inner), dtype=torch.float64)
    rows = _gathered_digests(norms)
    nonfinite = [r for r, (ok, _) in enumerate(rows) if not ok]
    digests = {r: d for r, (ok, d) in enumerate(rows) if ok}
    if not nonfinite and len(set(digests.values())) == 1:
        return ReplicaCheck()
    source = _majority(digests)
    differ = sorted(nonfinite + [r for r, d in digests.items() if source is not None and d != digests[source]])
    first = _first_difference(norms, source)
    names = [n for n, _ in inner.named_parameters()]
    return ReplicaCheck(differ, names[first] if first is not None else None, source, nonfinite)


def _gathered_digests(norms: torch.Tensor) -> list[list[float]]:
    """Every rank's (all parameters finite?, a weighted sum of its parameter norms): one all-gather."""
    weights = torch.arange(1, len(norms) + 1, dtype=torch.float64)
    finite = bool(torch.isfinite(norms).all())  # a norm is finite exactly when its tensor is
    mine = torch.stack([torch.tensor(float(finite), dtype=torch.float64), (norms * weights).sum()])
    mine = mine.to(_comm_device())
    gathered = [torch.zeros_like(mine) for _ in range(world_size())]
    tdist.all_gather(gathered, mine)
    return [g.tolist() for g in gathered]


def _majority(digests: dict[int, float]) -> int | None:
    """The lowest rank holding the digest most finite ranks hold (ties: the one a lower rank holds)."""
    if not digests:
        return None
    counts = Counter(digests.values())
    majority = max(counts, key=lambda d: (counts[d], -min(r for r, v in digests.items() if v == d)))
    return min(r for r, d in digests.items() if d == majority)


def _first_difference(norms: torch.Tensor, source: int | None) -> int | None:
    """The first parameter whose norm differs between some rank and ``source`` (rank 0 without one):
    one all-gather of every rank's per-parameter norms. NaN != NaN, so a non-finite one always differs."""
    device = _comm_device()
    full = [torch.zeros_like(norms.to(device)) for _ in range(world_size())]
    tdist.all_gather(full, norms.to(device))
    rows = [f.tolist() for f in full]
    ref = rows[source if source is not None else 0]
    return next((i for i in range(len(ref)) if any(f[i] != ref[i] for f in rows)), None)


def broadcast_state(model: nn.Module, src: int) -> None:
    """Make every replica equal to rank ``src``'s parameters and buffers."""
    if not is_distributed():
        return
    with torch.no_grad():
        for t in list(unwrap(model).parameters()) + list(unwrap(model).buffers()):
            tdist.broadcast(t.data, src)


def zero_grad(model: Any) -> None:
    """``model.zero_grad(set_to_none=True)``, or ``model.zero_grad()`` where it takes no ``set_to_none``
    (DeepSpeed's engine, older wrappers, which drop the gradients themselves).

    Example:
        >>> zero_grad(engine)   # DeepSpeedEngine.zero_grad(self)
    """
    method = model.zero_grad
    if _takes_set_to_none(getattr(method, "__func__", method)):
        model.zero_grad(set_to_none=True)
    else:
        model.zero_grad()


@functools.lru_cache(maxsize=64)
def _takes_set_to_none(fn: Callable[..., Any]) -> bool:
    """Does ``fn`` take a ``set_to_none`` argument (by name, or through ``**kwargs``)? Read once per function."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read: call it plainly
        return False
    return any(p.name == "set_to_none" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP/DataParallel wrappers, so names match theirs."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


@contextlib.contextmanager
def _no_grad_sync(model: nn.Module) -> Iterator[None]:
    if isinstance(model, nn.parallel.DistributedDataParallel):
        watch = _WATCHES.get(model)
        if watch is not None:
            watch.local = True
        try:
            paused = compat.ddp_sync_pinned_off(model), compat.ddp_join_paused(model)
            with model.no_sync(), paused[0], paused[1], _local_collectives():
                yield
        finally:
            if watch is not None:
                watch.local = False
                watch.reset()  # nothing the replay did may reach the next step's check
        return
    if compat.replicated(model):  # composable replicate (OLMo-core's DDP): its own switch
        with compat.replicate_sync_off(model), _local_collectives():
            yield
        return
    setter = getattr(model, "set_requires_gradient_sync", None)  # FSDP2 fully_shard
    if callable(setter):
        setter(False)
        try:
            with compat.fsdp_sync_pinned_off(model):
                yield
        finally:
            setter(True)
            compat.drop_fsdp_accumulated_grads(model)
        return
    with _local_collectives():
        yield


class _Done:
    """A finished ``Work`` for the local stand-ins of ``async_op=True`` collectives."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    for out in outputs:
        out.copy_(tensor)
    return _Done() if kwargs.get("async_op") else None


def _all_gather_into_tensor(output: torch.Tensor, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    output.copy_(tensor.reshape(1, -1).expand(output.numel() // max(tensor.numel(), 1), -1).reshape(output.shape))
    return _Done() if kwargs.get("async_op") else None


def _reduce_scatter_tensor(output: torch.Tensor, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    output.copy_(tensor.reshape(-1)[rank() * output.numel() : (rank() + 1) * output.numel()].reshape(output.shape))
    return _Done() if kwargs.get("async_op") else None


def _in_place(*args: Any, **kwargs: Any) -> Any:
    return _Done() if kwargs.get("async_op") else None


_LOCAL_STAND_INS: dict[str, Callable[..., Any]] = {
    "all_reduce": _in_place,
    "broadcast": _in_place,
    "barrier": _in_place,
    "all_gather": _all_gather,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
}


@contextlib.contextmanager
def _local_collectives() -> Iterator[None]:
    """In a hand-written data-parallel loop the closure itself all-reduces: during the replay
    ``torch.distributed``'s collectives act on this rank's values alone, so a rank sees only
    what its own data and compute make (sums become this rank's term; finiteness is what counts)."""
    if not is_distributed():
        yield
        return
    with compat.swap_collectives(_LOCAL_STAND_INS):
        yield


@contextlib.contextmanager
def backward_roots(through: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Iterator[list[torch.Tensor]]:
    """Record the tensors ``backward`` is called on (``Tensor.backward`` goes through
    ``torch.autograd.backward``) while open: the loss, before any comm hook runs. ``through``: the
    backward runs from ``through(root)`` instead of each root (the roots recorded are the loop's own).

    Example:
        >>> with backward_roots() as roots:
        ...     loss.backward()
        >>> roots[0] is loss
        True
    """
    roots: list[torch.Tensor] = []
    original = torch.autograd.backward

    def recording(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        mine = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        roots.extend(mine)
        if through is not None:
            tensors = [through(t) for t in mine] if not isinstance(tensors, torch.Tensor) else through(tensors)
        return original(tensors, *args, **kwargs)

    torch.autograd.backward = recording
    try:
        yield roots
    finally:
        torch.autograd.backward = original


_UNOBSERVED: list[list[str]] = []


def unobserved(what: str) -> None:
    """Say, from inside a replay, that it could not observe ``what`` the step did (its backward,
    a part of the model): a finite replay then proves nothing about the hardware."""
    if _UNOBSERVED and what not in _UNOBSERVED[-1]:
        _UNOBSERVED[-1].append(what)


@contextlib.contextmanager
def observing() -> Iterator[list[str]]:
    """Collect what a replay run inside the block says it could not observe (``unobserved``).

    Example:
        >>> with observing() as gaps:
        ...     replay()
        >>> gaps
        ['the backward: the loss is computed outside the model']
    """
    gaps: list[str] = []
    _UNOBSERVED.append(gaps)
    try:
        yield gaps
    finally:
        _UNOBSERVED.pop()


def replay_locally(model: nn.Module, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` with gradient communication off, so a rank sees only its own data and compute."""
    with _no_grad_sync(model):
        return fn()


_SHARED = itertools.count()  # the n-th value shared in this process: ranks ask in the same order


def rank_zeros(make: Callable[[], str], *, timeout: float = 60.0) -> str:
    """``make()`` as rank 0 made it, on every rank that asks: through the process group's store, not a
    collective, so a rank that does not ask (no ``run_dir`` there) holds no one up. Without a process
    group, or when rank 0's value has not come within ``timeout`` seconds, this rank's own ``make()``.

    Example:
        >>> run_id = dist.rank_zeros(new_run_id)   # the same id on every rank
    """
    n = next(_SHARED)
    if not is_distributed():
        return make()
    key = f"nanguard/shared/{n}"
    try:
        store = compat.default_store()
        if rank() == 0:
            value = make()
            store.set(key, value)
            return value
        store.wait([key], timedelta(seconds=timeout))
        return bytes(store.get(key)).decode()
    except Exception as err:  # the value is a label: never worth a hang or a crash
        log.warning("nanguard: rank %d could not read rank 0's value %s (%r); using its own", rank(), key, err)
        return make()


def _all_gather_bytes(payload: bytes, device: torch.device) -> list[bytes]:
    """All-gather variable-length bytes as uint8 tensors: no pickle crosses the wire."""
    world = tdist.get_world_size()
    data = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        if payload
        else torch.zeros(0, dtype=torch.uint8, device=device)
    )
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    tdist.all_gather(sizes, size)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    chunks = [torch.zeros_like(padded) for _ in range(world)]
    tdist.all_gather(chunks, padded)
    return [bytes(c[: int(s)].cpu().tolist()) for c, s in zip(chunks, sizes, strict=True)]


def _comm_device() -> torch.device:
    if tdist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_diagnosis(
    diag: Diagnosis | None, flagged: list[int], choose: Callable[[dict[int, Diagnosis], list[int]], Any] | None = None
) -> Diagnosis | None:
    """Combine each rank's local replay into one diagnosis every rank agrees on.

    ``rank`` is the originating rank: the first rank whose own replay reproduces the fault,
    preferring ranks that flagged it; ``ranks`` are all ranks that reproduce it. None when
    no rank reproduces it (a transient fault). ``choose(per_rank, flagged)`` may pick instead,
    for ranks that replayed communicating: a result with ``rank`` and ``ranks`` (``rank`` None:
    no rank made it), or None to leave the choice to the rule above.
    """
    if not is_distributed():
        return diag
    payload = json.dumps(diag.to_dict()).encode() if diag is not None else b""
    gathered = _all_gather_bytes(payload, _comm_device())
    local = {r: Diagnosis.from_dict(json.loads(p)) for r, p in enumerate(gathered) if p}
    if not local:
        return None
    reproducing = sorted(local)
    origin = next((r for r in reproducing if r in flagged), reproducing[0])
    picked = choose(local, flagged) if choose is not None else None
    if picked is not None:
        if picked.rank is None:
            return None
        origin, reproducing = picked.rank, picked.ranks
    chosen = local[origin]
    received = {"received_ranks": [r for r in sorted(local) if r not in picked.ranks]} if picked is not None else {}
    evidence = {
        **chosen.evidence,
        **received,
        "flagged_ranks": flagged,
        "per_rank_causes": {str(r): d.cause for r, d in local.items()},
    }
    return replace(chosen, rank=origin, ranks=reproducing, evidence=evidence)


def fingerprint(model: nn.Module) -> list[float]:
    """A cheap per-parameter fingerprint: the L2 norm of each parameter, in float64."""
    params = [local(p).detach() for p in unwrap(model).parameters()]
    if not params:
        return []
    norms = compat.foreach_norm(params, 2.0, dtype=torch.float32)
    return torch.stack([n.to(norms[0].device) for n in norms]).double().cpu().tolist()
