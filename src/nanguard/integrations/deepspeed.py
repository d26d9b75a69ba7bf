"""DeepSpeed: guard a ``deepspeed.initialize`` engine loop where it stands, ZeRO 0-3, fp32/bf16/fp16.

``DeepSpeedGuard(engine)`` watches the loop the user already wrote: each training forward of the
engine (its inputs and the RNG state before it), each ``engine.backward(loss)`` (the step's loss
is the micro-batches' mean, as DeepSpeed divides by the accumulation steps), and
``engine.step()`` at the gradient-accumulation boundary, which checks the step first and then
lets the engine step, or skips it *through the engine*, every rank agreeing.

Where the gradients live: ZeRO keeps them in its own partitioned buffers and ``param.grad`` is
None, so the guard reads each rank's own partition where the engine keeps it (stage 1 and 2:
the optimizer's averaged gradient partition; stage 3: its flat gradient partition; stage 0: the
parameters' averaged ``.grad``), divided by DeepSpeed's loss scale under fp16. No gradient is
gathered: the squared partition norms add up across ranks in the guard's one small all-reduce.
The parameter check reads the fp32 partitions the engine updates (ZeRO-3: their padding left out).

A skip is the engine's own: the step takes DeepSpeed's overflow path (gradient buffers cleared,
``engine.skipped_steps`` counted, the LR scheduler not stepped, ``global_steps`` advanced), as
a loss-scaler overflow does; under fp16 the loss scale is lowered only when the gradients were
non-finite, as DeepSpeed itself would have. A trip is replayed per rank without communication:
the module's forward (ZeRO-3 parameters gathered once with ``deepspeed.zero.GatheredParameters``,
ZeRO's fetch and reduce hooks held aside) and gradients by ``torch.autograd.grad``, which leaves
the engine's buffers alone; under fp16 the loss is scaled as the engine scaled it, so a backward
overflow the scaler would hide is found and named (``precision.overflow``, with the module).

Example:
    >>> from nanguard.integrations.deepspeed import DeepSpeedGuard
    >>> engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    >>> guard = DeepSpeedGuard(engine, policy="skip", run_dir="runs/exp1")
    >>> for batch in loader:
    ...     loss = engine(batch)           # recorded: inputs, RNG state
    ...     engine.backward(loss)          # recorded: the loss
    ...     engine.step()                  # checked first; skipped through the engine when it tripped
    >>> guard.close(); guard.skipped, guard.last_diagnosis
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from nanguard import dist, environ
from nanguard.findings import Diagnosis
from nanguard.guard import Guard
from nanguard.guard.health import Engine
from nanguard.guard.proof import replicas
from nanguard.integrations import guard_options, require
from nanguard.integrations.capture import Micro
from nanguard.integrations.loop import LoopGuard, _batch_of
from nanguard.stats import float_groups, total_norm

_ds: Any = require("deepspeed", "engines", "DeepSpeed")

__all__ = ["DeepSpeedGuard", "EngineState", "LossScale"]

log = logging.getLogger("nanguard")


class DeepSpeedGuard(LoopGuard):
    """Checks each optimizer step of a DeepSpeed engine loop for NaN/Inf, diagnoses a trip, and
    skips (through the engine), rolls back or raises, every rank agreeing.

    ``engine`` is what ``deepspeed.initialize`` returned (built with an optimizer); ``policy``
    and ``**options`` are those of ``ng.Guard`` (see ``GuardConfig``); the headroom check reads the
    engine's own forward as it runs (no second backward).
    When the loss is computed outside the model, decorate the function that computes it with
    ``@guard.micro_step`` (``LoopGuard.micro_step``) so a trip's replay runs it again.

    Example:
        >>> with DeepSpeedGuard(engine, policy="raise") as guard:
        ...     train(engine)
        Traceback (most recent call last):
        nanguard.errors.NonFiniteError: ... data.nonfinite ...
    """

    _rides = False  # the engine's own reductions carry the flags (attach_engine), or its one all-reduce

    _drops_grads = False  # the engine's own overflow path skips; offload's fp32 gradients are persistent buffers

    def __init__(
        self,
        engine: Any,
        policy: str = "skip",
        *,
        run_dir: str | Path | None = None,
        mean: bool = True,
        **options: Any,
    ) -> None:
        guard_options(policy, options)
        if not isinstance(engine, _ds.DeepSpeedEngine):
            raise ValueError(
                f"engine must be the DeepSpeedEngine deepspeed.initialize returned, got {type(engine).__name__}"
            )
        self.engine = engine
        self.announce = True
        """Print each diagnosis (rank 0); the Hugging Face callback, which prints its own, turns it off."""
        self.last_overflow: Diagnosis | None = None
        """The latest fp16 overflow DeepSpeed's loss scaler skipped, named by a replay (module, op, rank)."""
        if environ.disabled():  # NANGUARD_DISABLE=1: the engine as it is, nothing wrapped
            self._stay_off(engine)
            return
        self.state = EngineState(engine)
        scaler = LossScale(engine.optimizer) if self.state.fp16 and self.state.stage > 0 else None
        guard = Guard(
            engine.module,
            self.state.optimizer,
            policy,
            scaler=scaler,
            scheduler=engine.lr_scheduler,
            run_dir=run_dir,
            **options,
        )
        replicas(engine.module, gathers=True)  # the replay computes a rank's whole step: a peer can prove it
        self.state.expose_optimizer_state()
        guard.attach_engine(
            Engine(
                grad_norm=self.state.grad_norm,
                params=self.state.master_params(),
                sharded=self.state.stage > 0,
                tensors=self.state.partitions,
                holds_parameters=self.state.stage >= 3,
                reduces_norm=self.state.reduces_norm,
            )
        )
        self._losses: list[torch.Tensor] = []
        self._micro: list[Micro] = []  # the step just checked, for naming an overflow the scaler skipped
        self._replay_scale: float | None = None  # the loss scale a replay scales by (None: the engine's now)
        self._norm: torch.Tensor | None = None  # the step's norm as ZeRO reduced it, for the check
        self._originals: dict[str, Callable[..., Any]] = {"backward": engine.backward, "step": engine.step}
        # The engine steps its own LR scheduler, and not on a skip: nothing to hold.
        self._watch(engine, engine.optimizer, guard, scheduler=None, mean=mean, user=engine.module)
        for hook in self._hooks[2:]:  # the optimizer's step hooks: the engine's step is wrapped instead
            hook.remove()
        self._hooks = self._hooks[:2]
        engine.backward = self._engine_backward
        engine.step = self._engine_step

    def _unhook(self) -> None:
        for name in self._originals:
            vars(self.engine).pop(name, None)
        for name in ("state_dict", "load_state_dict"):
            vars(self.state.optimizer).pop(name, None)

    # -- what the loop calls -------------------------------------------------------------------
    def step(self, closure: Callable[[], Any]) -> Any:
        """``ng.Guard.step``'s form for an engine: ``closure`` runs the engine's forward and
        ``engine.backward(loss)`` and returns the loss; then ``engine.step()``, checked first and
        skipped through the engine when the step tripped. ``ng.Guard`` itself refuses an engine: it
        would step the torch optimizer behind ZeRO's back and read gradients ZeRO keeps elsewhere.

        Example:
            >>> def closure():
            ...     loss = engine(x, y)
            ...     engine.backward(loss)
            ...     return loss
            >>> loss = guard.step(closure)
        """
        if not callable(closure):
            raise ValueError(f"closure must run the forward and engine.backward and return the loss, got {closure!r}")
        loss = closure()
        self.engine.step()
        return loss

    def _engine_backward(self, loss: Any, *args: Any, **kwargs: Any) -> Any:
        if not self._capture.replaying and isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach())
            if self.guard is not None:
                self.guard.carry_flags(loss)  # into ZeRO's reduced norm: every rank sees this rank's NaN loss
        return self._originals["backward"](loss, *args, **kwargs)

    def _engine_step(self, *args: Any, **kwargs: Any) -> Any:
        step = self._originals["step"]
        if not self.engine.is_gradient_accumulation_boundary():
            return step(*args, **kwargs)
        scale = self.state.loss_scale()
        self._norm = self.state.reduced_norm()  # ZeRO's own reduction of the step, taken before its step
        self._step_skipped = not self._decide()  # step_skipped: also an fp16 overflow the engine skips
        if not self._step_skipped:
            out = self.state.step_taking_norm(step, *args, **kwargs)
            assert self.guard is not None
            self.guard.after_step()
            return out
        guard = self.guard
        assert guard is not None
        if guard.last_action == "rollback":
            self.state.regather()  # ZeRO-3's persistent parameters, from the restored partitions
        if guard.last_action == "overflow":
            # DeepSpeed's scaler's own business: the guard's check let it lower the scale already.
            self._name_overflow(scale, guard.step_count - 1)
            lower = False
        else:
            norm = guard.last_grad_norm
            lower = self.state.fp16 and norm is not None and not math.isfinite(norm)
        with self.state.skipping(lower_scale=lower):
            return step(*args, **kwargs)

    def _name_overflow(self, scale: float, step: int) -> None:
        """Replay a step the fp16 loss scaler skips (the gradients overflowed, every loss finite) at the
        scale it ran at, and name where it overflowed; every rank agrees, rank 0 says it."""
        assert self.guard is not None
        micro, self._micro = self._micro, []
        if not micro:
            return
        self._replay_scale = scale
        try:  # judged with the run's history, as a trip is: gradients that overflow because the run diverges
            diag = self.guard.engine_verdict(
                step,
                lambda: self._replay(micro),
                action="overflow",
                batch=_batch_of(micro, self._user.forward),
                rng=micro[0].rng,
                scale=scale,
            )
        finally:
            self._replay_scale = None
            dist.zero_grad(self.engine.module)
            self._capture.restore_stats()
        if diag is None:
            return
        self.last_overflow = diag
        if self._announces():
            log.warning(
                "nanguard: step %d: DeepSpeed's loss scaler skipped an fp16 overflow (scale %g): %s",
                step,
                scale,
                diag.summary(),
            )

    def _announces(self) -> bool:
        return self.announce and super()._announces()

    def _loop_norm(self) -> torch.Tensor | None:
        """The step's global grad norm as the engine reduced it (unscaled, ``EngineState.reduced_norm``); else the
        clip's."""
        taken, norm, self._norm = super()._loop_norm(), self._norm, None
        return taken if norm is None else norm

    # -- the check and the replay --------------------------------------------------------------
    def _step_loss(self, micro: list[Micro]) -> torch.Tensor | None:
        """The losses given to ``engine.backward`` over the step, averaged (``mean``) or summed."""
        losses, self._losses = self._losses, []
        self._micro = micro
        if not losses:
            return super()._step_loss(micro)
        if len(losses) == 1 and losses[0].ndim == 0 and losses[0].dtype == torch.float32:
            return losses[0]  # one micro-batch's scalar loss: its own mean and sum
        stacked = torch.stack([loss.float().reshape(-1).mean() for loss in losses])
        return stacked.mean() if self.mean else stacked.sum()

    def _replay(self, micro: list[Micro]) -> list[Any]:
        with self.state.replaying():
            return super()._replay(micro)

    def _backward(self, loss: torch.Tensor) -> None:
        """The replay's backward: gradients by ``autograd.grad`` (ZeRO's reduce hooks stay quiet),
        scaled as the engine scales the loss, written to ``.grad`` for the tracer to read."""
        params = [p for p in self.engine.module.parameters() if p.requires_grad]
        scale = self._replay_scale if self._replay_scale is not None else self.state.loss_scale()
        grads = torch.autograd.grad(loss * scale, params, allow_unused=True)
        for p, g in zip(params, grads, strict=True):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g


