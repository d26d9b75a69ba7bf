"""The step-capture every framework integration shares: record, check, replay, hold.

A framework owns the loop, so the guard cannot run a closure. Instead an integration records
each micro-batch of the optimizer step as the framework runs it (its inputs and the RNG state
before its forward), backs up normalization running statistics at the first one, and hands the
step to ``Guard.check`` with a replay that re-runs those micro-batches. On a skip it makes the
framework's own ``optimizer.step()`` a no-op, puts the running statistics back, and holds the
LR schedulers so the step the framework takes on them anyway is undone.

The Lightning callback, the Hugging Face callback and the Fabric guard each say only *where*
their framework exposes these moments.

Example:
    >>> capture = StepCapture(model)
    >>> capture.record((batch,))                  # before each micro-batch's forward
    >>> micro = capture.take()                   # once the step's backward is done
    >>> ok = capture.check(guard, loss, micro, replay=lambda: rerun(micro), batch=batch)
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nanguard import dist
from nanguard.errors import NonFiniteError
from nanguard.guard import Guard
from nanguard.guard.fidelity import loss_differs
from nanguard.integrations import drop_grads, running_stats
from nanguard.rng import capture_rng, set_rng_state

__all__ = ["HeldSchedulers", "Micro", "StepCapture", "StepRide"]


@dataclass
class Micro:
    """One recorded micro-batch: the arguments its forward was called with, and the RNG state
    before it and the autocast it ran under; ``loss`` once the framework has computed it;
    ``run``, the function the arguments went to when it is not the model itself (``micro_step``);
    ``extra``, inputs the step took besides the forward's (the labels a loss outside the model read)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    rng: Mapping[str, torch.Tensor] = field(default_factory=capture_rng)
    loss: torch.Tensor | None = None
    run: Callable[..., Any] | None = None
    autocast: list[tuple[str, torch.dtype]] = field(default_factory=lambda: _autocast_now())
    extra: dict[str, Any] = field(default_factory=dict)


