"""The fire drill: plant a fault at a chosen step on a chosen rank, through the path a real one takes.

``NANGUARD_INJECT`` (or ``Guard(inject=...)``) names the faults, ``;``-separated::

    nan_grad@step=100,rank=3            a NaN in a gradient, written by a hook on the parameter's gradient
    inf_loss@step=200                   the loss that backward runs on (and the closure returns) is +Inf
    nan_param@step=300,module=blocks.2.mlp   a NaN written into a parameter of that module before the step
    spike_loss@step=400,factor=1e4      the loss (so the gradients too) multiplied by ``factor``
    corrupt_allreduce@step=500          a NaN put on the wire of the gradient all-reduce, once: the replay is clean
    stall@step=600,rank=1,seconds=5     the rank sleeps before its step: the others wait in the collective
    faulty_device@step=700,rank=2       a faulty device: from that step on, every forward of the module
                                        (default: the first with parameters of its own) on that rank only
                                        has a NaN in its output, replays included; runs=1: once (transient)

``rank`` defaults to 0, ``module`` to the model's first parameter. Nothing fakes the guard's
flags: each fault makes a real tensor non-finite and the guard finds it as it finds any other.
A fault that reproduces (all but ``corrupt_allreduce``) is planted again in the trip's replay,
so it is diagnosed like a real one; ``corrupt_allreduce`` fires on the step's first run only.
``faulty_device`` is planted in the device, not the step: a peer rank that re-computes the step
(``guard/proof.py``) computes it finite, as a healthy device would.
Without torch.distributed it corrupts a gradient after backward, as a faulty device would.

Every rank knows every fault (the spec is the same everywhere), so each one writes a ``drill``
event for each fault of a step, with its own action; the guard marks a trip at such a step
as injected (``diag.evidence["injected"]``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from nanguard import dist
from nanguard.stats import local

__all__ = ["DEVICE_FAULTS", "FAULTS", "KINDS", "Fault", "Injector", "NullInjector", "injector_for", "parse"]

log = logging.getLogger("nanguard")

FAULTS: dict[str, tuple[str, ...]] = {
    "nan_grad": ("module",),
    "inf_loss": (),
    "nan_param": ("module",),
    "spike_loss": ("factor",),
    "corrupt_allreduce": (),
    "stall": ("seconds",),
}
"""Each fault kind of a step and the keys it takes besides ``step`` and ``rank``."""
DEVICE_FAULTS: dict[str, tuple[str, ...]] = {"faulty_device": ("module", "runs")}
"""Faults of a device, not of a step: it stays faulty, so the drill's default set and the chaos
soak (every kind of ``FAULTS``) leave them out; name them in a spec."""
KINDS = {**FAULTS, **DEVICE_FAULTS}

TRANSIENT = frozenset({"corrupt_allreduce", "stall"})
"""Faults the trip's replay does not see again."""


