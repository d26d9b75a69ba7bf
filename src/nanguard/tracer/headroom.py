"""Overflow headroom: how close float16/bfloat16 op outputs inside each module come to the
dtype's largest finite value.

Every op output is seen, not only module outputs: attention scores computed inside an
attention module count for that module. Only values an op computed are read: an allocation no
op has written yet (``empty_like``, as dropout's mask starts; an ``out=`` buffer; ``resize_``),
anything in its storage later (what is written into it, an op's output that aliases it, as FSDP2's
all-gather buffers), and views (their values were read where they were made) are not.
A value of exactly the dtype's largest magnitude is a fill (``torch.finfo(dtype).min`` as a mask),
as ``-inf`` is, not a computed value coming close. The running maxima stay on the device and
are read once, when the measured step ends. Reading never communicates: a DTensor's own shard
is read.

The measurement only ever watches the user's own step as it runs: it never runs any of it again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from nanguard import compat
from nanguard.dtypes import OVERFLOW_FRACTION, dtype_facts
from nanguard.stats import local
from nanguard.tracer.compiled import compiled_modules
from nanguard.tracer.modules import ModuleStack
from nanguard.tracer.ops import info
from nanguard.tree import op_leaves

__all__ = ["Headroom", "HeadroomCheck", "measure_headroom"]

log = logging.getLogger("nanguard")


@dataclass(frozen=True)
class Headroom:
    """The largest finite absolute value the ops of one module produced in one dtype."""

    module: str
    dtype: str
    absmax: float
    limit: float

    @property
    def close(self) -> bool:
        """Within ``1/OVERFLOW_FRACTION`` (8x) of overflowing."""
        return self.absmax > self.limit * OVERFLOW_FRACTION


class _HeadroomMode(compat.DispatchMode):
    def __init__(self, stack: ModuleStack, maxima: dict[tuple[str, torch.dtype], torch.Tensor]) -> None:
        super().__init__()
        self.stack = stack
        self.maxima = maxima
        self._blank: dict[int, StorageWeakRef] = {}  # storages allocated and not computed, by StorageImpl

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        facts = info(func)
        if facts.blank:
            for t in op_leaves(out):
                if isinstance(t, torch.Tensor) and (ref := _storage(local(t))) is not None:
                    self._blank[ref.cdata] = ref
            return out
        name = self.stack.current_name()
        if name is None or facts.view:  # outside the model (the loss, autograd's accumulation); a view
            return out
        for t in op_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() and (dtype := dtype_facts(t.dtype)) and dtype.low_precision:
                t = local(t)  # this rank's shard: a DTensor's own reductions would communicate
                if self._is_blank(t):
                    continue  # in a blank allocation (written into it, or an alias of it): a mask or buffer
                a = t.abs()
                # Inf/NaN are the guard's business, a value at the limit a fill: the finite values below it.
                a = torch.where(a < dtype.max, a, 0).amax().float()
                key = (name, t.dtype)
                seen = self.maxima.get(key)
                self.maxima[key] = a if seen is None else torch.maximum(seen, a)
        return out

    def _is_blank(self, t: torch.Tensor) -> bool:
        if not self._blank or (key := _storage(t)) is None:
            return False
        ref = self._blank.get(key.cdata)
        return ref is not None and not ref.expired()  # expired: freed, its address reused by a computed tensor


def _storage(t: torch.Tensor) -> StorageWeakRef | None:
    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError):  # a tensor with no storage of its own
        return None


def _found(maxima: dict[tuple[str, torch.dtype], torch.Tensor]) -> list[Headroom]:
    """The measured maxima, read in one host read, worst first."""
    found: list[Headroom] = []
    if not maxima:
        return found
    keys = list(maxima)
    device = maxima[keys[0]].device
    values = torch.stack([maxima[k].to(device) for k in keys]).tolist()
    for (module, dtype), value in zip(keys, values, strict=True):
        facts = dtype_facts(dtype)
        assert facts is not None
        found.append(Headroom(module=module, dtype=facts.name, absmax=float(value), limit=facts.max))
    found.sort(key=lambda h: h.absmax / h.limit, reverse=True)
    return found


@contextlib.contextmanager
def measure_headroom(model: nn.Module) -> Iterator[list[Headroom]]:
    """Measure low-precision op outputs per module while the block runs; the yielded list
    is filled, worst first, when the block ends.

    Example:
        >>> with measure_headroom(model) as found:
        ...     with torch.autocast("cpu", dtype=torch.float16):
        ...         model(x)
        >>> [(h.module, h.absmax) for h in found if h.close]
        [('blocks.0.attn', 12288.0)]
    """
    found: list[Headroom] = []
    maxima: dict[tuple[str, torch.dtype], torch.Tensor] = {}
    with ModuleStack(model) as stack, _HeadroomMode(stack, maxima):
        yield found
    found.extend(_found(maxima))


class _Window:
    """The next training forward of ``model`` measured as it runs, once: entered in the model's own forward
    pre-hook, left in its forward hook (which runs even when the forward raises)."""

    def __init__(self, model: nn.Module, step: int) -> None:
        self.model, self.step = model, step
        self.maxima: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self.ran = False
        self._open: tuple[ModuleStack, _HeadroomMode] | None = None
        self._handles = [
            model.register_forward_pre_hook(self._enter),
            model.register_forward_hook(self._leave, always_call=True),
        ]

    def _enter(self, module: nn.Module, args: Any) -> None:
        if self.ran or self._open is not None or not (module.training and torch.is_grad_enabled()):
            return  # an evaluation or generation forward between the steps is not the next step's
        stack = ModuleStack(module).enter_within(module)
        mode = _HeadroomMode(stack, self.maxima)
        mode.__enter__()
        self._open = stack, mode

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._open is None:
            return
        stack, mode = self._open
        self._open, self.ran = None, True
        mode.__exit__(None, None, None)
        stack.__exit__(None, None, None)
        self.remove()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class HeadroomCheck:
    """Every ``every``-th step, measures the step's float16/bfloat16 op outputs per module as the
    step runs, and reports each module through ``emit(step, headroom)``. The first measured step
    that sees no float16/bfloat16 op output turns the checks off.

    The user's step runs once: the measurement only reads op outputs as they are made, which
    changes none of them. ``Guard.step`` measures the closure's forward and backward (``watch``);
    a ``Guard.check`` loop, whose forward runs before the guard sees it, has the forward of its
    next due step measured (``arm`` after one check, ``collect`` at the next). A compiled model
    is not measured: under the measurement its code would run eagerly, in another numeric path
    than the user's.

    Example:
        >>> check = HeadroomCheck(model, every=100, emit=lambda step, h: print(step, h))
        >>> with check.watch(step):               # Guard.step: measured in place
        ...     loss = closure()                  # the step itself, as the user wrote it
        >>> check.collect(step)                   # Guard.check: report the armed forward ...
        >>> check.arm(step + 1)                   # ... and arm the next due one
    """

    def __init__(self, model: nn.Module, *, every: int, emit: Callable[[int, Headroom], None]) -> None:
        self.model = model
        self.every = every
        self.emit = emit
        self._window: _Window | None = None

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def _measurable(self) -> bool:
        if not compiled_modules(self.model):
            return True
        log.info("nanguard: a compiled model's headroom is not measured (it would run eagerly); checks stop")
        self.every = 0
        return False

    @contextlib.contextmanager
    def watch(self, step: int) -> Iterator[None]:
        """Measure a due step as it runs: a mode that only reads the ops' outputs changes none of them."""
        if not self.due(step) or not self._measurable():
            yield
            return
        with measure_headroom(self.model) as found:
            yield
        self._report(step, found)

    def arm(self, step: int) -> None:
        """Measure the model's next forward as step ``step``'s, if that step is due (``Guard.check``)."""
        self.close()
        if self.due(step) and self._measurable():
            self._window = _Window(self.model, step)

    def collect(self, step: int) -> None:
        """Report what the armed window measured, when it measured step ``step``; disarm it."""
        window, self._window = self._window, None
        if window is None:
            return
        window.remove()
        if window.ran and window.step == step:
            self._report(step, _found(window.maxima))

    def close(self) -> None:
        """Disarm a window not yet collected."""
        if self._window is not None:
            self._window.remove()
            self._window = None

    def _report(self, step: int, found: list[Headroom]) -> None:
        if not found:
            # No float16/bfloat16 op ran: a float32 run stays one, so stop paying for the trace.
            log.debug("nanguard: step %d: no low-precision op outputs; headroom checks stop", step)
            self.every = 0
        for h in found:
            self.emit(step, h)
            if h.close:
                log.warning(
                    "nanguard: step %d: %s outputs in module '%s' reach %.4g, within %gx of the %s limit %.4g",
                    step,
                    h.dtype,
                    h.module,
                    h.absmax,
                    1 / OVERFLOW_FRACTION,
                    h.dtype,
                    h.limit,
                )
