"""The one counter of what makes ranks or the host wait: collectives and host reads, per block.

``counting()`` counts, in this thread, while its block runs:

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
  are not collectives.
- **host reads**: ``aten._local_scalar_dense`` (``item``, ``bool``, ``float``, ``int``, ``__index__``,
  from Python or C++) by the dispatcher, and ``Tensor.tolist`` and ``Tensor.numpy`` (which read the
  storage without an op) by wrapping them; a copy from a non-CPU device to the CPU that blocks
  (``.cpu()``, ``.to("cpu")``) as ``copy_to_host``.

On CPU nanguard reads its float32 grad and parameter norms back to re-sum an overflow in float64 (a read
that costs no device sync there); on CUDA it sums in float64 and reads nothing. ``as_on_gpu()`` makes
the CPU sum as CUDA does, so a count on CPU is what a GPU run pays (``tests/test_host_reads.py``).

What it does not see: ops run on another thread than the one that entered the block (the mode is
thread-local; CPU autograd runs backward on the calling thread), and work gloo's own threads do
after the op was issued (one op is one collective, however many messages it sends).

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

    @property
    def n_collectives(self) -> int:
        return sum(self.collectives.values())

    @property
    def n_host_reads(self) -> int:
        return sum(self.host_reads.values())

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe (spawned ranks return it)."""
        return {"collectives": dict(self.collectives), "host_reads": dict(self.host_reads)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Counts:
        return cls(Counter(d["collectives"]), Counter(d["host_reads"]))


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
        if namespace in _NAMESPACES:
            name = func._overloadpacket.__name__
            if name not in _NOT_COLLECTIVES:
                self.counts.collectives[f"{namespace}.{name}"] += 1
        elif func is _SCALAR:
            self.counts.host_reads["item"] += 1
        elif func in _COPIES and _to_host(func, args, kwargs):
            self.counts.host_reads["copy_to_host"] += 1
        return func(*args, **kwargs)


def _to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """A blocking copy from an accelerator to the CPU."""
    if kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True):
        return False
    if func is _COPIES[0]:
        src, device = args[0], kwargs.get("device")
        return src.device.type != "cpu" and device is not None and torch.device(device).type == "cpu"
    dst, src = args[0], args[1]
    return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst.device.type == "cpu"


@contextlib.contextmanager
def _wrapped_reads(counts: Counts) -> Iterator[None]:
    saved = {name: getattr(torch.Tensor, name) for name in _WRAPPED}

    def wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def reading(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counts.host_reads[name] += 1
            return original(self, *args, **kwargs)

        return reading

    try:
        for name, original in saved.items():
            setattr(torch.Tensor, name, wrap(name, original))
        yield
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


@contextlib.contextmanager
def counting() -> Iterator[Counts]:
    """Count the collectives and host reads this thread makes inside the block (see the module doc)."""
    counts = Counts()
    with _wrapped_reads(counts), _Mode(counts):
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
