"""Overflow headroom: how close float16/bfloat16 op outputs inside each module come to the
dtype's largest finite value.

Every op output is seen, not only module outputs: attention scores computed inside an
attention module count for that module. The running maxima stay on the device and are read
once, when the measured step ends.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nanguard import compat
from nanguard.dtypes import OVERFLOW_FRACTION, dtype_facts
from nanguard.tracer.compiled import eager
from nanguard.tracer.modules import ModuleStack
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
    def __init__(self, stack: ModuleStack) -> None:
        super().__init__()
        self.stack = stack
        self.maxima: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = self.stack.current_name()
        if name is None:  # outside the model (the loss, the backward's accumulation)
            return out
        for t in op_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() and (facts := dtype_facts(t.dtype)) and facts.low_precision:
                # Inf/NaN are the guard's business; headroom is about the finite values.
                a = torch.where(torch.isfinite(t), t, 0).abs().amax().float()
                key = (name, t.dtype)
                seen = self.maxima.get(key)
                self.maxima[key] = a if seen is None else torch.maximum(seen, a)
        return out


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
    with ModuleStack(model) as stack, _HeadroomMode(stack) as mode:
        yield found
    if mode.maxima:
        keys = list(mode.maxima)
        values = torch.stack([mode.maxima[k].to(mode.maxima[keys[0]].device) for k in keys]).tolist()  # one read
        for (module, dtype), value in zip(keys, values, strict=True):
            facts = dtype_facts(dtype)
            assert facts is not None
            found.append(Headroom(module=module, dtype=facts.name, absmax=float(value), limit=facts.max))
        found.sort(key=lambda h: h.absmax / h.limit, reverse=True)


class HeadroomCheck:
    """Runs ``measure_headroom`` on every ``every``-th step's closure and reports each module
    through ``emit(step, headroom)``. The first check that sees no float16/bfloat16 op output
    turns the checks off.

    Example:
        >>> check = HeadroomCheck(model, every=100, emit=lambda step, h: print(step, h))
        >>> with check.watch(step):
        ...     loss = closure()
    """

    def __init__(self, model: nn.Module, *, every: int, emit: Callable[[int, Headroom], None]) -> None:
        self.model = model
        self.every = every
        self.emit = emit

    @contextlib.contextmanager
    def watch(self, step: int) -> Iterator[None]:
        if not self.every or step % self.every:
            yield
            return
        # A compiled model runs this step eagerly: the mode must see the aten ops, not dynamo.
        with eager(), measure_headroom(self.model) as found:
            yield
        if not found:
            # No float16/bfloat16 op ran: a float32 run stays one, so stop paying for the trace.
            log.info("nanguard: step %d: no low-precision op outputs; headroom checks stop", step)
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