@dataclass(frozen=True)
class Fault:
    """One planted fault.

    Example:
        >>> Fault("nan_grad", step=100, rank=3).spec
        'nan_grad@step=100,rank=3'
    """

    kind: str
    step: int
    rank: int = 0
    module: str | None = None
    factor: float = 1e4
    seconds: float = 5.0
    runs: int = 0
    """faulty_device: how many forwards it corrupts (0: every one, from ``step`` on)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind must be one of {sorted(KINDS)}, got {self.kind!r}")
        for name in ("step", "rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{self.kind}: {name} must be an int >= 0, got {value!r}")
        if not (isinstance(self.factor, (int, float)) and math.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"{self.kind}: factor must be a finite number > 0, got {self.factor!r}")
        if not (isinstance(self.seconds, (int, float)) and 0 <= self.seconds <= 3600):
            raise ValueError(f"{self.kind}: seconds must be a number in [0, 3600], got {self.seconds!r}")
        if not isinstance(self.runs, int) or isinstance(self.runs, bool) or self.runs < 0:
            raise ValueError(f"{self.kind}: runs must be an int >= 0 (0: every run), got {self.runs!r}")

    @property
    def spec(self) -> str:
        """The fault as ``NANGUARD_INJECT`` writes it."""
        parts = [f"step={self.step}", f"rank={self.rank}"]
        if self.module is not None:
            parts.append(f"module={self.module}")
        if self.kind == "spike_loss":
            parts.append(f"factor={self.factor:g}")
        if self.kind == "stall":
            parts.append(f"seconds={self.seconds:g}")
        if self.runs:
            parts.append(f"runs={self.runs}")
        return f"{self.kind}@{','.join(parts)}"

    def to_dict(self) -> dict[str, Any]:
        return {"fault": self.spec, "kind": self.kind, "step": self.step, "rank": self.rank}


def parse(spec: str | Sequence[Fault] | None) -> list[Fault]:
    """The faults of a ``NANGUARD_INJECT`` spec (``;``-separated), or a list of ``Fault`` as is.

    Example:
        >>> parse("nan_grad@step=100,rank=3; stall@step=600,rank=1,seconds=5")
        [Fault(kind='nan_grad', step=100, rank=3, ...), Fault(kind='stall', step=600, rank=1, ...)]
    """
    if spec is None:
        return []
    if not isinstance(spec, str):
        faults = list(spec)
        if not all(isinstance(f, Fault) for f in faults):
            raise ValueError("inject must be a spec string such as 'nan_grad@step=100,rank=3' or a list of Fault")
        return faults
    return [_parse_one(part.strip()) for part in spec.split(";") if part.strip()]


def _parse_one(text: str) -> Fault:
    kind, at, rest = text.partition("@")
    kind = kind.strip()
    if kind not in KINDS or not at:
        raise ValueError(f"inject: {text!r} must read KIND@step=N[,rank=R][,...] with KIND one of {sorted(KINDS)}")
    values: dict[str, Any] = {}
    for item in rest.split(","):
        key, eq, value = (s.strip() for s in item.partition("="))
        accepted = ("step", "rank", *KINDS[kind])
        if not eq or key not in accepted:
            raise ValueError(f"inject: {kind} takes the keys {list(accepted)}, got {item.strip()!r} in {text!r}")
        try:
            values[key] = value if key == "module" else int(value) if key in ("step", "rank", "runs") else float(value)
        except ValueError:
            raise ValueError(f"inject: {key} must be a number in {text!r}, got {value!r}") from None
    if "step" not in values:
        raise ValueError(f"inject: {text!r} needs step=N")
    return Fault(kind=kind, **values)


class Steps(Protocol):
    """Where the guarded run stands (``nanguard.guard.progress.Progress``): ``step`` is the next step's index."""

    step: int


