"""Overflow headroom: how close float16/bfloat16 op outputs inside each module come to the
dtype's largest finite value.

Every op output is seen, not only module outputs: attention scores computed inside an
attention module count for that module. The running maxima stay on the device and are read
once, when the measured step ends.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nanguard import compat
from nanguard.dtypes import OVERFLOW_FRACTION, dtype_facts
from nanguard.rng import get_rng_state, set_rng_state
from nanguard.tracer.compiled import compiled_modules, eager
from nanguard.tracer.modules import ModuleStack
from nanguard.tracer.ops import info
from nanguard.tracer.protect import Backup
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
    def __init__(self, stack: ModuleStack, backup: Backup | None = None) -> None:
        super().__init__()
        self.stack = stack
        self.backup = backup
        self.maxima: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.backup is not None and (writes := info(func).writes):
            self.backup.before(writes, args, kwargs or {})
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
def measure_headroom(model: nn.Module, backup: Backup | None = None) -> Iterator[list[Headroom]]:
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
    with ModuleStack(model) as stack, _HeadroomMode(stack, backup) as mode:
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
    """Every ``every``-th step, runs ``measure_headroom`` on a replay of the step's closure and
    reports each module through ``emit(step, headroom)``. The first check that sees no
    float16/bfloat16 op output turns the checks off.

    An eager model's step is measured as it runs (``watch``): reading op outputs changes none.
    A compiled model's step is never run under the measurement, which would run it eagerly, in
    another numeric path than the user's: a replay of its closure is measured instead, and leaves
    the step as it found it (gradients, buffers, parameters and RNG). ``Guard.check`` loops, whose
    forward ran before the guard saw it, are measured on their replay too.

    Example:
        >>> check = HeadroomCheck(model, every=100, emit=lambda step, h: print(step, h))
        >>> with check.watch(step):               # eager: measured in place
        ...     loss = closure()                  # the step itself, as the user wrote it
        >>> if check.due(step):                   # compiled (or not measured in place)
        ...     check.replay(step, closure, params=params, rng=rng_before_the_step)
    """

    def __init__(self, model: nn.Module, *, every: int, emit: Callable[[int, Headroom], None]) -> None:
        self.model = model
        self.every = every
        self.emit = emit
        self._measured: int | None = None  # the step ``watch`` measured as it ran

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0 and self._measured != step

    @contextlib.contextmanager
    def watch(self, step: int) -> Iterator[None]:
        """Measure a due step of an eager model as it runs, with no replay: a mode that only reads
        the ops' outputs changes none of them. A compiled model is left to ``replay`` (under the
        mode it would run eagerly, in another numeric path than the user's)."""
        if not self.due(step) or compiled_modules(self.model):
            yield
            return
        with measure_headroom(self.model) as found:
            yield
        self._measured = step
        self._report(step, found)

    def replay(
        self,
        step: int,
        closure: Callable[[], Any],
        *,
        params: Sequence[torch.Tensor],
        rng: Mapping[str, torch.Tensor] | None,
        cuda_devices: Sequence[int] = (),
    ) -> None:
        """Measure ``closure`` (the step's forward and backward) again from ``rng``, the RNG state
        before the step; nanguard's own failure only warns and turns the checks off."""
        try:
            with (
                _aside(self.model, params, rng, cuda_devices) as backup,
                eager(),
                measure_headroom(self.model, backup) as found,
                torch.enable_grad(),
            ):
                closure()
        except Exception as err:  # a measurement is never worth killing training
            warnings.warn(f"nanguard: the headroom check of step {step} failed: {err!r}; checks stop", stacklevel=3)
            self.every = 0
            return
        self._report(step, found)

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


@contextlib.contextmanager
def _aside(
    model: nn.Module, params: Sequence[torch.Tensor], rng: Mapping[str, torch.Tensor] | None, cuda: Sequence[int]
) -> Iterator[Backup]:
    """Around a replay: the step's gradients set aside (the replay makes its own), buffers and
    written parameters backed up, the RNG run from ``rng`` and put back where the step left it."""
    params = list({id(p): p for p in [*model.parameters(), *params]}.values())  # the optimizer's and the model's
    grads = [p.grad for p in params]
    after = get_rng_state(cuda)
    backup = Backup(on_write=params, now=list(model.buffers()))
    for p in params:
        p.grad = None
    try:
        if rng is not None:
            set_rng_state(rng)
        yield backup
    finally:
        backup.restore()
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        set_rng_state(after)
