"""Megatron-core: its own training loop guarded where it stands, tensor, pipeline and data parallel.

``MegatronGuard(model, optimizer)`` takes Megatron's list of model chunks and its optimizer
(``get_megatron_optimizer``'s: the fp32 or mixed-precision optimizer, the DistributedOptimizer, a
ChainedOptimizer). After it, the loop is Megatron's: ``forward_backward_func(...)`` then
``update_successful, grad_norm, num_zeros = optimizer.step()``. The check runs inside that step,
where Megatron's own fp16 overflow check runs (``prepare_grads``): a step the guard skips returns
``(False, None, None)`` on every rank, exactly as Megatron's loss scaler skips an overflow, so the
loop's own ``if update_successful`` (the LR scheduler, the skipped-iterations counter) does the rest.

The gradient norm the guard checks is the one Megatron's optimizer reduces for its clip
(``optimizer.get_grad_norm()``: the TP/PP duplicates left out, the DistributedOptimizer's shards
summed over the world); the clip then uses that same value instead of reducing it again. The
ranks agree on the verdict in the guard's one small all-reduce.

The loss: Megatron's ``forward_step_func`` returns ``(output, loss_func)`` and the schedule calls
``loss_func`` on the last pipeline stage. ``guard.forward_step(forward_step_func)`` returns the
same function, recorded: the chunk's inputs and the RNG state before its forward, the tensor a
pipeline stage received, the gradient it received back, and the loss. A tripped step is replayed
on every rank from those records, each stage its own part, without data-parallel communication
(gradients by ``torch.autograd.grad``: Megatron's gradient buffers and hooks stay out of it);
tensor-parallel collectives run as in training, every rank of the group replaying together.

Megatron's own checks: with ``check_for_nan_in_grad`` on, Megatron raises "found NaN in local grad
norm" before the gradient reduction, in the backward. The guard takes that check over (nanguard
decides first): the local norm Megatron computes per bucket becomes the guard's "this rank's own
gradients before the reduction" flag, and the decision is the guard's at ``optimizer.step()``.
A ``RerunStateMachine`` validation that rejects a non-finite loss inside the guarded
``loss_func`` is deferred the same way; any other validation runs as Megatron wrote it.

Example:
    >>> from nanguard.integrations.megatron import MegatronGuard
    >>> guard = MegatronGuard(model, optimizer, policy="skip", run_dir="runs/exp1")
    >>> forward_step_func = guard.forward_step(forward_step_func)
    >>> for iteration in range(train_iters):                       # Megatron's loop, unchanged
    ...     for chunk in model:
    ...         chunk.zero_grad_buffer()
    ...     optimizer.zero_grad()
    ...     forward_backward_func(forward_step_func=forward_step_func, data_iterator=it, model=model, ...)
    ...     update_successful, grad_norm, num_zeros = optimizer.step()
    >>> guard.close()
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanguard import dist
from nanguard.errors import NonFiniteError
from nanguard.findings import Diagnosis
from nanguard.guard import Guard
from nanguard.guard.health import Engine
from nanguard.integrations import GuardedCallback, guard_options, require
from nanguard.integrations.capture import Micro, StepCapture
from nanguard.integrations.loop import _named_arguments, _valid_ids

_core: Any = require("megatron.core", "engines", "megatron-core")

__all__ = ["MegatronGuard"]

POLICIES = ("skip", "raise")


class MegatronGuard(GuardedCallback):
    """Checks each ``optimizer.step()`` of a Megatron-core loop for NaN/Inf, diagnoses a trip, and
    skips it (``update_successful=False`` on every rank) or raises.

    ``model`` is Megatron's list of model chunks (``DistributedDataParallel``-wrapped, ``Float16Module``
    inside or not; one chunk per rank, or several under virtual pipeline stages); ``optimizer`` what
    ``get_megatron_optimizer`` returned. ``policy`` is ``"skip"`` or ``"raise"``; ``**options`` are
    ``ng.Guard``'s. Module names are the model's own, as Megatron names them
    (``decoder.layers.0.mlp``), and a diagnosis carries the origin rank's ``tp``, ``pp`` and ``dp``
    coordinates in ``evidence["parallel"]``.

    Example:
        >>> guard = MegatronGuard(model, optimizer, policy="skip")
        >>> forward_step_func = guard.forward_step(forward_step_func)
        >>> update_successful, grad_norm, num_zeros = optimizer.step()   # False on a skipped step
    """

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        optimizer: Any,
        policy: str = "skip",
        *,
        run_dir: str | Path | None = None,
        **options: Any,
    ) -> None:
        chunks = _checked_arguments(model, optimizer, policy)
        guard_options(policy, options)
        self.chunks, self.optimizer = chunks, optimizer
        self.models = [_core.utils.unwrap_model(c) for c in chunks]
        inner = _inner_optimizers(optimizer)
        if not inner:
            raise ValueError("optimizer holds no torch optimizer on this rank (every parameter frozen)")
        user = self.models[0] if len(self.models) == 1 else nn.ModuleList(self.models)
        self.guard: Guard | None = Guard(user, inner[0], policy, run_dir=run_dir, **options)
        params = [p for opt in inner for group in opt.param_groups for p in group["params"]]
        self.coordinates = _coordinates()
        self.trips = 0
        self._user = user
        self._capture = StepCapture(user)
        self._received: list[Any] = []
        self._norm: torch.Tensor | None = None
        self._norm_raw: Any = None  # the norm as Megatron's get_grad_norm returned it (a float)
        self._checked = False
        self._replayed = False
        self._step_skipped = False
        self._originals: list[tuple[Any, str]] = []
        self._hooks = [c.register_forward_pre_hook(self._before_forward, with_kwargs=True) for c in chunks]
        self._patch(optimizer, "prepare_grads", self._prepare_grads)
        self._patch(optimizer, "step", self._step)
        chained = hasattr(optimizer, "chained_optimizers")  # its step reduces the norm by get_grad_norm
        self._patch(optimizer, _NORM_METHOD[chained], self._clip_norm(optimizer, chained))
        for m in self.models:
            self._patch(m, "set_input_tensor", self._set_input_tensor(m.set_input_tensor))
        self._nan_check = _LocalGradCheck(chunks)
        self.guard.attach_engine(
            Engine(
                grad_norm=lambda: self._norm,
                params=params,
                reduces_norm=_norm_of_every_rank(),
                watch=self._nan_check if self._nan_check.groups else None,
            )
        )

    # -- what the user wraps ------------------------------------------------------------------
    def forward_step(self, forward_step_func: Callable[..., Any]) -> Callable[..., Any]:
        """``forward_step_func`` (``(data_iterator, model) -> (output, loss_func)``), recorded: each
        call's chunk inputs, RNG state, received tensor and loss; a trip's replay runs the chunk and
        ``loss_func`` again.

        Example:
            >>> forward_step_func = guard.forward_step(forward_step_func)
        """
        if not callable(forward_step_func):
            raise ValueError(f"forward_step_func must be Megatron's forward step function, got {forward_step_func!r}")

        @functools.wraps(forward_step_func)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if self._capture.replaying or not torch.is_grad_enabled():
                return forward_step_func(*args, **kwargs)
            before = len(self._capture.micro)
            output, loss_func = forward_step_func(*args, **kwargs)
            if len(self._capture.micro) == before:  # the chunk was not called: nothing to replay
                return output, loss_func
            m = self._capture.micro[-1]
            m.extra["received"] = self._received[-1] if self._received else None
            self._received = []
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(functools.partial(self._received_grad, m))
                self._carry_stage(output)
            return output, self._loss(m, loss_func)

        return recorded

    @property
    def step_skipped(self) -> bool:
        """True when the latest ``optimizer.step()`` was skipped by the guard."""
        return self._step_skipped

    @property
    def last_diagnosis(self) -> Diagnosis | None:
        diag = self.guard.last_diagnosis if self.guard is not None else None
        if diag is None or diag.rank is None or diag.rank not in self.coordinates:
            return diag
        return replace(diag, evidence={**diag.evidence, "parallel": self.coordinates[diag.rank]})

    def close(self) -> None:
        """Unhook the loop and end the run's log (the counters stay readable)."""
        if self.guard is None or not self._hooks:
            return
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for obj, name in self._originals:
            vars(obj).pop(name, None)
        self._nan_check.close()
        self.guard.close()

    def __enter__(self) -> MegatronGuard:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the records --------------------------------------------------------------------------
    def _before_forward(self, chunk: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        if self._capture.replaying or not torch.is_grad_enabled() or not chunk.training:
            return None
        m = self._capture.record(args, kwargs)
        if m is not None:
            m.run = chunk
        if self.guard is None or not self.guard.config.check_batch:
            return None
        # Token ids past the vocabulary: the forward runs on ids made valid, so that every rank's
        # collectives match; the step's check then rejects the recorded batch on every rank.
        return _valid_ids(_core.utils.unwrap_model(chunk), args, kwargs)

    def _set_input_tensor(self, original: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def recorded(input_tensor: Any) -> Any:
            if not self._capture.replaying:
                self._received = [input_tensor]
            return original(input_tensor)

        return recorded

    def _carry_stage(self, output: torch.Tensor) -> None:
        """A pipeline stage before the last computes no loss: its parameter check rides in the gradient its
        output receives back (``Guard.carry_flags``), so in every gradient of the stage and in the norm
        Megatron reduces over the model-parallel group. The last stage's rides in its loss (``_loss``)."""
        if self.guard is not None and not _core.parallel_state.is_pipeline_last_stage():
            self.guard.carry_flags(output, checked=output.new_zeros((), dtype=torch.float32))

    def _received_grad(self, m: Micro, grad: torch.Tensor) -> None:
        if "loss_func" not in m.extra:  # a stage before the last: the gradient its output received back
            m.extra["grad"] = grad

    def _loss(self, m: Micro, loss_func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(loss_func)
        def recorded(output: Any, *args: Any, **kwargs: Any) -> Any:
            if self._capture.replaying or args or kwargs:
                return loss_func(output, *args, **kwargs)
            with _deferred_validation():
                outputs = loss_func(output)
            m.extra["loss_func"] = loss_func
            if isinstance(outputs, tuple) and isinstance(outputs[0], torch.Tensor):
                m.loss = outputs[0].detach().float().reshape(-1).sum()
                if self.guard is not None:
                    self.guard.carry_flags(outputs[0], checked=m.loss)  # into the reduced norm, on every rank
            return outputs

        return recorded

    # -- the step -----------------------------------------------------------------------------
    def _patch(self, obj: Any, name: str, fn: Callable[..., Any]) -> None:
        vars(obj)[name] = fn
        self._originals.append((obj, name))

    def _original(self, obj: Any, name: str) -> Callable[..., Any]:
        return getattr(type(obj), name).__get__(obj)

    def _step(self) -> Any:
        self._checked = False
        out = self._original(self.optimizer, "step")()
        if self._checked and not self._step_skipped and self.guard is not None:
            self.guard.after_step()
        self._norm = None
        return out

    def _prepare_grads(self) -> bool:
        """Megatron's ``prepare_grads`` (copy to the main gradients; under fp16 unscale and its own
        overflow check), then the guard's check: True (Megatron skips the step) when the step tripped."""
        found_inf = self._original(self.optimizer, "prepare_grads")()
        self._step_skipped = False
        if found_inf:  # Megatron's fp16 loss scaler skips its own overflow
            self._capture.take()
            return True
        guard = self.guard
        assert guard is not None
        self._norm_raw = self.optimizer.get_grad_norm()
        self._norm = _as_tensor(self._norm_raw)
        micro = self._capture.take()
        losses = [m.loss for m in micro if m.loss is not None]
        loss = torch.stack(losses).mean() if losses and len(losses) == len(micro) else None
        before = guard.last_diagnosis
        self._checked = True
        try:
            ok = self._capture.check(
                guard,
                loss,
                micro,
                replay=(lambda: self._replay(micro)) if micro else None,
                batch=_batch(micro),
                drop=False,
                grad_norm=self._norm,
            )
        except NonFiniteError:
            self.trips += 1
            raise
        finally:
            if self._replayed:  # the replay's gradients, never Megatron's main gradients
                self._replayed = False
                for model in self.models:
                    model.zero_grad(set_to_none=True)
        if not ok:
            self._step_skipped = True
            if guard.last_diagnosis is not before:
                self.trips += 1
        return not ok

    def _clip_norm(self, optimizer: Any, chained: bool) -> Callable[..., Any]:
        """Megatron's clip (or the chained optimizer's norm) on the norm the check already reduced."""
        if chained:

            def get_grad_norm() -> Any:
                return self._norm_raw if self._norm is not None else self._original(optimizer, "get_grad_norm")()

            return get_grad_norm

        def clip_grad_norm(clip_grad: float) -> Any:
            if self._norm is None:
                return self._original(optimizer, "clip_grad_norm")(clip_grad)
            norm = self._norm_raw
            params = optimizer.get_parameters()
            if params:
                _core.optimizer.clip_grads.clip_grad_by_total_norm_fp32(
                    params, clip_grad, norm, optimizer.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
                )
            return norm

        return clip_grad_norm

    # -- the replay ---------------------------------------------------------------------------
    def _replay(self, micro: list[Micro]) -> list[Any]:
        n = len(micro)
        self._replayed = True
        params = [p for model in self.models for p in model.parameters() if p.requires_grad]

        def run(m: Micro) -> Any:
            received, grad = m.extra.get("received"), m.extra.get("grad")
            # A pipeline stage that received non-finite activations (or gradients) did not create
            # them: the stage before it (after it) did, and replays them from finite inputs.
            if received is not None and not _finite(received):
                return None
            if received is not None:
                _set_received(m.run, received)
            assert m.run is not None
            with self._capture.precision(m):
                out = m.run(*m.args, **m.kwargs)
            loss_func = m.extra.get("loss_func")
            if loss_func is not None:
                loss = _scaled_loss(loss_func(out), n)
                self._backward(loss, params, None)
                return loss
            if grad is not None and isinstance(out, torch.Tensor) and _finite(grad):
                self._backward(out, params, grad)
            elif grad is None:
                dist.unobserved("the backward of this pipeline stage (no gradient came back to it)")
            return out

        with torch.enable_grad():  # Megatron's step, where the check runs, is under no_grad
            return self._capture.replay(self._user, micro, run)

    @staticmethod
    def _backward(out: torch.Tensor, params: list[torch.Tensor], grad: torch.Tensor | None) -> None:
        """Gradients by ``autograd.grad``: Megatron's gradient hooks and buffers stay out of the replay."""
        grads = torch.autograd.grad(out, params, grad_outputs=grad, allow_unused=True)
        for p, g in zip(params, grads, strict=True):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g


_NORM_METHOD = {False: "clip_grad_norm", True: "get_grad_norm"}


def _checked_arguments(model: nn.Module | Sequence[nn.Module], optimizer: Any, policy: str) -> list[nn.Module]:
    """``MegatronGuard``'s arguments checked: Megatron's model chunks (as a list), else a ValueError naming the
    argument and what it accepts."""
    if policy not in POLICIES:
        raise ValueError(
            f"policy must be one of {list(POLICIES)} under Megatron (a rollback would have to restore "
            f"Megatron's main parameters and optimizer shards), got {policy!r}"
        )
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    if not chunks or not all(isinstance(c, nn.Module) for c in chunks):
        raise ValueError(f"model must be Megatron's list of model chunks (nn.Module), got {model!r}")
    if not isinstance(optimizer, _core.optimizer.MegatronOptimizer):
        raise ValueError(
            "optimizer must be the optimizer get_megatron_optimizer returned (a MegatronOptimizer), "
            f"got {type(optimizer).__name__}"
        )
    return chunks


def _norm_of_every_rank() -> bool:
    """Does Megatron's clip norm stand for every rank's own gradients? It is reduced after the data-parallel
    gradient reduction, over the model-parallel group (tensor x pipeline; the DistributedOptimizer's over every
    rank), so a rank's NaN reaches it: its loss's and parameter check's riding in its gradients
    (``Guard.carry_flags``; a pipeline stage before the last, in the gradient its output receives). Under
    tensor parallelism a replicated parameter's gradient is counted on tensor-parallel rank 0 only: a NaN
    there alone on another rank (none reaching a gradient of its own shards) is seen by the parameter check
    after the update. Not under expert parallelism (its norm is reduced over another group): there the ranks
    agree by the guard's one small all-reduce. The same on every rank."""
    return _core.parallel_state.get_expert_model_parallel_world_size() == 1


def _inner_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron optimizer (a ChainedOptimizer's, in order)."""
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [p.optimizer for p in parts if isinstance(getattr(p, "optimizer", None), torch.optim.Optimizer)]


def _finite(value: Any) -> bool:
    """Are the floating tensors of ``value`` (a tensor or a list of them) all finite? (A trip only.)"""
    tensors = value if isinstance(value, list) else [value]
    with torch.no_grad():
        return all(
            bool(torch.isfinite(t).all()) for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()
        )


def _as_tensor(norm: Any) -> torch.Tensor:
    return norm if isinstance(norm, torch.Tensor) else torch.tensor(float(norm))


def _coordinates() -> dict[int, dict[str, int]]:
    """Every rank's Megatron coordinates (tensor, pipeline, data parallel rank), gathered once."""
    ps = _core.parallel_state
    mine = [
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_data_parallel_rank(),
    ]
    table = [mine]
    if dist.is_distributed():
        table = [[0, 0, 0] for _ in range(dist.world_size())]
        torch.distributed.all_gather_object(table, mine)
    return {r: {"tp": c[0], "pp": c[1], "dp": c[2]} for r, c in enumerate(table)}


def _set_received(chunk: Any, received: Any) -> None:
    """The tensor a pipeline stage received, set again for its replay (a leaf of its own)."""
    tensors = received if isinstance(received, list) else [received]
    fresh = [t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in tensors]
    _core.utils.get_attr_wrapped_model(chunk, "set_input_tensor")(fresh if isinstance(received, list) else fresh[0])


def _scaled_loss(outputs: Any, n: int) -> torch.Tensor:
    """The loss the schedule back-propagates from ``loss_func``'s outputs (``forward_step_calc_loss``)."""
    if len(outputs) == 3:
        loss, num_tokens, _ = outputs
        return loss / torch.clamp(num_tokens, min=1) / n
    return outputs[0] / n


def _batch(micro: list[Micro]) -> Any:
    """The step's inputs as the diagnosis names them: the chunk's forward arguments by name."""
    if not micro:
        return None
    batches = [_named_arguments(_core.utils.unwrap_model(m.run).forward, m) for m in micro]
    return batches[0] if len(batches) == 1 else batches


@contextlib.contextmanager
def _deferred_validation() -> Iterator[None]:
    """Inside the block, Megatron's ``RerunStateMachine`` leaves a non-finite result to the guard
    (its check raises or exits the job on one); any other validation runs as Megatron wrote it."""
    machine = _core.rerun_state_machine.get_rerun_state_machine()
    original = machine.validate_result

    def validate_result(result: Any, rejection_func: Callable[[Any], Any], *args: Any, **kwargs: Any) -> None:
        if isinstance(result, torch.Tensor) and not bool(torch.isfinite(result).all()):
            return
        if isinstance(result, float) and not math.isfinite(result):
            return
        original(result, rejection_func, *args, **kwargs)

    vars(machine)["validate_result"] = validate_result
    try:
        yield
    finally:
        vars(machine).pop("validate_result", None)


class _LocalGradCheck(dist.CommWatch):
    """Megatron's ``check_for_nan_in_grad`` (a raise before the gradient reduction) taken over: the
    local norm of each gradient bucket it computes, accumulated on the device, is the guard's
    "this rank's own gradients were non-finite" flag (no host read, no raise)."""

    def __init__(self, chunks: Sequence[nn.Module]) -> None:
        groups = [
            g
            for c in chunks
            for g in [*getattr(c, "bucket_groups", []), *getattr(c, "expert_parallel_bucket_groups", [])]
        ]
        self.groups = [g for g in groups if g.ddp_config.check_for_nan_in_grad]
        self._bad: torch.Tensor | None = None
        for group in self.groups:
            vars(group)["check_grads"] = self._check(group)

    def _check(self, group: Any) -> Callable[..., None]:
        def check_grads(check_for_nan_or_inf: bool, check_for_large: bool) -> None:
            for bucket in group.buckets:
                bad = torch.isfinite(bucket.grad_data.norm(p=2)).logical_not()
                self._bad = bad if self._bad is None else self._bad | bad

        return check_grads

    def reset(self) -> None:
        self._bad = None

    def local_flag(self, device: torch.device) -> torch.Tensor | None:
        bad, self._bad = self._bad, None
        return bad.to(device) if bad is not None else torch.zeros((), dtype=torch.bool, device=device)

    def close(self) -> None:
        for group in self.groups:
            vars(group).pop("check_grads", None)