class StepCapture:
    """The micro-batches of the optimizer step in progress, and the running statistics from before it.

    Example:
        >>> capture = StepCapture(model)
        >>> capture.record((x,), {"labels": y})
        >>> [m.args for m in capture.take()]
        [(x,)]
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        self.micro: list[Micro] = []
        self.replaying = False
        self._stats = running_stats(model if model is not None else nn.Module())

    def watch(self, model: nn.Module) -> None:
        """Back up ``model``'s running statistics from now on (the model is known late in some frameworks)."""
        self._stats = running_stats(model)

    def record(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Micro | None:
        """Record one micro-batch before its forward; None (nothing recorded) during a replay."""
        if self.replaying:
            return None
        if not self.micro:
            self._stats.save()  # the first micro-batch of the step: its forward may update them
        m = Micro(args, dict(kwargs or {}))
        self.micro.append(m)
        return m

    def take(self) -> list[Micro]:
        """The step's micro-batches; the next ``record`` starts a new step."""
        micro, self.micro = self.micro, []
        return micro

    def restore_stats(self) -> None:
        self._stats.restore()

    @contextlib.contextmanager
    def replay_mode(self) -> Iterator[None]:
        """Inside the block the framework's forwards are the replay's: nothing is recorded."""
        self.replaying = True
        try:
            yield
        finally:
            self.replaying = False

    def replay(self, model: nn.Module, micro: Sequence[Micro], run: Callable[[Micro], Any]) -> list[Any]:
        """Zero ``model``'s gradients, then ``run`` each micro-batch from its own RNG state; the
        results, for the tracer to follow to the loss. A micro-batch whose recorded loss the replay
        computes otherwise says so (``guard/fidelity.py``): the replay did not run what was trained."""
        dist.zero_grad(model)  # a wrapper's zero_grad may take no set_to_none (DeepSpeed's engine)
        results = []
        with self.replay_mode():
            for i, m in enumerate(micro):
                set_rng_state(m.rng)
                out = run(m)
                if out is not None:
                    loss_differs(m.loss, out, f" (micro-batch {i})" if len(micro) > 1 else "")
                    results.append(out)
        return results

    @staticmethod
    @contextlib.contextmanager
    def precision(m: Micro) -> Iterator[None]:
        """The autocast ``m``'s forward ran under (``torch.autocast`` around the loop's forward)."""
        with contextlib.ExitStack() as stack:
            for device, dtype in m.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            yield

    def check(
        self,
        guard: Guard,
        loss: Any,
        micro: Sequence[Micro],
        *,
        replay: Callable[[], Any] | None,
        batch: Any,
        optimizer: torch.optim.Optimizer | None = None,
        on_raise: Callable[[], None] | None = None,
        drop: bool = True,
        grad_norm: torch.Tensor | None = None,
    ) -> bool:
        """``guard.check`` on the step; True when the framework may step the optimizer.

        On a skip or rollback the gradients are dropped (the framework's ``optimizer.step()`` then
        changes neither weights nor optimizer state) and the running statistics put back, unless
        a rollback restored every buffer already. Under ``policy="raise"`` the statistics are put
        back and ``on_raise`` runs before the ``NonFiniteError`` goes on. ``drop=False``: the
        gradients are left to a framework that skips the step itself (a DeepSpeed engine, whose
        optimizer's gradients are its own buffers). ``grad_norm``: what the framework's clip returned
        before the check (``integrations.clipnorm``), the step's recorded grad norm.
        """
        try:
            rng = micro[0].rng if micro else None
            ok = guard.check(loss, replay=replay, batch=batch, rng=rng, grad_norm=grad_norm)
        except NonFiniteError:
            self.restore_stats()
            if on_raise is not None:
                on_raise()
            raise
        if not ok and drop:
            drop_grads(optimizer if optimizer is not None else guard.optimizer)
        if not ok and guard.last_action != "rollback":
            self.restore_stats()
        return ok


class StepRide:
    """The step's flags riding in a reduction the framework's own loop makes (``HealthCheck.riding_loop``):
    DDP's gradient all-reduce, or its ``clip_grad_norm_`` over DTensor gradients. Opened at the step's first
    training forward, closed before the check, which then reads what rode instead of its own all-reduce.
    ``loss()`` is the step's loss as recorded so far (the one the check will get), None when unknown.

    Example:
        >>> ride = StepRide(guard, lambda: step_loss(capture.micro))
        >>> ride.open()            # before each training forward: the first opens it
        >>> ride.close(); guard.check(loss, ...)
    """

    def __init__(self, guard: Guard, loss: Callable[[], torch.Tensor | None]) -> None:
        self.guard, self.loss = guard, loss
        self._open: contextlib.ExitStack | None = None

    def open(self) -> None:
        """The step's first training forward: the flags ride from here to ``close``."""
        health = self.guard.health
        if self._open is not None or not health.rides or self.guard.disabled:
            return
        stack = contextlib.ExitStack()
        stack.enter_context(health.riding_loop(self.guard.progress.calls, self.loss))
        self._open = stack

    def close(self) -> None:
        """Before the check (or when the loop ends): nothing rides after."""
        stack, self._open = self._open, None
        if stack is not None:
            stack.close()


def _autocast_now() -> list[tuple[str, torch.dtype]]:
    return [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]


class HeldSchedulers:
    """LR schedulers held across a skipped step: the framework steps them after any optimizer
    step, so their state and the optimizer's LRs are saved on the skip and put back after.

    Example:
        >>> held = HeldSchedulers()
        >>> held.hold([scheduler], optimizer)    # on the skip
        >>> held.release()                       # after the framework stepped the scheduler
    """

    def __init__(self) -> None:
        self._held: list[tuple[Any, dict[str, Any]]] = []
        self._lrs: list[tuple[dict[str, Any], Any]] = []

    def hold(self, schedulers: Sequence[Any], optimizer: torch.optim.Optimizer) -> None:
        """Save the schedulers' states and the LRs (nothing to hold when there is no scheduler)."""
        self._held = [(s, copy.deepcopy(s.state_dict())) for s in schedulers]
        self._lrs = [(group, group["lr"]) for group in optimizer.param_groups] if self._held else []

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def release(self) -> None:
        for scheduler, state in self._held:
            scheduler.load_state_dict(state)
        for group, lr in self._lrs:
            group["lr"] = lr
        self._held, self._lrs = [], []
