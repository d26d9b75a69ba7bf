"""A hand-written loop guarded where it stands (nanoGPT, llm.c): two lines, no closure.

``LoopGuard(model, optimizer)`` watches the loop the user already wrote: each training forward
of ``model`` (its inputs, the RNG state and the autocast before it, and the loss it returned),
and the loop's own ``optimizer.step()``, which checks the step first and then steps or skips it,
every rank agreeing. A tripped step's micro-batches are replayed for the user, each from its
own RNG state with gradient communication off (whatever the loop sets
``require_backward_grad_sync`` to), under ``ng.locate``. Nothing else in the loop changes: its
own micro-batch fetching, ``no_sync``/``require_backward_grad_sync`` toggle, loss all-reduce,
``clip_grad_norm_`` and LR schedule run as written, on every rank, skipped step or not.

What ``accelerator.prepare`` returns is taken as it is: the wrapped model, and an
``AcceleratedOptimizer`` whose ``step()`` decides whether to step (only on the last micro-batch of
``accelerator.accumulate``, through its GradScaler). The check runs at that real step; a skip is
said through the wrapper (``accelerator.optimizer_step_was_skipped``), so accelerate's scheduler
holds the LR as it does for its scaler's skip (docs/frameworks.md, "Accelerate").

Example:
    >>> from nanguard.integrations.loop import LoopGuard
    >>> guard = LoopGuard(model, optimizer, policy="skip", run_dir="runs/exp1")
    >>> for step in range(steps):
    ...     for micro_step in range(accum):
    ...         x, y = loader.next_batch()
    ...         _, loss = model(x, y)             # recorded: inputs, RNG state, loss
    ...         (loss / accum).backward()
    ...     norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    ...     optimizer.step()                      # checked first; skipped when the step tripped
    ...     optimizer.zero_grad(set_to_none=True)
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeGuard, TypeVar

import torch
from torch import nn

from nanguard import compat, dist
from nanguard.guard import Guard
from nanguard.integrations import GuardedCallback, guard_options
from nanguard.integrations.capture import Micro, StepCapture, StepRide
from nanguard.integrations.clipnorm import ClipNorm

__all__ = ["LoopGuard"]

log = logging.getLogger("nanguard")
F = TypeVar("F", bound=Callable[..., Any])


class LoopGuard(GuardedCallback):
    """Checks each ``optimizer.step()`` of a hand-written loop for NaN/Inf, diagnoses a trip, and
    skips, rolls back or raises.

    ``model`` is the module the loop calls (DDP-wrapped or compiled as it is); ``policy`` and
    ``**options`` are those of ``ng.Guard`` (see ``GuardConfig``). The replay divides each
    micro-batch's loss by their number, as a loop that back-propagates ``loss / accum`` does
    (``mean=False``: as is). ``scheduler`` is left unstepped after a skipped step and restored by a
    rollback. ``last_grad_norm`` is the step's gradient norm the guard measured; ``close()`` (or
    leaving a ``with`` block) ends the run's log and unhooks the loop.

    Example:
        >>> with LoopGuard(model, optimizer, policy="raise") as guard:
        ...     train(model, optimizer)
        >>> guard.skipped, guard.last_grad_norm
        (0, 0.53)
    """

    _drops_grads = True
    """On a skip, drop the optimizer's gradients so the loop's ``optimizer.step()`` changes nothing; an
    engine that skips the step itself (DeepSpeed) keeps its own gradient buffers."""

    _rides = True
    """The step's flags ride in the loop's own reductions (``StepRide``: DDP's gradient all-reduce, the loop's
    ``clip_grad_norm_`` over DTensor gradients) where they can; an engine's guard rides its engine's instead."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        policy: str = "skip",
        *,
        scheduler: Any = None,
        run_dir: str | Path | None = None,
        mean: bool = True,
        **options: Any,
    ) -> None:
        guard_options(policy, options)
        # Guard checks the model and the optimizer: a ValueError names a wrong one.
        guard = Guard(model, optimizer, policy, scheduler=scheduler, run_dir=run_dir, **options)
        self._watch(model, optimizer, guard, scheduler=scheduler, mean=mean, user=dist.unwrap(model))

    def _stay_off(self, model: nn.Module) -> None:
        """``NANGUARD_DISABLE=1``: no guard built, nothing hooked or wrapped; the loop runs as it would
        without nanguard (``skipped`` 0, ``last_diagnosis`` None, ``close()`` does nothing)."""
        self.model, self.optimizer, self.scheduler, self.mean = model, None, None, True
        self.guard = None
        self.trips = 0
        self._hooks: list[Any] = []
        self._step_skipped = False

    def _watch(
        self, model: nn.Module, optimizer: Any, guard: Guard, *, scheduler: Any, mean: Any, user: nn.Module
    ) -> None:
        """Hook the loop: ``model`` is what it calls, ``optimizer`` what it steps (``guard.optimizer``
        is the torch optimizer inside it, whose step hooks run whoever calls its ``step``)."""
        if not isinstance(mean, bool):
            raise ValueError(f"mean must be True (the loop divides each loss by their number) or False, got {mean!r}")
        self.model, self.optimizer, self.scheduler, self.mean = model, optimizer, scheduler, mean
        self.guard: Guard | None = guard
        self.trips = 0
        self._user = user
        self._capture = StepCapture(model)
        self._verdict: bool | None = None  # this step's, once checked
        self._hold_scheduler = False
        self._in_micro_step = False
        self._skipping = False
        self._step_skipped = False
        self._hooks = [
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward, with_kwargs=True),
        ]
        self._wrapper_step: Callable[..., Any] | None = None
        self._in_check = False
        if compat.accelerate_optimizer(guard.optimizer):
            # Accelerate's optimizer decides whether to step (accumulation, its GradScaler): the guard
            # checks at the step the loop calls, and a skip is said through it (``step_was_skipped``).
            self._wrapper_step = guard.optimizer.step
            guard.optimizer.step = self._step_through_wrapper  # type: ignore[method-assign]
        else:
            self._hooks += [
                guard.optimizer.register_step_pre_hook(self._before_step),
                guard.optimizer.register_step_post_hook(self._after_step),
            ]
        if scheduler is not None:
            self._scheduler_step = scheduler.step
            scheduler.step = self._scheduler_step_unless_skipped
        self._clip = ClipNorm(guard.health.params)  # the loop's clip_grad_norm_: the norm before it clipped
        self._ride = StepRide(guard, lambda: self._step_loss(self._capture.micro)) if self._rides else None

    @property
    def last_grad_norm(self) -> float | None:
        """``Guard.last_grad_norm``: the latest step's gradient norm, across ranks and before the
        loop's clip; NaN or Inf for a step that tripped; None before the first."""
        return self.guard.last_grad_norm if self.guard is not None else None

    @property
    def step_skipped(self) -> bool:
        """True when the latest ``optimizer.step()`` was skipped (a trip under ``skip`` or
        ``rollback``, or a batch ``check_batch`` rejected): the loop may leave out its logging of a
        step that did not happen. False before the first step."""
        return self._step_skipped

    # -- what the loop calls -----------------------------------------------------------------
    def micro_step(self, fn: F) -> F:
        """Decorate the function that computes one micro-batch's loss from its arguments (when
        the loss is computed outside the model); each call is recorded and a trip's replay calls
        it again, backward included.

        Example:
            >>> @guard.micro_step
            ... def loss_of(x, y):
            ...     return F.cross_entropy(model(x), y)
        """
        if not callable(fn):
            raise ValueError(f"micro_step takes the function computing a micro-batch's loss, got {type(fn).__name__}")
        if self.guard is None:
            return fn  # NANGUARD_DISABLE=1: nothing recorded

        @functools.wraps(fn)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if self._in_micro_step or not torch.is_grad_enabled() or not self.model.training:
                return fn(*args, **kwargs)
            if not self._capture.replaying:
                self._verdict = None  # as a forward does: a micro-step after the step's check starts the next step
            m = self._capture.record(args, kwargs)
            if m is not None:
                m.run = fn
                if self._ride is not None:
                    self._ride.open()
            self._in_micro_step = True
            try:
                loss = fn(*args, **kwargs)
            finally:
                self._in_micro_step = False
            if m is not None and _scalar(loss):
                m.loss = _local(loss.detach())
            return loss

        return recorded  # type: ignore[return-value]

    def close(self) -> None:
        """Unhook the loop and end the run's log (the guard's counters stay readable)."""
        if self.guard is None or not self._hooks:
            return
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._wrapper_step is not None:
            vars(self.guard.optimizer).pop("step", None)
        if self._ride is not None:
            self._ride.close()
        self._clip.close()
        self._unhook()
        if self.scheduler is not None:
            vars(self.scheduler).pop("step", None)
        self.guard.close()

    def _unhook(self) -> None:
        """What a subclass hooked besides the forwards and the steps."""

    def __enter__(self) -> LoopGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """The guard's counters and history, to save with a checkpoint."""
        return self.guard.state_dict() if self.guard is not None else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.guard is not None:
            self.guard.load_state_dict(state)

    # -- the loop's moments ------------------------------------------------------------------
    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        if self._in_micro_step or not module.training or not torch.is_grad_enabled():
            return  # inside a recorded micro_step, evaluation, or generation
        if compat.in_pipeline_metadata_inference():
            return  # a pipeline stage learning its shapes from uninitialized inputs: no micro-batch
        self._verdict = None  # a forward after the step's check starts the next step
        self._capture.record(args, kwargs)  # nothing during our own replay
        if self._capture.replaying or self.guard is None:
            return None
        if self._ride is not None:
            self._ride.open()  # the step's first forward: its flags ride from here to the check
        if not self.guard.config.check_batch:
            return None
        # A rejected batch still runs its forward and backward, on ids made valid, so that every
        # rank's collectives match; the step's check then rejects it on every rank (the recorded
        # batch is the original one).
        return _valid_ids(self._user, args, kwargs)

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        micro = self._capture.micro
        if self._in_micro_step or self._capture.replaying or not micro or micro[-1].loss is not None:
            return
        loss = _loss_of(output)
        if loss is not None:
            micro[-1].loss = _local(loss.detach())

    def _before_step(self, optimizer: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        if (args[1] if len(args) > 1 else kwargs.get("closure")) is not None:  # args[0] is the optimizer
            raise ValueError(
                "the guard checks the gradients the loop computed: call optimizer.step() without a "
                "closure, or use ng.Guard(...).step(closure)"
            )
        ok, self._verdict = self._decide(), None
        # A skipped step's gradients are gone (capture.check dropped them): this step changes nothing.
        self._skipping = self._step_skipped = not ok
        if not ok:
            self._hold_scheduler = self.scheduler is not None

    def _after_step(self, optimizer: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        self._clip.clear()  # a clip after the check (Fabric's) was not the next step's
        if self._skipping:
            self._skipping = False
            return
        assert self.guard is not None
        self.guard.after_step()

    def _step_through_wrapper(self, *args: Any, **kwargs: Any) -> Any:
        """Accelerate's ``optimizer.step()``: checked where it really steps (not on an accumulating
        micro-batch), then stepped through the wrapper or skipped, the skip said as its scaler says one."""
        guard, step = self.guard, self._wrapper_step
        assert guard is not None and step is not None
        if self._in_check or not compat.accelerate_syncing(guard.optimizer):
            return step(*args, **kwargs)  # accumulating (the wrapper steps nothing), or the guard's own step
        self._in_check = True  # a GradScaler overflow: the guard steps the wrapper (its scaler) itself
        try:
            self._before_step(guard.optimizer, (guard.optimizer, *args), kwargs)
        finally:
            self._in_check = False
        if self._skipping:
            self._skipping = False
            compat.accelerate_set_skipped(guard.optimizer, True)
            return None
        compat.accelerate_set_skipped(guard.optimizer, False)
        out = step(*args, **kwargs)
        if not guard.optimizer.step_was_skipped:  # type: ignore[attr-defined]
            guard.after_step()
        return out

    def _scheduler_step_unless_skipped(self, *args: Any, **kwargs: Any) -> Any:
        if self._hold_scheduler:
            self._hold_scheduler = False
            return None
        return self._scheduler_step(*args, **kwargs)

    # -- the check and the replay ------------------------------------------------------------
    def _step_loss(self, micro: list[Micro]) -> torch.Tensor | None:
        """The loss the loop back-propagated over the step: the micro-batches' losses, averaged
        (``mean``) or summed; None (the gradients alone decide) when one is unknown."""
        if not micro or any(m.loss is None for m in micro):
            return None
        first = micro[0].loss
        if len(micro) == 1 and first is not None and first.ndim == 0 and first.dtype == torch.float32:
            return first  # one micro-batch's float32 loss: its own mean and sum
        losses = torch.stack([m.loss.float().reshape(()) for m in micro])  # type: ignore[union-attr]
        return losses.mean() if self.mean else losses.sum()

    def _decide(self) -> bool:
        """This step's verdict: checked once, the same answer after."""
        if self._verdict is not None:
            return self._verdict
        guard = self.guard
        assert guard is not None
        if self._ride is not None:
            self._ride.close()  # what rode is read by the check
        micro = self._capture.take()
        before = guard.last_diagnosis
        self._verdict = self._capture.check(
            guard,
            self._step_loss(micro),
            micro,
            replay=(lambda: self._replay(micro)) if micro else None,
            batch=_batch_of(micro, self._user.forward),
            on_raise=lambda: self._record(before),
            drop=self._drops_grads,
            grad_norm=self._loop_norm(),
        )
        if not self._verdict:
            self._record(before)
        return self._verdict

    def _loop_norm(self) -> torch.Tensor | None:
        """The step's grad norm as the loop computed it before the check (its clip's), or None."""
        return self._clip.take()

    def _replay(self, micro: list[Micro]) -> list[Any]:
        """Each micro-batch's forward (and loss), then backward on it scaled as the loop scaled it."""
        n = len(micro) if self.mean else 1

        def run(m: Micro) -> Any:
            with self._capture.precision(m):
                out = m.run(*m.args, **m.kwargs) if m.run is not None else self.model(*m.args, **m.kwargs)
            loss = out if m.run is not None else _loss_of(out)
            if not _scalar(loss):
                # A loss computed outside the model and no micro_step: trace the forward alone.
                dist.unobserved("the loss and the backward (the loss is computed outside the model)")
                return out
            self._backward(loss / n)
            return loss

        return self._capture.replay(self.model, micro, run)

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _record(self, before: Any) -> None:
        guard = self.guard
        assert guard is not None
        diag = guard.last_diagnosis
        if guard.last_action not in ("skip", "rollback", "raise") or diag is None or diag is before:
            return  # a batch dropped after a rollback was counted by the guard already
        self.trips += 1

    def _announces(self) -> bool:
        return dist.rank() == 0


@functools.lru_cache(maxsize=64)
def _signature(fn: Callable[..., Any], bound: bool) -> inspect.Signature:
    """``fn``'s signature, read once (every step names its inputs); ``bound``: without ``self``."""
    signature = inspect.signature(fn)
    return signature.replace(parameters=list(signature.parameters.values())[1:]) if bound else signature


def _loss_of(output: Any) -> torch.Tensor | None:
    """A model's loss in its output: a one-element tensor, ``output["loss"]``, or the first
    one-element floating tensor among a tuple's items (nanoGPT's ``logits, loss``)."""
    if isinstance(output, (tuple, list)):  # first: a Mapping's isinstance is an ABC's, slower
        output = next((t for t in output if _scalar(t)), None)
    elif isinstance(output, Mapping):
        output = output.get("loss")
    return output if _scalar(output) else None


def _local(loss: torch.Tensor) -> torch.Tensor:
    """A DTensor loss (tensor parallel with a parallel loss) as this rank's local value: its
    finiteness is what the check reads, and the ranks agree on it in the check's one all-reduce."""
    to_local = getattr(loss, "to_local", None)
    return to_local() if callable(to_local) else loss


def _valid_ids(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    """The forward's arguments with out-of-range integer ids (``check_batch``'s
    ``data.index_out_of_range``) replaced by 0; None when every id is in range."""
    from nanguard.audit import check_batch
    from nanguard.audit.data import vocab_of

    named = _named_arguments(model.forward, Micro(args, kwargs, rng={}))
    findings = check_batch(named, model=model)
    keys = {f.where.split("'")[1] for f in findings if f.cause == "data.index_out_of_range" and "'" in f.where}
    if not keys:
        return None
    vocab = vocab_of(model)
    if vocab is None:
        return None

    def fixed(name: str, value: Any) -> Any:
        if name not in keys or not isinstance(value, torch.Tensor) or value.is_floating_point():
            return value
        return torch.where((value < 0) | (value >= vocab), torch.zeros_like(value), value)

    names = list(_signature(getattr(model.forward, "__func__", model.forward), True).parameters)
    new_args = tuple(fixed(names[i] if i < len(names) else "", a) for i, a in enumerate(args))
    return new_args, {k: fixed(k, v) for k, v in kwargs.items()}


def _scalar(t: Any) -> TypeGuard[torch.Tensor]:
    return isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point()


def _batch_of(micro: list[Micro], forward: Callable[..., Any]) -> Any:
    """The step's inputs as the diagnosis names them, by the parameter names of the function they
    went to (``batch['idx']``); a list with one entry per micro-batch."""
    if not micro:
        return None
    # A recorded run wraps the forward it calls (``functools.wraps``): its signature is that
    # forward's, read from the cache, and the cache never holds a step's closure (its tensors).
    batches = [{**_named_arguments(getattr(m.run, "__wrapped__", m.run) or forward, m), **m.extra} for m in micro]
    return batches[0] if len(batches) == 1 else batches


def _named_arguments(fn: Callable[..., Any], m: Micro) -> dict[str, Any]:
    plan = _plan(getattr(fn, "__func__", fn), hasattr(fn, "__self__"), len(m.args), tuple(m.kwargs))
    if plan is None:  # no signature to read, or one the call does not fit
        return {**{f"args[{i}]": a for i, a in enumerate(m.args)}, **m.kwargs}
    args, kwargs = m.args, m.kwargs
    return {name: args[at] if isinstance(at, int) else kwargs[at] for name, at in plan}


@functools.lru_cache(maxsize=64)
def _plan(
    fn: Callable[..., Any], bound: bool, nargs: int, keys: tuple[str, ...]
) -> tuple[tuple[str, int | str], ...] | None:
    """Where each name of a call of ``fn`` with ``nargs`` positional arguments and the keywords ``keys`` takes its
    value from (a position, or a keyword), by the signature: bound once per shape of call, as every step
    calls alike. None when there is no signature to read, or the call does not fit it."""
    try:
        signature = _signature(fn, bound)
        bound_arguments = signature.bind(*range(nargs), **{key: key for key in keys}).arguments
    except (TypeError, ValueError):
        return None
    plan: list[tuple[str, int | str]] = []
    for name, at in bound_arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            plan.extend((key, key) for key in at)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            plan.extend((f"{name}[{i}]", position) for i, position in enumerate(at))
        else:
            plan.append((name, at))
    return tuple(plan)
