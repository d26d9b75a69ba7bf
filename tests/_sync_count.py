"""The one counter of what makes ranks or the host wait: collectives and host reads, per block.

``counting()`` counts, while its block runs (threads below):

- **collectives**: every op of the ``c10d`` namespace (what ``torch.distributed``'s functions and
  ``ProcessGroup``'s methods dispatch to, from Python or from C++: DDP's reducer, FSDP2's
  ``foreach_reduce``, DeepSpeed's and Megatron's calls, ``send``/``recv`` and the point-to-point
  ops of ``batch_isend_irecv``, object collectives), and every op of ``_c10d_functional`` and
  ``_c10d_functional_autograd`` (DTensor's redistributions, ``full_tensor``, functional
  collectives), by op name. It is a ``TorchDispatchMode``: it sees each op where the dispatcher runs
  it, which a wrapper of ``torch.distributed``'s Python functions cannot (the reducer never calls
  them). A DTensor op is let through to DTensor first, so the collectives it desugars into are
  counted and not the DTensor op itself. A functional collective counts once (the ``c10d`` op it
  runs inside is not counted again); ``wait_tensor``, ``_wrap_tensor_autograd`` and ``check_for_nan``
  are not collectives. DeepSpeed's shared-memory all-reduce (``torch.ops.deepspeed.inference_all_reduce_``,
  which its CPU accelerator uses for inference only) counts too.
- **host reads**: ``aten._local_scalar_dense`` (``item``, ``bool``, ``float``, ``int``, ``__index__``,
  from Python or C++) by the dispatcher, and ``Tensor.tolist`` and ``Tensor.numpy`` (which read the
  storage without an op) by wrapping them; a copy from a non-CPU device to the CPU that blocks
  (``.cpu()``, ``.to("cpu")``) as ``copy_to_host``.

On CPU nanguard reads its float32 grad and parameter norms back to re-sum an overflow in float64 (a read
that costs no device sync there); on CUDA it sums in float64 and reads nothing. ``as_on_gpu()`` makes
the CPU sum as CUDA does, so a count on CPU is what a GPU run pays (``tests/test_host_reads.py``).

Threads: the mode is thread-local, so it is entered in the calling thread and in every thread started
inside the block (OLMo-core reduces its metrics on a bookkeeping thread); CPU autograd runs backward
on the calling thread. What it does not see: ops of threads started before the block, and the work
gloo's own threads do after an op was issued (one op is one collective, however many messages).

Used by the tests (``tests/test_sync_count.py``, ``tests/test_distributed.py``, ...) and by
``benchmarks/sync_count.py`` (which puts ``tests/`` on its path, as the Megatron benchmarks do).

Example:
    >>> with counting() as c:
    ...     step()
    >>> c.collectives, c.host_reads
    (Counter({'c10d.allreduce_': 1}), Counter({'item': 1}))
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Counts", "added", "as_on_gpu", "counting"]

_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
_NOT_COLLECTIVES = frozenset({"wait_tensor", "check_for_nan", "_wrap_tensor_autograd"})
_SCALAR = torch.ops.aten._local_scalar_dense.default
_COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
_WRAPPED = ("tolist", "numpy")


@dataclass
class Counts:
    """What one ``counting()`` block saw: collectives and host reads, by name."""

    collectives: Counter[str] = field(default_factory=Counter)
    host_reads: Counter[str] = field(default_factory=Counter)
    elements: Counter[str] = field(default_factory=Counter)  # each collective's tensor elements, summed by op
    sites: Counter[str] | None = None  # with ``counting(where=True)``: "op at file:line" of each, outside torch

    def _seen(self, kind: Counter[str], name: str) -> None:
        kind[name] += 1
        if self.sites is not None:
            self.sites[f"{name} at {_site()}"] += 1

    @property
    def n_collectives(self) -> int:
        return sum(self.collectives.values())

    @property
    def n_host_reads(self) -> int:
        return sum(self.host_reads.values())

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe (spawned ranks return it)."""
        out = {
            "collectives": dict(self.collectives),
            "host_reads": dict(self.host_reads),
            "elements": dict(self.elements),
        }
        return out if self.sites is None else {**out, "sites": dict(self.sites)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Counts:
        sites = d.get("sites")
        return cls(
            Counter(d["collectives"]),
            Counter(d["host_reads"]),
            Counter(d.get("elements", {})),
            None if sites is None else Counter(sites),
        )


def added(plain: Counts | dict[str, Any], guarded: Counts | dict[str, Any], steps: int) -> dict[str, Any]:
    """Guarded minus plain, per step: totals, and each op whose count differs (by name, per step)."""
    p = plain if isinstance(plain, Counts) else Counts.from_dict(plain)
    g = guarded if isinstance(guarded, Counts) else Counts.from_dict(guarded)

    def diff(a: Counter[str], b: Counter[str]) -> dict[str, float]:
        return {k: (b[k] - a[k]) / steps for k in sorted(set(a) | set(b)) if b[k] != a[k]}

    return {
        "collectives": (g.n_collectives - p.n_collectives) / steps,
        "host_reads": (g.n_host_reads - p.n_host_reads) / steps,
        "collective_ops": diff(p.collectives, g.collectives),
        "elements": (sum(g.elements.values()) - sum(p.elements.values())) / steps,
        "host_read_kinds": diff(p.host_reads, g.host_reads),
        "plain_collectives": p.n_collectives / steps,
        "plain_host_reads": p.n_host_reads / steps,
    }


def _dtensor_type() -> type | None:
    module = sys.modules.get("torch.distributed.tensor")  # none exists unless the run imported it
    return getattr(module, "DTensor", None)


class _Mode(TorchDispatchMode):
    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        dtensor = _dtensor_type()
        if dtensor is not None and any(issubclass(t, dtensor) for t in types):
            return NotImplemented  # DTensor runs first; the ops it desugars into come back here
        namespace = func.namespace
        name = func._overloadpacket.__name__
        if namespace in _NAMESPACES or (namespace == "deepspeed" and "all_reduce" in name):
            if name not in _NOT_COLLECTIVES:
                self.counts._seen(self.counts.collectives, f"{namespace}.{name}")
                self.counts.elements[f"{namespace}.{name}"] += _numel(args[0] if args else None)
        elif func is _SCALAR:
            self.counts._seen(self.counts.host_reads, "item")
        elif func in _COPIES and _to_host(func, args, kwargs):
            self.counts._seen(self.counts.host_reads, "copy_to_host")
        return func(*args, **kwargs)


def _numel(arg: Any) -> int:
    """The elements of a collective's first argument: a tensor, or (nested) lists of them."""
    if isinstance(arg, torch.Tensor):
        return arg.numel()
    if isinstance(arg, (list, tuple)):
        return sum(_numel(a) for a in arg)
    return 0


def _to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """A blocking copy from an accelerator to the CPU."""
    if kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True):
        return False
    if func is _COPIES[0]:
        src, device = args[0], kwargs.get("device")
        return src.device.type != "cpu" and device is not None and torch.device(device).type == "cpu"
    dst, src = args[0], args[1]
    return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst.device.type == "cpu"


