"""Lightning Fabric: guard a hand-written Fabric loop without changing its shape.

``FabricGuard(fabric, model, optimizer)`` takes the module and optimizer ``fabric.setup``
returned and watches the loop the user already wrote: each training forward of ``model``
(its inputs and the RNG state before it), each ``fabric.backward`` (the step's loss is the sum
of what was back-propagated, as with ``loss / accumulation_steps``), and the end of the step.
The check runs once per optimizer step, at the first of ``fabric.clip_gradients`` (so a NaN
never reaches its ``error_if_nonfinite``) and ``optimizer.step()``; every rank agrees through
the guard's one collective. A tripped step is replayed for the user, every micro-batch of it
from its own RNG state with communication off, under ``ng.locate``; then the policy applies:
``skip`` makes ``optimizer.step()`` (and a ``scheduler=``'s next ``step()``) do nothing and puts
BatchNorm-style running statistics back, ``rollback`` restores the last snapshot, ``raise``
raises ``ng.NonFiniteError``. Module names are those of the user's model: no Fabric, DDP or
compile wrapper level appears in them.

When the loss is computed outside the model (``loss_fn(model(x), y)``), decorate the function
that computes it with ``@guard.micro_step``; the replay then re-runs it, backward included.
A model that returns its loss (a one-element tensor, a ``"loss"`` entry, or one among the
outputs, as nanoGPT's ``logits, loss``) needs nothing more.

Example:
    >>> from nanguard.integrations.fabric import FabricGuard
    >>> model, optimizer = fabric.setup(model, optimizer)
    >>> guard = FabricGuard(fabric, model, optimizer, policy="skip", run_dir="runs/exp1")
    >>> for i, batch in enumerate(loader):
    ...     with fabric.no_backward_sync(model, enabled=(i + 1) % accum != 0):
    ...         loss = model(batch)
    ...         fabric.backward(loss / accum)
    ...     if (i + 1) % accum == 0:
    ...         fabric.clip_gradients(model, optimizer, max_norm=1.0)
    ...         optimizer.step()                  # skipped when the step tripped
    ...         optimizer.zero_grad()
    >>> guard.close(); guard.skipped, guard.last_diagnosis
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from nanguard import compat
from nanguard.guard import Guard
from nanguard.integrations import GuardedCallback, guard_options, require
from nanguard.integrations.capture import Micro, StepCapture
from nanguard.text import diagnosis_text

_fabric = require("lightning.fabric", "lightning", "Lightning Fabric")

__all__ = ["FabricGuard"]

log = logging.getLogger("nanguard")
F = TypeVar("F", bound=Callable[..., Any])


class FabricGuard(GuardedCallback):
    """Checks each optimizer step of a Fabric loop for NaN/Inf, diagnoses a trip, and skips,
    rolls back or raises.

    ``model`` and ``optimizer`` are what ``fabric.setup`` returned; ``policy`` and ``**options``
    are those of ``ng.Guard`` (see ``GuardConfig``). ``mean=False`` when the loop back-propagates
    each micro-batch's loss undivided (the replay divides by the number of micro-batches
    otherwise). ``scheduler`` is left unstepped after a skipped step and is restored by a
    rollback. ``close()`` (or leaving a ``with`` block) ends the run's log and unhooks the loop.

    Example:
        >>> with FabricGuard(fabric, model, optimizer, policy="raise") as guard:
        ...     train(fabric, model, optimizer)
        Traceback (most recent call last):
        nanguard.errors.NonFiniteError: ... data.nonfinite ...
    """

    def __init__(
        self,
        fabric: Any,
        model: nn.Module,
        optimizer: Any,
        policy: str = "skip",
        *,
        scheduler: Any = None,
        run_dir: str | Path | None = None,
        mean: bool = True,
        **options: Any,
    ) -> None:
        guard_options(policy, options)
        if not isinstance(fabric, _fabric.Fabric):
            raise ValueError(f"fabric must be a lightning.fabric.Fabric, got {type(fabric).__name__}")
        forward, user = compat.fabric_modules(model)
        if forward is model:
            raise ValueError("model must be the module fabric.setup(model, optimizer) returned, got a plain "
                             f"{type(model).__name__}")  # fmt: skip
        inner = compat.fabric_inner_optimizer(optimizer)
        if inner is optimizer:
            raise ValueError("optimizer must be the optimizer fabric.setup(model, optimizer) returned, got a plain "
                             f"{type(optimizer).__name__}")  # fmt: skip
        if not isinstance(mean, bool):
            raise ValueError(f"mean must be True (the loop divides each loss by their number) or False, got {mean!r}")
        if getattr(fabric.strategy.precision, "scaler", None) is not None:
            raise ValueError("FabricGuard does not support a precision with a GradScaler (precision='16-mixed') yet; "
                             "use precision='bf16-mixed', '32-true' or '64-true'")  # fmt: skip
        self.fabric, self.model, self.optimizer, self.scheduler = fabric, model, optimizer, scheduler
        self.mean = mean
        self.trips = 0
        self.guard: Guard | None = Guard(forward, inner, policy, scheduler=scheduler, run_dir=run_dir, **options)
        self._user = user
        self._capture = StepCapture(user)
        self._loss: torch.Tensor | None = None
        self._verdict: bool | None = None  # this step's, once checked
        self._hold_scheduler = False
        self._in_micro_step = False
        self._originals = {"backward": fabric.backward, "clip_gradients": fabric.clip_gradients}
        self._step = optimizer.step
        self._hooks = [
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward, with_kwargs=True),
        ]
        fabric.backward = self._backward
        fabric.clip_gradients = self._clip_gradients
        optimizer.step = _like(self._step, self._optimizer_step)
        if scheduler is not None:
            self._scheduler_step = scheduler.step
            scheduler.step = self._scheduler_step_unless_skipped

    # -- what the loop calls -----------------------------------------------------------------
    def micro_step(self, fn: F) -> F:
        """Decorate the function that computes one micro-batch's loss from its arguments
        (forward and loss); each call is recorded and a trip's replay calls it again.

        Example:
            >>> @guard.micro_step
            ... def loss_of(input_ids, targets):
            ...     return chunked_cross_entropy(model(input_ids), targets)
            >>> fabric.backward(loss_of(input_ids, targets) / accum)
        """
        if not callable(fn):
            raise ValueError(f"micro_step takes the function computing a micro-batch's loss, got {type(fn).__name__}")

        @functools.wraps(fn)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if self._in_micro_step or not torch.is_grad_enabled() or not self.model.training:
                return fn(*args, **kwargs)
            m = self._capture.record(args, kwargs)
            if m is not None:
                m.run = fn
            self._in_micro_step = True
            try:
                loss = fn(*args, **kwargs)
            finally:
                self._in_micro_step = False
            if m is not None and isinstance(loss, torch.Tensor) and loss.numel() == 1:
                m.loss = loss.detach()
            return loss

        return recorded  # type: ignore[return-value]

    def close(self) -> None:
        """Unhook the loop and end the run's log (the guard's counters stay readable)."""
        if self.guard is None or not self._hooks:
            return
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for name in self._originals:
            vars(self.fabric).pop(name, None)
        vars(self.optimizer).pop("step", None)
        if self.scheduler is not None:
            vars(self.scheduler).pop("step", None)
        self.guard.close()

    def __enter__(self) -> FabricGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """The guard's counters and history, for ``fabric.save(path, {..., "nanguard": guard})``."""
        return self.guard.state_dict() if self.guard is not None else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.guard is not None:
            self.guard.load_state_dict(state)

    # -- the loop's moments ------------------------------------------------------------------
    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if self._in_micro_step or not module.training or not torch.is_grad_enabled():
            return  # inside a recorded micro_step, evaluation, or generation
        self._capture.record(args, kwargs)  # nothing during our own replay

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        micro = self._capture.micro
        if self._in_micro_step or self._capture.replaying or not micro or micro[-1].loss is not None:
            return
        loss = _loss_of(output)
        if loss is not None:
            micro[-1].loss = loss.detach()

    def _backward(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if not self._capture.replaying:
            if self._verdict is not None:
                self._verdict = None  # a backward after the step's check starts the next step
            part = tensor.detach().float().reshape(-1).sum() if isinstance(tensor, torch.Tensor) else None
            if part is not None:
                self._loss = part if self._loss is None else self._loss + part
        self._originals["backward"](tensor, *args, **kwargs)

    def _clip_gradients(self, module: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if optimizer is self.optimizer and not self._decide():
            return torch.tensor(float("nan"))  # the skipped step's gradients were dropped: nothing to clip
        return self._originals["clip_gradients"](module, optimizer, *args, **kwargs)

    def _optimizer_step(self, closure: Callable[[], Any] | None = None) -> Any:
        if closure is not None:
            raise ValueError("FabricGuard checks the gradients the loop computed: call optimizer.step() without a "
                             "closure, or use ng.Guard(...).step(closure)")  # fmt: skip
        ok, self._verdict = self._decide(), None
        if not ok:
            self._hold_scheduler = self.scheduler is not None
            return None
        out = self._step()
        assert self.guard is not None
        self.guard.after_step()
        return out

    def _scheduler_step_unless_skipped(self, *args: Any, **kwargs: Any) -> Any:
        if self._hold_scheduler:
            self._hold_scheduler = False
            return None
        return self._scheduler_step(*args, **kwargs)

    # -- the check and the replay ------------------------------------------------------------
    def _decide(self) -> bool:
        """This step's verdict: checked at its first clip or step, the same answer after."""
        if self._verdict is not None:
            return self._verdict
        guard = self.guard
        assert guard is not None
        micro, loss = self._capture.take(), self._loss
        self._loss = None
        if loss is None and micro and all(m.loss is not None for m in micro):
            loss = torch.stack([m.loss.float().reshape(()) for m in micro]).mean()  # type: ignore[union-attr]
        before = guard.last_diagnosis
        self._verdict = self._capture.check(
            guard,
            loss,
            micro,
            replay=(lambda: self._replay(micro)) if micro else None,
            batch=_batch_of(micro, self._user.forward),
            on_raise=lambda: self._record(before),
        )
        if not self._verdict:
            self._record(before)
        return self._verdict

    def _replay(self, micro: list[Micro]) -> list[Any]:
        """Each micro-batch's forward and loss, and ``fabric.backward`` on it scaled as the loop scaled it."""
        backward, n = self._originals["backward"], len(micro) if self.mean else 1

        def run(m: Micro) -> Any:
            out = m.run(*m.args, **m.kwargs) if m.run is not None else self.model(*m.args, **m.kwargs)
            loss = out if m.run is not None else _loss_of(out)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                return out  # a loss computed outside the model and no micro_step: trace the forward alone
            backward(loss / n, model=self.model)
            return loss

        return self._capture.replay(self.model, micro, run)

    def _record(self, before: Any) -> None:
        guard = self.guard
        assert guard is not None
        diag = guard.last_diagnosis
        if guard.last_action not in ("skip", "rollback", "raise") or diag is None or diag is before:
            return  # a batch dropped after a rollback was counted by the guard already
        self.trips += 1
        if self.fabric.is_global_zero:  # every rank agreed on this diagnosis: print it once
            log.warning("%s", diagnosis_text(diag))


def _like(original: Callable[..., Any], replacement: Callable[..., Any]) -> Callable[..., Any]:
    """``replacement`` carrying ``original``'s attributes: an LR scheduler built first marked the
    optimizer's ``step`` as its own, and warns when the mark is gone."""

    @functools.wraps(original)
    def step(*args: Any, **kwargs: Any) -> Any:
        return replacement(*args, **kwargs)

    return step


def _loss_of(output: Any) -> torch.Tensor | None:
    """A model's loss in its output: a one-element tensor, ``output["loss"]``, or the first
    one-element floating tensor among a tuple's items (nanoGPT's ``logits, loss``)."""
    if isinstance(output, Mapping):
        output = output.get("loss")
    elif isinstance(output, (tuple, list)):
        output = next((t for t in output if _scalar(t)), None)
    return output if _scalar(output) else None


def _scalar(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point()


def _batch_of(micro: list[Micro], forward: Callable[..., Any]) -> Any:
    """The step's inputs as the diagnosis names them, by the parameter names of the function they
    went to (``batch['pixel_values']``); a list with one entry per micro-batch."""
    if not micro:
        return None
    batches = [_named_arguments(m.run or forward, m) for m in micro]
    return batches[0] if len(batches) == 1 else batches


def _named_arguments(fn: Callable[..., Any], m: Micro) -> dict[str, Any]:
    try:
        bound = inspect.signature(fn).bind(*m.args, **m.kwargs).arguments
    except (TypeError, ValueError):  # no signature to read, or one the call does not fit
        return {**{f"args[{i}]": a for i, a in enumerate(m.args)}, **m.kwargs}
    named: dict[str, Any] = {}
    for name, value in bound.items():
        kind = inspect.signature(fn).parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            named.update({f"{name}[{i}]": a for i, a in enumerate(value)})
        else:
            named[name] = value
    return named
