"""Communication inside a traced step: a collective carries values between ranks, it never
creates one.

Under tensor parallelism (DTensor) and pipeline parallelism a rank cannot replay its step
alone: its forward needs the other ranks' partial sums or activations. So every rank replays
together and the tracer sees the local shards' ops along with torch.distributed's own: the
``c10d`` ops (send, recv_, allreduce_, the process-group collectives) and the functional
collectives DTensor redistributes with (all_reduce, wait_tensor, _wrap_tensor_autograd, ...).

``Communication`` handles those ops for the tracer. A collective's outputs are not read when
it is issued (an asynchronous result is not there yet); they carry the taint of what this rank
sent, and a non-finite value that shows up in them when nothing non-finite was sent *arrived*
from another rank: an origin of category ``"comm"``, ranked after every local one. ``choose``
then agrees across ranks on the rank whose own compute created the value.

Example:
    >>> comm = Communication()
    >>> is_comm(torch.ops._c10d_functional.all_reduce.default)
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nanguard import compat
from nanguard.findings import Diagnosis
from nanguard.tracer import ops
from nanguard.tracer.taint import TaintMap, storage_key, version
from nanguard.tree import op_leaves

__all__ = ["Choice", "Communication", "Sent", "choose", "is_comm"]

_COMM: dict[Any, bool] = {}
_Where = Callable[[], tuple[str | None, str]]
_NONE: frozenset[int] = frozenset()


def is_comm(func: Any) -> bool:
    """Is ``func`` (an op overload) communication between ranks?"""
    known = _COMM.get(func)
    if known is None:
        known = _COMM[func] = getattr(func, "namespace", None) in compat.COMM_NAMESPACES
    return known


@dataclass(frozen=True)
class Sent:
    """A collective this rank took part in, as its outputs remember it."""

    op: str
    module: str | None
    phase: str
    index: int
    taint: frozenset[int]
    """The origins behind what this rank itself sent (empty: it sent finite values)."""


class Communication:
    """The tracer's handling of communication ops; ``ops`` counts those seen."""

    def __init__(self) -> None:
        self.ops = 0
        # Held until the trace ends, so no later tensor can reuse an address or an id seen here.
        self._by_id: dict[int, tuple[torch.Tensor, Sent]] = {}
        self._by_storage: dict[int, Sent] = {}

    def run(self, func: Any, args: tuple, kwargs: dict, taint: TaintMap, index: int, where: _Where) -> Any:
        """Run the communication op ``func``; remember its outputs (and the tensors it writes) as
        results of this collective. ``where()`` gives the module and phase it runs in."""
        self.ops += 1
        flat = op_leaves((args, kwargs))
        sent, chained = _NONE, None
        for x in flat:
            if isinstance(x, torch.Tensor):
                pending = self.sent(x)
                if pending is not None:
                    chained = chained or pending  # a wait or a wrapper of an earlier collective
                    sent = sent | pending.taint
                else:
                    sent = sent | _known_taint(taint, x)
        out = func(*args, **kwargs)
        if chained is not None:
            info = Sent(chained.op, chained.module, chained.phase, chained.index, sent)
        else:
            module, phase = where()
            info = Sent(ops.op_name(func), module, phase, index, sent)
        results = [o for o in op_leaves(out) if isinstance(o, torch.Tensor)]
        for t in results + compat.written_tensors(func, args, kwargs):
            self._remember(t, info, taint)
        return out

    def sent(self, t: torch.Tensor) -> Sent | None:
        """The collective whose result ``t`` is (or views, or wraps), else None."""
        entry = self._by_id.get(id(t))
        if entry is not None and entry[0] is t:
            return entry[1]
        return self._by_storage.get(storage_key(t)) if self._by_storage else None

    def _remember(self, t: torch.Tensor, info: Sent, taint: TaintMap) -> None:
        self._by_id[id(t)] = (t, info)
        key = storage_key(t)
        self._by_storage[key] = info
        # Read on first use, when the values have arrived; until then only what was sent is known.
        taint.status.pop(id(t), None)
        if info.taint:
            taint.storage[key] = info.taint
        else:
            taint.storage.pop(key, None)


def _known_taint(taint: TaintMap, t: torch.Tensor) -> frozenset[int]:
    """The taint the tracer already knows for ``t`` (never a fresh read: a buffer a collective is
    about to fill holds whatever memory it got)."""
    entry = taint.status.get(id(t))
    if entry is not None and entry[0]() is t and entry[1] == version(t):
        return entry[4] if entry[2] or entry[3] else _NONE
    return taint.storage.get(storage_key(t), _NONE)


@dataclass(frozen=True)
class Choice:
    """The ranks that created the step's first non-finite value, by the ranks' own compute."""

    rank: int | None
    """The origin rank; None when no rank created it (it appeared in communication)."""
    ranks: list[int]


_PHASE_ORDER = {"data": 0, "parameters": 0, "forward": 1, "backward": 2}


def arrived(diag: Diagnosis) -> bool:
    """Did this rank's first non-finite value arrive through a collective?"""
    return bool(diag.evidence.get("communication", {}).get("arrived"))


def choose(local: Mapping[int, Diagnosis], flagged: list[int]) -> Choice | None:
    """The origin rank(s) among ranks that replayed together, communicating; None when no rank's
    replay communicated (each replayed alone: every rank that reproduces it created it).

    A rank whose value arrived through a collective is downstream. Among the ranks that created
    one locally: under pipeline parallelism (``evidence["stage"]``) the first in the data's path,
    forward stages in order, then backward stages in reverse; otherwise (tensor parallel, every
    rank running the same ops) the earliest creation, and ``ranks`` all ranks that made it at that
    same op. A flagged rank is preferred among equals.

    Example:
        >>> choose({0: made_by_sqrt, 1: arrived_in_all_reduce}, flagged=[0, 1])
        Choice(rank=0, ranks=[0])
    """
    if not any(d.evidence.get("communication", {}).get("collectives") for d in local.values()):
        return None
    creators = {r: d for r, d in local.items() if not arrived(d)}
    if not creators:
        return Choice(None, [])

    def place(r: int) -> tuple[int, int]:
        d = creators[r]
        stage = d.evidence.get("stage")
        phase = _PHASE_ORDER.get(str(d.evidence.get("origin", {}).get("phase", d.phase)), 1)
        if stage is not None:
            index = int(stage.get("index", 0))
            return phase, index if phase < 2 else -index
        return phase, int(d.evidence["communication"].get("index", 0))

    first = min(place(r) for r in creators)
    ranks = sorted(r for r in creators if place(r) == first)
    return Choice(next((r for r in ranks if r in flagged), ranks[0]), ranks)