class NullInjector:
    """The injector of a guard with nothing to plant: every hook is a no-op."""

    faults: tuple[Fault, ...] = ()

    def begin(self, step: int) -> None:
        pass

    def wrap(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        return closure

    def loss(self, value: Any) -> Any:
        return value

    def at(self, step: int) -> list[Fault]:
        return []

    def mark(self, diagnosis: Any, step: int, action: str) -> None:
        pass

    def end(self, *, action: str | None, diagnosis: Any, spiked: bool) -> None:
        pass


class Injector(NullInjector):
    """Plants ``faults`` into the guarded run of ``model`` on this rank.

    The guard calls ``begin(step)`` before a step (parameters, stalls), runs the step's closure
    through ``wrap`` (loss, all-reduce), passes a ``check()`` loss through ``loss``, marks a trip
    with ``mark`` and ends the step with ``end``, which writes the ``drill`` events.

    Example:
        >>> injector = Injector(parse("nan_grad@step=3"), model, write=recorder.drill, steps=Progress())
        >>> injector.begin(3); loss = injector.wrap(closure)()   # the gradient hook wrote a NaN
    """

    def __init__(self, faults: Sequence[Fault], model: nn.Module, *, write: Callable[..., None], steps: Steps) -> None:
        self.faults = tuple(faults)
        self._upcoming = steps  # the step a loop's own backward belongs to, before check() begins it
        self.rank, world = dist.rank(), dist.world_size()
        for f in self.faults:
            if f.rank >= world:
                raise ValueError(f"inject: {f.spec} names rank {f.rank}, but the world has {world} rank(s)")
        self._write = write
        self._step: int | None = None
        self._started = 0.0
        self._fired: set[Fault] = set()
        self._late: list[int] = []
        self._marked: dict[int, tuple[str, str]] = {}
        self._mine = [f for f in self.faults if f.rank == self.rank]
        self._targets = {f: _parameter(model, f) for f in self._mine if f.kind in ("nan_grad", "nan_param")}
        self._first = _parameter(model, Fault("nan_grad", step=0))
        for p in {id(p): p for f, p in self._targets.items() if f.kind == "nan_grad"}.values():
            p.register_hook(self._grad_hook(p))
        self._corrupted: dict[Fault, int] = {}
        for f in self._mine:
            if f.kind == "faulty_device":
                _module(model, f).register_forward_hook(self._device_hook(f))

    def at(self, step: int) -> list[Fault]:
        return [f for f in self.faults if f.step == step]

    def _now(self, kind: str) -> Fault | None:
        """This rank's fault of ``kind`` at the running step, or None."""
        step = self._step if self._step is not None else self._upcoming.step
        return next((f for f in self._mine if f.kind == kind and f.step == step), None)

    def begin(self, step: int) -> None:
        self._step, self._started = step, time.monotonic()
        for f in self._mine:
            if f.step != step:
                continue
            log.warning("nanguard: drill: planting %s", f.spec)
            if f.kind == "nan_param":
                with torch.no_grad():
                    _poison(self._targets[f])
            elif f.kind == "stall":
                time.sleep(f.seconds)

    def _grad_hook(self, p: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor | None]:
        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            f = self._now("nan_grad")
            if f is None or self._targets[f] is not p:
                return None
            bad = grad.clone()
            _poison(bad)
            return bad

        return hook

    def _device_hook(self, f: Fault) -> Callable[..., Any]:
        """A faulty device: the module's output gets a NaN on every forward from ``f.step`` on
        (the first ``f.runs`` forwards when set), whoever runs it: the step, its replays, a proof."""

        def hook(_module: nn.Module, _args: Any, output: Any) -> Any:
            step = self._step if self._step is not None else self._upcoming.step
            done = self._corrupted.get(f, 0)
            if step < f.step or not isinstance(output, torch.Tensor) or (f.runs and done >= f.runs):
                return None
            self._corrupted[f] = done + 1
            return _poisoned(output)

        return hook

    def wrap(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        def planted() -> Any:
            if self._step is None or not any(f.step == self._step for f in self._mine):
                return closure()
            wire = self._now("corrupt_allreduce")
            wire = wire if wire is not None and wire not in self._fired else None
            with _backward_roots(self._root) as sent, _on_the_wire(wire is not None and dist.is_distributed()) as hit:
                result = closure()
            if wire is not None:
                self._fired.add(wire)
                if not hit:  # no all-reduce ran (one process, FSDP2): the gradient arrives corrupted
                    _corrupt_grad(self._first)
            return self.loss(result) if sent else result

        return planted

    def _root(self, t: torch.Tensor) -> torch.Tensor:
        if self._now("inf_loss") is not None:
            return t + torch.full_like(t, math.inf)
        if (f := self._now("spike_loss")) is not None:
            return t * f.factor
        return t

    def loss(self, value: Any) -> Any:
        """The loss as this step's loss faults leave it (``check()``'s loss, a closure's result)."""
        if self._now("inf_loss") is not None:
            return value + torch.full_like(value, math.inf) if isinstance(value, torch.Tensor) else math.inf
        if (f := self._now("spike_loss")) is not None:
            return value * f.factor
        return value

    def mark(self, diagnosis: Any, step: int, action: str) -> None:
        """Say in a trip's diagnosis which planted faults it answers (at ``step``, on any rank), and
        remember the ``action`` taken (skip, rollback, resync, raise) for the drill's events.

        A trip of an earlier step (a NaN written where the forward does not read it shows in the
        parameter check after the update, read with the next step) gets its drill events late.
        """
        faults = [f for f in self.at(step) if f.kind != "stall"]  # a stall makes nothing non-finite
        faults += [f for f in self.faults if f.kind in DEVICE_FAULTS and not f.runs and f.step < step]
        if faults:
            diagnosis.evidence["injected"] = [f.to_dict() for f in faults]
            self._marked[step] = (action, diagnosis.cause)
            if step != self._step:
                self._late.append(step)

    def end(self, *, action: str | None, diagnosis: Any, spiked: bool) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        late, self._late = self._late, []
        for at in [*late, step]:
            self._outcome(at, action, diagnosis, spiked and at == step)

    def _outcome(self, step: int, action: str | None, diagnosis: Any, spiked: bool) -> None:
        marked = self._marked.pop(step, None)
        tripped = marked is not None
        if marked is not None:
            action = marked[0]
        for f in self.at(step):
            spike = spiked and f.kind == "spike_loss"
            self._write(
                step,
                fault=f.spec,
                fault_kind=f.kind,
                fault_rank=f.rank,
                planted_here=f.rank == self.rank,
                action=action,
                detected=None if f.kind == "stall" else tripped or spike,
                cause=marked[1] if marked is not None else "spike" if spike else None,
                seconds=time.monotonic() - self._started,
            )


def injector_for(
    inject: str | Sequence[Fault] | None, model: nn.Module, *, write: Callable[..., None], steps: Steps
) -> NullInjector:
    """An ``Injector`` for the faults of ``inject``, or a ``NullInjector`` when there are none.

    Example:
        >>> injector_for("inf_loss@step=5", model, write=recorder.drill, steps=Progress()).at(5)[0].kind
        'inf_loss'
    """
    faults = parse(inject)
    return Injector(faults, model, write=write, steps=steps) if faults else NullInjector()


def _parameter(model: nn.Module, fault: Fault) -> torch.Tensor:
    """The parameter a fault is planted in: the first floating-point one of ``fault.module``."""
    from nanguard.tracer.compiled import user_name

    inner = dist.unwrap(model)
    modules = {user_name(n): m for n, m in inner.named_modules()}
    name = fault.module or ""
    if name not in modules:
        some = [n for n in modules if n][:8]
        raise ValueError(f"inject: {fault.spec}: module must name a module of the model, e.g. {some}; got {name!r}")
    params = [p for p in modules[name].parameters() if p.is_floating_point() and p.requires_grad]
    if not params:
        raise ValueError(f"inject: {fault.spec}: module {name!r} has no trainable floating-point parameter")
    return params[0]


def _module(model: nn.Module, fault: Fault) -> nn.Module:
    """The module a faulty device corrupts: ``fault.module``, else the first with parameters of its own."""
    from nanguard.tracer.compiled import user_name

    inner = dist.unwrap(model)
    modules = {user_name(n): m for n, m in inner.named_modules()}
    if fault.module is None:
        owning = [m for m in modules.values() if any(True for _ in m.parameters(recurse=False))]
        return owning[0] if owning else inner
    if fault.module not in modules:
        some = [n for n in modules if n][:8]
        raise ValueError(f"inject: {fault.spec}: module must name a module of the model, e.g. {some}")
    return modules[fault.module]


def _poisoned(output: torch.Tensor) -> torch.Tensor:
    """``output`` with a NaN in its first element, still in the autograd graph (as a bad kernel leaves it)."""
    mask = torch.zeros_like(output, dtype=torch.bool)
    mask.view(-1)[0] = True
    return output.masked_fill(mask, math.nan)


def _poison(t: torch.Tensor) -> None:
    """NaN in the first element of ``t`` (this rank's shard of a DTensor)."""
    x = local(t)
    x[(0,) * x.dim()] = math.nan


def _corrupt_grad(p: torch.Tensor) -> None:
    if p.grad is not None:
        with torch.no_grad():
            _poison(p.grad)


@contextlib.contextmanager
def _backward_roots(change: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """While open, the first tensor each ``backward`` runs on is ``change(t)`` (the loss)."""
    sent: list[torch.Tensor] = []
    original = torch.autograd.backward

    def planted(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(tensors, torch.Tensor):
            tensors = change(tensors)
            sent.append(tensors)
        return original(tensors, *args, **kwargs)

    torch.autograd.backward = planted
    try:
        yield sent
    finally:
        torch.autograd.backward = original


@contextlib.contextmanager
def _on_the_wire(active: bool) -> Iterator[list[bool]]:
    """While open and ``active``, the first floating-point gradient all-reduce of this rank
    sends a NaN: it reaches every rank's averaged gradients, as a corruption in transit would."""
    hit: list[bool] = []
    if not active:
        yield hit
        return
    import torch.distributed as tdist

    original = tdist.all_reduce

    def corrupting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not hit and tensor.is_floating_point() and tensor.numel():
            hit.append(True)
            with torch.no_grad():
                _poison(tensor)
        return original(tensor, *args, **kwargs)

    tdist.all_reduce = corrupting
    try:
        yield hit
    finally:
        tdist.all_reduce = original