_READING = threading.local()  # inside a wrapped read: a ``TorchFunctionMode`` may call the wrapper again


@contextlib.contextmanager
def _wrapped_reads(counts: Counts) -> Iterator[None]:
    saved = {name: getattr(torch.Tensor, name) for name in _WRAPPED}

    def wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def reading(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if getattr(_READING, "inside", False):
                return original(self, *args, **kwargs)  # the same read, handed back by a mode: counted once
            counts._seen(counts.host_reads, name)
            _READING.inside = True
            try:
                return original(self, *args, **kwargs)
            finally:
                _READING.inside = False

        return reading

    try:
        for name, original in saved.items():
            setattr(torch.Tensor, name, wrap(name, original))
        yield
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


@contextlib.contextmanager
def _in_new_threads(counts: Counts) -> Iterator[None]:
    """Threads started inside the block count too (a mode of their own, the same counts)."""
    original = threading.Thread.run

    def run(self: threading.Thread) -> None:
        with _Mode(counts):
            original(self)

    threading.Thread.run = run  # type: ignore[method-assign]
    try:
        yield
    finally:
        threading.Thread.run = original  # type: ignore[method-assign]


def _site() -> str:
    """The innermost caller outside torch, this module and any ``TorchFunctionMode``: where the op was asked for."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        inside = f"{_SEP}torch{_SEP}" in path or path.endswith("_sync_count.py")
        if not inside and frame.f_code.co_name != "__torch_function__":
            return f"{'/'.join(path.split(_SEP)[-2:])}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


_SEP = "/"


@contextlib.contextmanager
def counting(where: bool = False) -> Iterator[Counts]:
    """Count the collectives and host reads made inside the block (see the module doc); ``where``: also
    where each was asked for (``Counts.sites``), to find what issues an added one."""
    counts = Counts(sites=Counter() if where else None)
    with _wrapped_reads(counts), _in_new_threads(counts), _Mode(counts):
        yield counts


@contextlib.contextmanager
def as_on_gpu() -> Iterator[None]:
    """Inside the block nanguard sums norms on the CPU as it does on CUDA (float64, no read back)."""
    from nanguard import stats

    saved = dict(stats._ACCUMULATE)
    stats._ACCUMULATE["cpu"] = torch.float64
    try:
        yield
    finally:
        stats._ACCUMULATE.clear()
        stats._ACCUMULATE.update(saved)