class EngineState:
    """What a DeepSpeed engine keeps where: this rank's gradient partition, its fp32 partitions,
    its loss scale; and the engine's own way to skip a step.

    Example:
        >>> state = EngineState(engine)
        >>> state.grad_norm()                         # this rank's partition, unscaled
        >>> with state.skipping(lower_scale=False):
        ...     engine.step()                         # DeepSpeed's overflow path: nothing updated
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.stage = int(engine.zero_optimization_stage())
        self.fp16 = bool(engine.fp16_enabled())
        self.zero = engine.optimizer
        inner = self.zero if isinstance(self.zero, torch.optim.Optimizer) else getattr(self.zero, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            raise ValueError(
                "the engine must be built with a torch optimizer (deepspeed.initialize(..., optimizer=...) or the "
                f"config's 'optimizer' section), got {type(self.zero).__name__}"
            )
        self.optimizer = inner
        # ZeRO-1/2 with the optimizer offloaded to the CPU (ZeRO-3 keeps its flat gradient buffer either way).
        self.offload = bool(getattr(self.zero, "cpu_offload", False))
        self.reduces_norm = _reduces_norm(engine, self.zero, self.stage)
        """The engine reduces the step's global grad norm itself (``_reduces_norm``): the check takes it
        before the step (``reduced_norm``), the step reuses it (``step_taking_norm``)."""
        self._scaled_norm: Any = None  # ZeRO-1/2: the scaled norm; ZeRO-3: the groups' norms; ZeRO-0: the clip's

    def grads(self) -> list[torch.Tensor]:
        """This rank's gradients as the engine keeps them at the accumulation boundary (scaled under fp16)."""
        zero = self.zero
        if self.stage >= 3:
            return [zero.grad_partitions_flat_buffer]
        if self.stage > 0 and self.offload:  # offloaded: the gradients wait in the fp32 partitions' .grad
            zero._wait_for_offload_copies()
            return [t.grad for t in zero.single_partition_of_fp32_groups if t.grad is not None]
        if self.stage > 0:
            return [t for group in zero.averaged_gradients.values() if group for t in group if t is not None]
        return [p.grad for p in self.engine.module.parameters() if p.grad is not None]

    def grad_norm(self) -> torch.Tensor | None:
        grads = self.grads()
        if not grads:
            return None
        norm = total_norm(float_groups(grads))
        return norm / self.loss_scale() if self.fp16 else norm

    def reduced_norm(self) -> torch.Tensor | None:
        """The step's global grad norm by the engine's own reduction, unscaled (non-finite when any rank's
        gradients, which its loss and parameter check ride in, are); None where it reduces none. ZeRO-1/2:
        ``scaled_global_norm``; ZeRO-3: its groups' norms (``_get_norm_groups``, combined as its step combines
        them); ZeRO-0: its fp32 clip (``clip_fp32_gradients``, over the gradients its backward averaged), run
        here instead of in the step: nothing touches the gradients between the two."""
        if not self.reduces_norm:
            return None
        if self.stage == 0:
            params = self.engine.module.parameters()
            self._scaled_norm = _ds.runtime.utils.clip_grad_norm_(
                parameters=params, max_norm=self.engine.gradient_clipping(), mpu=self.engine.mpu
            )
            return self._scaled_norm.reshape(())
        if self.stage >= 3:
            self._scaled_norm = self.zero._get_norm_groups()
            scaled = _ds.runtime.utils.combine_grad_norm_groups(self._scaled_norm)
        else:
            self._scaled_norm = scaled = self.zero.scaled_global_norm()
        return scaled / self.loss_scale() if self.fp16 else scaled

    def step_taking_norm(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``step(*args, **kwargs)`` (the engine's), reading the norm ``reduced_norm`` took instead of reducing it
        again (ZeRO-0: its clip, already made, is not made twice). An instance attribute set and put back, not a
        context manager: this runs every step."""
        taken, self._scaled_norm = self._scaled_norm, None
        if taken is None:
            return step(*args, **kwargs)
        if self.stage == 0:
            owner, name, stand_in = self.engine, "clip_fp32_gradients", lambda: None
        else:
            owner, name = self.zero, "_get_norm_groups" if self.stage >= 3 else "scaled_global_norm"
            stand_in = lambda *args, **kwargs: taken  # noqa: E731
        own = vars(owner)
        saved = own.get(name, _UNSET)
        own[name] = stand_in
        try:
            return step(*args, **kwargs)
        finally:
            if saved is _UNSET:
                own.pop(name, None)
            else:
                own[name] = saved

    def loss_scale(self) -> float:
        """DeepSpeed's loss scale now (1 without fp16)."""
        return float(self.zero.loss_scale) if self.fp16 else 1.0

    def master_params(self) -> list[torch.Tensor]:
        """The weights the engine updates on this rank: ZeRO's fp32 partitions (ZeRO-3: without their
        padding, ``_unpadded``), else the module's."""
        if self.stage >= 3:
            return _unpadded(self.zero)
        if self.stage > 0:
            return list(self.zero.single_partition_of_fp32_groups)
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def regather(self) -> None:
        """After a rollback under ZeRO-3: the parameters it keeps gathered between steps (the small,
        persistent ones) gathered again from the restored partitions, as its own step does (a collective)."""
        persistent = list(self.zero.persistent_parameters) if self.stage >= 3 else []
        if persistent:
            persistent[0].all_gather(persistent)

    def expose_optimizer_state(self) -> None:
        """ZeRO-3 keeps its torch optimizer's parameter groups empty between steps (it puts its fp32
        partitions in for each step and for its own checkpoints): the guard's snapshots read and load the
        optimizer's state with the partitions put in the same way."""
        if self.stage < 3:
            return
        inner, zero = self.optimizer, self.zero

        def with_partitions(fn: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                empty = all(not group["params"] for group in inner.param_groups)  # not inside ZeRO's own
                if empty:
                    zero._set_fp32_optimizer_param_groups()
                try:
                    return fn(*args, **kwargs)
                finally:
                    if empty:
                        zero._clear_fp32_optimizer_param_groups()

            return run

        vars(inner).update(
            state_dict=with_partitions(inner.state_dict), load_state_dict=with_partitions(inner.load_state_dict)
        )

    def partitions(self) -> list[torch.Tensor]:
        """What a rollback restores besides the module's and the inner optimizer's state dicts: ZeRO's
        fp32 partitions, and under ZeRO-3 the bit16 partitions the module's parameters are gathered from."""
        if self.stage >= 3:
            return [*self.zero.fp32_partitioned_groups_flat, *self.zero.fp16_partitioned_groups_flat]
        if self.stage > 0:
            return list(self.zero.single_partition_of_fp32_groups)
        return []

    @contextlib.contextmanager
    def skipping(self, *, lower_scale: bool) -> Iterator[None]:
        """Inside the block, ``engine.step()`` takes DeepSpeed's overflow path: its gradient buffers
        cleared, no update, ``skipped_steps`` counted, the LR scheduler held; the loss scale
        lowered only when ``lower_scale`` (the gradients overflowed, as the scaler would have seen)."""
        zero = self.zero

        def overflowed(*args: Any, **kwargs: Any) -> bool:
            zero.overflow = True
            return True

        patches: dict[str, Any]
        if self.stage >= 3:
            patches = {"_overflow_check_and_loss_scale_update": overflowed}
        elif self.stage > 0:
            patches = {"check_grad_overflow": True, "check_overflow": overflowed}
        else:
            patches = {"step": lambda *args, **kwargs: None, "overflow": True}
        if self.stage > 0 and not lower_scale:
            patches["_update_scale"] = lambda *args, **kwargs: None
        # ZeRO-0 clips the module's gradients before its step: the skipped step's were dropped already.
        clip = {"gradient_clipping": lambda: 0.0} if self.stage == 0 else {}
        with _patched(zero, patches), _patched(self.engine, clip):
            yield

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """Inside the block, calling the engine runs its module alone (no engine hooks on the loss),
        ZeRO's gradient hooks held aside (the replay's gradients stay out of its buffers), and under
        ZeRO-3 with every parameter gathered and ZeRO's fetch/release hooks held aside, so the replay
        communicates only to gather, the same on every rank."""
        engine = self.engine
        with contextlib.ExitStack() as stack:
            stack.enter_context(_patched(engine, {"forward": engine.module.__call__}))
            if self.stage > 0:  # ZeRO's per-parameter gradient hooks: reduce, partition, run the epilogue
                stack.enter_context(_hooks_aside(list(self.zero._grad_acc_hooks)))
            if self.stage >= 3:
                params = list(engine.module.parameters())
                stack.enter_context(_ds.zero.GatheredParameters(params, modifier_rank=None))
                offload = self.zero.parameter_offload
                stack.enter_context(_hooks_aside([*offload.forward_hooks, *offload.backward_hooks]))
            yield


class LossScale:
    """DeepSpeed's fp16 loss scaler, seen by the guard as its GradScaler: the guard reads its scale
    (the gradients it checks are divided by it) and, on an overflow (gradients non-finite, every loss
    finite), has it lower the scale as DeepSpeed does; the engine then skips the step itself. The
    gradients are DeepSpeed's to unscale: ``unscale_`` does nothing.

    Example:
        >>> scale = LossScale(engine.optimizer)
        >>> scale.get_scale()
        256.0
    """

    def __init__(self, zero: Any) -> None:
        from torch.amp.grad_scaler import OptState

        self.zero = zero
        # What the guard asks a GradScaler: has unscale_ run this step? Always yes.
        self._per_optimizer_states: defaultdict[int, dict[str, Any]] = defaultdict(lambda: {"stage": OptState.UNSCALED})

    @property
    def _scale(self) -> torch.Tensor:
        return torch.tensor(self.get_scale())

    def is_enabled(self) -> bool:
        return True

    def get_scale(self) -> float:
        return float(self.zero.loss_scale)

    def unscale_(self, optimizer: Any) -> None:
        """DeepSpeed unscales the gradients in its own step."""

    def step(self, optimizer: Any) -> None:
        """An overflow: the scale goes down as DeepSpeed's scaler takes it (its hysteresis included)."""
        self.zero._update_scale(True)

    def update(self, new_scale: float | None = None) -> None:
        """Only a new scale given (a reset after a collapse) changes it: DeepSpeed updates its own."""
        if new_scale is not None:
            self.zero.loss_scaler.cur_scale = float(new_scale)

    def state_dict(self) -> dict[str, Any]:
        scaler = self.zero.loss_scaler
        return {name: value for name, value in vars(scaler).items() if name in _SCALER_STATE}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        vars(self.zero.loss_scaler).update({k: v for k, v in state.items() if k in _SCALER_STATE})


_SCALER_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
_UNSET = object()


def _unpadded(zero: Any) -> list[torch.Tensor]:
    """ZeRO-3's fp32 partitions on this rank, the padding left out: views of the runs of elements that hold
    a parameter's values. A parameter whose size the ranks do not divide is padded to a multiple of their
    number at its end, in the last ranks' partitions: memory DeepSpeed allocates with ``torch.empty`` and
    never reads (a gather narrows it away, its gradient stays 0), so whatever it held stays (NaN a GPU's
    allocator handed out again). Read as weights, it would stop a healthy run. A group whose layout is not
    its parameters' partitions in order (its size tells), or that DeepSpeed describes otherwise, is read whole."""
    found = []
    for params, flat in zip(zero.fp16_groups, zero.fp32_partitioned_groups_flat, strict=True):
        try:
            runs = _real_runs(zero, params, flat.numel())
        except (AttributeError, TypeError, RuntimeError):
            runs = None
        if runs is None or runs == [[0, flat.numel()]]:
            found.append(flat)
        else:
            found += [flat[start:end] for start, end in runs]
    return found


def _real_runs(zero: Any, params: list[Any], total: int) -> list[list[int]] | None:
    """[start, end) of the elements of ZeRO-3's flat partition of ``params`` that hold their values, adjacent
    runs joined; None when the partitions' sizes do not add up to the flat partition's ``total``."""
    rank_of = getattr(zero, "_get_param_partition_rank", None)
    runs: list[list[int]] = []
    offset = 0
    for p in params:
        size = p.partition_numel()
        rank = rank_of(p) if rank_of is not None else torch.distributed.get_rank(zero.dp_process_group)
        real = min(size, max(0, p.ds_numel - size * rank))
        if real and runs and runs[-1][1] == offset:
            runs[-1][1] = offset + real
        elif real:
            runs.append([offset, offset + real])
        offset += size
    return runs if offset == total else None


def _reduces_norm(engine: Any, zero: Any, stage: int) -> bool:
    """Does the engine reduce the step's global grad norm where the check can take it before the step (and the
    step reuse it)? ZeRO-1/2 (``scaled_global_norm``, with ``compute_grad_norm``) and ZeRO-3 (``_get_norm_groups``)
    without the optimizer offloaded (the norm waits for the copies there) or ZeRO-3's Muon (its norm is of the
    Muon update); ZeRO-0 in fp32 with ``gradient_clipping`` (its clip reduces the norm over the data-parallel
    group) when the gradients are averaged by the backward (DeepSpeed's managed accumulation). The same on
    every rank (the configuration is)."""
    if stage in (1, 2):
        return not getattr(zero, "cpu_offload", False) and bool(getattr(zero, "compute_grad_norm", False))
    if stage >= 3:
        return not getattr(zero, "offload_optimizer", False) and not getattr(zero, "use_muon", False)
    plain = not (engine.fp16_enabled() or engine.bfloat16_enabled() or engine.torch_autocast_z0_gradscaler)
    managed = engine.managed_gradient_accumulation() and engine.enable_backward_allreduce
    return plain and managed and engine.gradient_clipping() > 0.0


@contextlib.contextmanager
def _patched(obj: Any, attrs: dict[str, Any]) -> Iterator[None]:
    """``obj``'s instance attributes set to ``attrs`` inside the block, as they were after it."""
    own = vars(obj)  # written directly: a module's __setattr__ would register a module value as a child
    saved = {name: own[name] for name in attrs if name in own}
    own.update(attrs)
    try:
        yield
    finally:
        for name in attrs:
            if name in saved:
                own[name] = saved[name]
            else:
                own.pop(name, None)


@contextlib.contextmanager
def _hooks_aside(handles: list[Any]) -> Iterator[None]:
    """Module hooks (by their handles) taken out inside the block, back in their places after it."""
    saved: list[tuple[dict[Any, Any], list[Any], Any, Any]] = []
    for handle in handles:
        hooks = handle.hooks_dict_ref()
        if hooks is not None and handle.id in hooks:
            saved.append((hooks, list(hooks), handle.id, hooks.pop(handle.id)))
    try:
        yield
    finally:
        for hooks, order, key, hook in reversed(saved):
            hooks[key] = hook
            place = {k: i for i, k in enumerate(order)}
            items = sorted(hooks.items(), key=lambda kv: place.get(kv[0], len(order)))
            hooks.clear()
            hooks.update(items)
