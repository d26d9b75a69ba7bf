"""megatron-core on CPU, in the test process only: the shim its CUDA-only calls need.

megatron-core builds its buffers on ``torch.cuda.current_device()``, calls ``.cuda()`` and
``pin_memory``, opens CUDA streams and events, keeps its model-parallel RNG in the CUDA generator
and asserts ``param.grad.type() == 'torch.cuda.FloatTensor'`` before clipping. ``install()`` maps all
of that onto the CPU for this process: a ``TorchFunctionMode`` sends every ``cuda`` device (or a bare
device index) to ``cpu``, the ``torch.cuda`` calls it makes become no-ops or CPU equivalents, its CUDA
RNG state is the CPU generator's, and ``Tensor.type()`` names CPU tensors as their CUDA types.
Nothing in site-packages is edited; nanguard's own code never sees the shim.

Example:
    >>> from _megatron_cpu import install
    >>> install()                       # before importing megatron.core
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["install"]

_installed = False


def _cpu(device: Any) -> Any:
    """A CUDA device (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda")``, a bare index) as ``cpu``."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _OnCpu(TorchFunctionMode):
    """Every torch call with a CUDA ``device=`` (or ``tensor.to("cuda")``) placed on the CPU."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if kwargs.pop("pin_memory", None):
            pass
        if func in _TO and args:
            args = (args[0], *(_cpu(a) for a in args[1:]))
        elif func in _CUDA or func is torch.Tensor.pin_memory:
            return args[0]
        return func(*args, **kwargs)


_TO = {torch.Tensor.to}
_CUDA = {torch.Tensor.cuda}

_CUDA_TYPES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
}


class _Stream:
    """A CUDA stream or event that does nothing: CPU work is ordered already."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _Stream:
        return _Stream()

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        pass

    def elapsed_time(self, other: Any) -> float:
        return 0.0


@contextlib.contextmanager
def _stream(stream: Any = None) -> Iterator[None]:
    yield


def install() -> None:
    """Put megatron-core's CUDA calls on the CPU for this process (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    cuda: Any = torch.cuda
    cuda.current_device = lambda: 0
    cuda.device_count = lambda: 1
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.Stream = _Stream
    cuda.Event = _Stream
    cuda.current_stream = lambda device=None: _Stream()
    cuda.default_stream = lambda device=None: _Stream()
    cuda.stream = _stream
    cuda.set_stream = lambda stream: None
    cuda.manual_seed = lambda seed: None  # Megatron seeds its "CUDA" RNG: the CPU generator, seeded by the test
    cuda.manual_seed_all = lambda seed: None
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    original_type = torch.Tensor.type

    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPES:
            return _CUDA_TYPES[self.dtype]
        return original_type(self, dtype, non_blocking, **kwargs) if dtype is not None else original_type(self)

    torch.Tensor.type = type_  # type: ignore[method-assign,assignment]
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    _OnCpu().__enter__()  # for the rest of this process
