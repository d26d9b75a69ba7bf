"""Every private torch internal nanguard relies on, in one place (and, at the end, the
private Lightning and transformers internals its integrations use).

Each function below wraps one internal that torch does not promise to keep. The comment on
each names the torch versions it is known to work with; ``tests/test_compat.py`` exercises
each one against the installed torch, so an upgrade that changes them fails there, loudly,
rather than as a silent wrong answer inside a training run.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn import parameter as _parameter
from torch.utils import _python_dispatch

TESTED_TORCH = "2.13.0"
"""The newest torch every internal below was checked against (``tests/test_compat.py``); ``nanguard doctor``
and a bundle replayed under another torch say when the torch in use differs."""

# Known to work: torch 2.4 - 2.13.0. The base class of a mode that sees every aten op (the tracer's
# and the headroom check's); torch's own FlopCounterMode and DebugMode are built on it.
DispatchMode = _python_dispatch.TorchDispatchMode

# Known to work: torch 2.4 - 2.13.0. Aliases, not wrappers: the tracer calls them on every op.
# The number the next autograd node will get (nodes are numbered in creation order) ...
autograd_sequence_nr: Callable[[], int] = torch._C._autograd._get_sequence_nr
# ... and the autograd node whose backward is running now (None outside backward).
current_autograd_node: Callable[[], Any] = torch._C._current_autograd_node


def is_op_overload(target: Any) -> bool:
    """Is ``target`` an aten op (``torch.ops.aten.log`` or ``torch.ops.aten.log.default``)?"""
    return isinstance(target, (torch._ops.OpOverloadPacket, torch._ops.OpOverload))


def is_uninitialized(t: torch.Tensor) -> bool:
    """A lazy module's parameter or buffer that has no values yet (``nn.LazyLinear`` before its first call)."""
    return isinstance(t, _parameter.UninitializedTensorMixin)  # type: ignore[attr-defined]


__all__ = [
    "COMM_NAMESPACES",
    "DispatchMode",
    "autograd_sequence_nr",
    "compiled_backend",
    "current_autograd_node",
    "ddp_has_comm_hook",
    "ddp_join_enabled",
    "ddp_join_paused",
    "ddp_sync_pinned_off",
    "default_group",
    "drop_fsdp_accumulated_grads",
    "fabric_inner_optimizer",
    "fabric_modules",
    "foreach_copy_",
    "foreach_norm",
    "full_tensor",
    "fully_sharded",
    "has_forward_hooks",
    "hf_callbacks",
    "hf_initial_step",
    "hf_loss_scaling",
    "hf_loss_sum",
    "hf_set_initial_step",
    "hf_trainer_of",
    "inner_tensor",
    "is_op_overload",
    "is_uninitialized",
    "lightning_logging_off",
    "lightning_step_context",
    "lookup_backend",
    "olmo_drop_metrics",
    "olmo_skip_step_history",
    "pipeline_stage_hooks",
    "replicate_sync_off",
    "replicated",
    "scaler_scale",
    "scaler_steps_aside",
    "set_grad_enabled",
    "step_with_found_inf",
    "supports_found_inf",
    "swap_collectives",
    "written_tensors",
    "zero3_partition",
    "zero_local_optimizer",
    "zero_owners",
]


# Known to work: torch 2.13.0. ``torch._foreach_*`` are the multi-tensor kernels that
# torch.optim itself uses; one call covers every tensor of a (device, dtype) group.
def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    torch._foreach_copy_(dst, src)


# An alias, not a wrapper: the guard's two reads call it each step. Returns a sequence of norms.
foreach_norm: Callable[..., tuple[torch.Tensor, ...]] = torch._foreach_norm

# Known to work: torch 2.13.0. The default process group, whose ``rank()`` and ``size()`` are what
# ``tdist.get_rank()`` and ``tdist.get_world_size()`` return, read without their checks (a dozen calls
# each, and the guard asks several times a step); None when torch.distributed is not initialized. Read
# where ``_World.default_pg`` (a property: one call more each time) keeps it.
_C10D: Any = tdist.distributed_c10d if tdist.is_available() else None


def default_group() -> Any:
    return _C10D._world._default_pg if _C10D is not None else None


# Known to work: torch 2.4 - 2.13.0. The C function ``torch.no_grad()`` ends in: the guard's two reads
# a step switch grad mode with it (two calls, where the context manager makes a dozen).
set_grad_enabled: Callable[[bool], None] = torch._C._set_grad_enabled


# Known to work: torch 2.13.0. DDP keeps its registered hooks in ``_comm_hooks`` and accepts
# only one; there is no public way to ask whether one is set.
def ddp_has_comm_hook(model: nn.parallel.DistributedDataParallel) -> bool:
    return bool(model._comm_hooks)


# Known to work: torch 2.13.0. ``Join`` sets a ``_JoinConfig`` on each of its joinables when it is
# built (and never resets it); DDP's forward reads ``_join_config.enable`` to schedule the join
# context's all-reduces, which a local replay must not run.
def ddp_join_enabled(model: nn.Module) -> bool:
    """Has ``model`` (a DDP model) been handed to an enabled ``Join`` context (``with ddp.join():``)?"""
    config = getattr(model, "_join_config", None)
    return bool(getattr(config, "enable", False))


@contextlib.contextmanager
def ddp_join_paused(model: nn.Module) -> Iterator[None]:
    """Inside the block ``model``'s forward schedules none of the join context's collectives, nor
    its buffer broadcast (``require_forward_param_sync``): a rank that joined takes part in neither."""
    if not ddp_join_enabled(model):
        yield
        return
    from torch.distributed.algorithms.join import _JoinConfig

    saved, sync = model._join_config, model.require_forward_param_sync
    model._join_config = _JoinConfig.construct_disabled_join_config()
    model.require_forward_param_sync = False  # type: ignore[assignment]
    try:
        yield
    finally:
        model._join_config, model.require_forward_param_sync = saved, sync


# Known to work: torch 2.13.0. ``ZeroRedundancyOptimizer`` keeps this rank's shard in a plain local
# optimizer, ``.optim`` (its own ``state_dict()`` needs ``consolidate_state_dict()`` on every rank
# first, a gather), and which rank updates (and broadcasts) each parameter in ``_param_to_rank``.
def zero_local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The optimizer over this rank's own shard inside a ``ZeroRedundancyOptimizer``; None for any other."""
    # Looked up only where it was imported (a user who built one did): importing
    # ``torch.distributed.optim`` scripts its functional optimizers, and torch warns that
    # ``torch.jit.script`` is deprecated, on a run that has no ZeRO optimizer at all.
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    zero = getattr(module, "ZeroRedundancyOptimizer", None)
    return optimizer.optim if zero is not None and isinstance(optimizer, zero) else None


def zero_owners(optimizer: torch.optim.Optimizer) -> dict[int, int] | None:
    """``id(parameter) -> rank`` that updates it, for a ``ZeroRedundancyOptimizer``; None for any other."""
    if zero_local_optimizer(optimizer) is None:
        return None
    return {id(p): r for p, r in optimizer._param_to_rank.items()}  # type: ignore[attr-defined]


# Known to work: torch 2.13.0. ``GradScaler._scale`` is the scale as a device tensor;
# ``get_scale()`` would read it to the host, a sync on every step.
def scaler_scale(scaler: Any) -> torch.Tensor:
    return scaler._scale


# Known to work: torch 2.13.0. GradScaler keeps, per optimizer, whether ``unscale_`` ran
# this step; a second call raises, and a loop may already have unscaled to clip.
def scaler_unscaled(scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    from torch.amp.grad_scaler import OptState

    return scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.UNSCALED


# Known to work: torch 2.13.0. ``update()`` starts each step from a fresh
# ``defaultdict(_refresh_per_optimizer_state)``; swapping one in lets a replayed closure call
# ``unscale_`` again before the step's own ``unscale_`` is closed.
@contextlib.contextmanager
def scaler_steps_aside(scaler: Any) -> Iterator[None]:
    """Inside the block the scaler has no record of this step's ``unscale_``; after it, it has again."""
    from collections import defaultdict

    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    saved = scaler._per_optimizer_states
    scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
    try:
        yield
    finally:
        scaler._per_optimizer_states = saved


# Known to work: torch 2.13.0. The protocol GradScaler uses with fused optimizers: an
# optimizer with ``_step_supports_amp_scaling`` reads ``optimizer.found_inf`` in ``step()``
# and skips the update on the device when it is nonzero.
def supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    fused = any(group.get("fused") for group in optimizer.param_groups)
    return bool(fused and getattr(optimizer, "_step_supports_amp_scaling", False))


def step_with_found_inf(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """``optimizer.step()``, skipped on the device where ``found_inf`` (a float scalar) is nonzero."""
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf  # type: ignore[attr-defined]


# Known to work: torch 2.13.0. A module's own forward hooks are kept in ``_forward_hooks``;
# there is no public way to ask whether it has any.
def has_forward_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks)


# Known to work: torch 2.13.0. DDP's forward reads ``require_backward_grad_sync`` to decide
# whether the coming backward all-reduces (``no_sync()`` sets it False and back). A class with a
# property of that name shadows the instance attribute, so the loop's own writes land nowhere.
@contextlib.contextmanager
def ddp_sync_pinned_off(model: nn.parallel.DistributedDataParallel) -> Iterator[None]:
    """Inside the block ``model``'s backward never communicates, whatever the code inside sets
    ``model.require_backward_grad_sync`` to; after it, the value from before is back."""
    cls = type(model)
    model.__class__ = _pinned_off(cls)
    try:
        yield
    finally:
        model.__class__ = cls


_PINNED: dict[type, type] = {}


def _pinned_off(cls: type) -> type:
    if cls not in _PINNED:
        off = property(lambda self: False, lambda self, value: None, doc="False while a replay runs")
        _PINNED[cls] = type(cls.__name__, (cls,), {"require_backward_grad_sync": off, "__module__": cls.__module__})
    return _PINNED[cls]


# Known to work: torch 2.13.0 (FSDP2, ``fully_shard``): ``set_requires_gradient_sync`` is a method
# of each FSDP-managed module's class; an instance attribute of the same name shadows it.
@contextlib.contextmanager
def fsdp_sync_pinned_off(model: nn.Module) -> Iterator[None]:
    """Inside the block no FSDP2 module of ``model`` reduces gradients, whatever the code inside
    sets (torchtitan's chunked loss turns its output layer's sync back on for the last chunk)."""
    modules = [m for m in model.modules() if callable(getattr(m, "set_requires_gradient_sync", None))]
    for module in modules:
        setter: Callable[..., Any] = type(module).set_requires_gradient_sync  # type: ignore[attr-defined]
        setter(module, False, recurse=False)
        module.__dict__["set_requires_gradient_sync"] = functools.partial(_sync_off, module, setter)
    try:
        yield
    finally:
        for module in modules:
            module.__dict__.pop("set_requires_gradient_sync", None)


# Known to work: torch 2.13.0. ``torch.distributed._composable.replicate`` (OLMo-core's DDP) makes the
# module's class a subclass of its own ``DDP`` class; ``set_requires_gradient_sync`` (it takes no
# ``recurse``) is handed to the inner DistributedDataParallel by the next forward's pre-hook.
def replicated(model: nn.Module) -> bool:
    """Is ``model`` data parallel by ``torch.distributed._composable.replicate``?"""
    from torch.distributed._composable.replicate import DDP

    return isinstance(model, DDP)


@contextlib.contextmanager
def replicate_sync_off(model: nn.Module) -> Iterator[None]:
    """Inside the block a ``replicate``d ``model`` reduces no gradients."""
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


def _sync_off(
    module: nn.Module, setter: Callable[..., Any], requires_gradient_sync: bool, *, recurse: bool = True
) -> None:
    setter(module, False, recurse=recurse)


# Known to work: torch 2.13.0 (FSDP2, ``fully_shard``). With gradient sync off, FSDP2 keeps
# unsharded gradients on each FSDPParam to add to the next reduce-scatter.
# Known to work: torch 2.13.0 (``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``).
def row_offset(t: torch.Tensor) -> int:
    """Where this rank's local shard of ``t`` starts along dim 0 of the full tensor: 0 for a plain
    tensor or a DTensor not sharded on dim 0 (FSDP2 and tensor parallel shard rows this way)."""
    placements = getattr(t, "placements", None)
    if placements is None or t.dim() == 0:
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, placements)  # type: ignore[attr-defined]
    return int(offset[0]) if offset else 0


def zero3_partition(p: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """A DeepSpeed ZeRO-3 parameter's partition on this rank (``p.ds_tensor``, flat) and where it starts
    in the flattened full parameter; None for any other tensor. Known to work: deepspeed 0.19.8, whose
    ``_partition_param`` gives each rank ``ds_tensor.ds_numel`` elements from ``ds_numel * rank``."""
    part = p.__dict__.get("ds_tensor")
    if not isinstance(part, torch.Tensor):
        return None
    import torch.distributed as tdist

    group = p.__dict__.get("ds_process_group")
    rank = tdist.get_rank(group) if tdist.is_initialized() else 0
    return part, int(part.__dict__.get("ds_numel", part.numel())) * rank


def fsdp_unsharded_grads(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The unsharded gradients FSDP2 holds for ``model``'s parameters while gradient sync is off,
    by the parameter's name; [] outside FSDP2."""
    names: dict[int, str] | None = None
    found: list[tuple[str, torch.Tensor]] = []
    for fsdp_param in _fsdp_params(model):
        names = names if names is not None else {id(p): n for n, p in model.named_parameters()}
        name = names.get(id(getattr(fsdp_param, "sharded_param", None)), "")
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        for grad in (getattr(fsdp_param, "unsharded_accumulated_grad", None), getattr(unsharded, "grad", None)):
            if isinstance(grad, torch.Tensor):
                found.append((name, grad))
    return found


def fully_sharded(model: nn.Module) -> bool:
    """Is any module of ``model`` ``fully_shard``'ed (FSDP2: its forward all-gathers the full weights)?"""
    return next(_fsdp_params(model), None) is not None


def _fsdp_params(model: nn.Module) -> Iterator[Any]:
    """Every FSDP2 parameter record (``FSDPParam``) of ``model``'s fully_shard'ed modules."""
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if not callable(get_state):
            continue
        group = getattr(get_state(), "_fsdp_param_group", None)
        yield from getattr(group, "fsdp_params", [])


def drop_fsdp_accumulated_grads(model: nn.Module) -> None:
    """Forget the unsharded gradients FSDP2 accumulated while gradient sync was off."""
    for fsdp_param in _fsdp_params(model):
        fsdp_param.unsharded_accumulated_grad = None
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if unsharded is not None:
            unsharded.grad = None


# Known to work: torch 2.13.0. Model code calls ``torch.distributed.all_reduce`` and friends
# through the module attribute, so replacing the attribute reroutes those calls; the
# stand-ins must accept the same leading positional arguments and ``async_op``.
@contextlib.contextmanager
def swap_collectives(stand_ins: Mapping[str, Callable[..., Any]]) -> Iterator[None]:
    """Replace ``torch.distributed.<name>`` by ``stand_ins[name]`` inside the block."""
    missing = sorted(name for name in stand_ins if not callable(getattr(tdist, name, None)))
    if missing:
        raise RuntimeError(f"torch.distributed {torch.__version__} has no {missing}: nanguard's compat needs updating")
    saved = {name: getattr(tdist, name) for name in stand_ins}
    try:
        for name, stand_in in stand_ins.items():
            setattr(tdist, name, stand_in)
        yield
    finally:
        for name, original in saved.items():
            setattr(tdist, name, original)


# Known to work: torch 2.13.0. ``DTensor.full_tensor()`` gathers (or reduces a ``Partial``) into
# the whole value on every rank of its mesh: a collective every rank must call.
def full_tensor(t: torch.Tensor) -> torch.Tensor | None:
    """The whole value of a DTensor (a collective on its mesh), else None."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)  # none exists unless imported
    return t.full_tensor() if dtensor is not None and isinstance(t, dtensor) else None


# Known to work: torch 2.13.0. A DTensor keeps this rank's values in ``_local_tensor`` and a
# functional collective's pending result (``AsyncCollectiveTensor``) its buffer in ``elem``.
# ``DTensor.to_local()`` is an autograd Function under grad mode: inside the tracer's dispatch
# it would build a graph node of its own and shift the node numbers the tracer keys on.
def inner_tensor(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor a DTensor or an ``AsyncCollectiveTensor`` wraps on this rank, else None."""
    inner = getattr(t, "_local_tensor", None)
    if inner is None:
        inner = getattr(t, "elem", None)
    return inner if isinstance(inner, torch.Tensor) else None


# Known to work: torch 2.13.0. ``DTensor.from_local`` with the DTensor's own mesh, placements, shape and stride
# makes no collective (``run_check=False``); a DTensor times a plain tensor raises ("got mixed torch.Tensor and
# DTensor") on some meshes, and times a replicated DTensor factor may redistribute.
def times_local(t: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``t`` times a 0-dim ``factor`` on this rank's values alone (a DTensor's local tensor, its placements
    kept; a DTensor factor's local value; no communication), for a gradient hook."""
    own = inner_tensor(factor)
    factor = own if own is not None else factor
    inner = getattr(t, "_local_tensor", None)
    if not isinstance(inner, torch.Tensor):
        return t * factor.to(t.dtype)
    from torch.distributed.tensor import DTensor

    dt: Any = t
    local = inner * factor.to(inner.device, inner.dtype)
    return DTensor.from_local(local, dt.device_mesh, dt.placements, run_check=False, shape=dt.shape, stride=dt.stride())


# Known to work: torch 2.13.0. The op namespaces of communication: torch.distributed's own
# ops (``c10d``: send, recv_, allreduce_, the process-group collectives), the functional
# collectives DTensor redistributes with (``_c10d_functional``: all_reduce, wait_tensor,
# _wrap_tensor_autograd, ...) and their autograd and legacy forms.
COMM_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "_dtensor"})


# Known to work: torch 2.13.0 (torch.distributed.pipelining). Every schedule runs a stage's
# microbatch through ``_PipelineStageBase.forward_one_chunk(fwd_chunk_id, args, kwargs, ...)``,
# which returns the stage's output, and its backward through
# ``backward_one_chunk(bwd_chunk_id, loss=None, ...)``, which leaves the gradients to send in
# ``bwd_cache[bwd_chunk_id]``; a stage's received gradients are ``_retrieve_recv_grads``'s result.
@contextlib.contextmanager
def pipeline_stage_hooks(
    on_forward: Callable[[Any, tuple[Any, ...], Any], None],
    on_backward: Callable[[Any, Any, Any], None],
) -> Iterator[None]:
    """While open, ``on_forward(stage, inputs, output)`` runs after each stage's microbatch forward
    (``inputs``: what the stage received, or the batch on the first stage) and
    ``on_backward(stage, received_grads, sent_grads)`` after each microbatch backward
    (``received_grads`` is None on the last stage, which starts from the loss)."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    forward, backward, recv_grads = (
        _PipelineStageBase.forward_one_chunk,
        _PipelineStageBase.backward_one_chunk,
        _PipelineStageBase._retrieve_recv_grads,
    )
    received: dict[tuple[int, int], Any] = {}

    def forward_one_chunk(self: Any, fwd_chunk_id: int, args: tuple[Any, ...], *rest: Any, **kw: Any) -> Any:
        output = forward(self, fwd_chunk_id, args, *rest, **kw)
        cached = self.fwd_cache.get(fwd_chunk_id)
        on_forward(self, tuple(cached[1]) if cached is not None else tuple(args), output)
        return output

    def retrieve_recv_grads(self: Any, bwd_chunk_id: int) -> Any:
        grads = recv_grads(self, bwd_chunk_id)
        received[(id(self), bwd_chunk_id)] = grads
        return grads

    def backward_one_chunk(self: Any, bwd_chunk_id: int, *rest: Any, **kw: Any) -> Any:
        result = backward(self, bwd_chunk_id, *rest, **kw)
        on_backward(self, received.pop((id(self), bwd_chunk_id), None), self.bwd_cache.get(bwd_chunk_id))
        return result

    _PipelineStageBase.forward_one_chunk = forward_one_chunk  # type: ignore[method-assign]
    _PipelineStageBase.backward_one_chunk = backward_one_chunk  # type: ignore[method-assign]
    _PipelineStageBase._retrieve_recv_grads = retrieve_recv_grads  # type: ignore[method-assign]
    try:
        yield
    finally:
        _PipelineStageBase.forward_one_chunk = forward  # type: ignore[method-assign]
        _PipelineStageBase.backward_one_chunk = backward  # type: ignore[method-assign]
        _PipelineStageBase._retrieve_recv_grads = recv_grads  # type: ignore[method-assign]


# Known to work: torch 2.13.0 (torch.distributed.pipelining). Before a schedule's first step, each
# stage runs its module once in ``_PipelineStageBase._forward_metadata_inference`` to learn its
# outputs' shapes; a stage past the first feeds it uninitialized tensors of the received shapes.
_METADATA_INFERENCE = "_forward_metadata_inference"


def in_pipeline_metadata_inference() -> bool:
    """Whether the current forward is a pipeline stage's shape inference (not a micro-batch of the
    step: its inputs are uninitialized memory). False without ``torch.distributed.pipelining``."""
    if "torch.distributed.pipelining.stage" not in sys.modules:
        return False
    frame = sys._getframe(1)
    for _ in range(16):  # the hook, the module's call and its wrappers (FSDP, checkpointing), the stage
        if frame is None:
            return False
        if frame.f_code.co_name == _METADATA_INFERENCE:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


# Known to work: torch 2.13.0. An op's schema marks the arguments it writes (``Tensor(a!)``), but
# the ``c10d`` ops declare no aliasing: those named in place (``recv_``, ``allreduce_``,
# ``_allgather_base_``) write into their tensor arguments.
def written_tensors(func: Any, args: tuple, kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """The tensors op ``func`` writes into, among ``args`` and ``kwargs`` (every tensor argument
    of an in-place ``c10d`` op: at most an input read again on its next use)."""
    from torch.utils._pytree import tree_leaves

    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    if getattr(func, "namespace", None) == "c10d" and schema.name.endswith("_"):
        return [t for t in tree_leaves((args, dict(kwargs))) if isinstance(t, torch.Tensor)]
    written: list[torch.Tensor] = []
    for i, arg in enumerate(schema.arguments):
        alias = arg.alias_info
        if alias is None or not alias.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        written += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


# Known to work: torch 2.4 - 2.13.0. The key-value store the default process group was initialized
# with (TCPStore under torchrun, FileStore for file://): ranks can share a value through it without
# a collective, so a rank that never asks holds no one up.
def default_store() -> Any:
    return tdist.distributed_c10d._get_default_store()


# -- framework internals (the integrations only; no framework is imported here) ------------


# Known to work: lightning 2.6.6. The precision plugin's context for a training step (autocast
# under "16-mixed"/"bf16-mixed"), as Lightning enters it around ``training_step``.
def lightning_step_context(trainer: Any) -> contextlib.AbstractContextManager[Any]:
    return trainer.strategy.precision_plugin.train_step_context()


# Known to work: lightning 2.6.6. ``LightningModule.log``/``log_dict`` are looked up on the
# instance first, so instance attributes shadow them for the block and are deleted after.
@contextlib.contextmanager
def lightning_logging_off(pl_module: Any) -> Iterator[None]:
    """Inside the block ``self.log(...)`` and ``self.log_dict(...)`` in the module do nothing."""
    pl_module.log = pl_module.log_dict = _ignore
    try:
        yield
    finally:
        del pl_module.log, pl_module.log_dict


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


# Known to work: lightning 2.6.6. ``fabric.setup`` returns a ``_FabricModule`` holding the
# strategy's module (DDP, FSDP, or the user's own; possibly compiled) as ``_forward_module``
# and the module the user passed as ``_original_module``.
def fabric_modules(module: nn.Module) -> tuple[nn.Module, nn.Module]:
    """``(forward module, the user's module)`` of a Fabric-wrapped module; ``(module, module)`` otherwise."""
    forward = getattr(module, "_forward_module", None)
    original = getattr(module, "_original_module", None)
    if isinstance(forward, nn.Module) and isinstance(original, nn.Module):
        return forward, original
    return module, module


# Known to work: lightning 2.6.6. ``_FabricOptimizer`` keeps the user's optimizer as
# ``optimizer`` (a property) and delegates ``step`` to the strategy.
def fabric_inner_optimizer(optimizer: Any) -> Any:
    inner = getattr(type(optimizer), "optimizer", None)
    return optimizer.optimizer if isinstance(inner, property) else optimizer


# Known to work: accelerate 1.15 - 1.16. ``accelerator.prepare`` returns an ``AcceleratedOptimizer``: a
# torch Optimizer subclass that never ran ``Optimizer.__init__`` (no step hooks of its own), holding the
# user's optimizer as ``optimizer``. Its ``step()`` steps that optimizer only when
# ``gradient_state.sync_gradients`` (the last micro-batch of an accumulation) and its GradScaler did not
# skip; ``step_was_skipped`` (read by ``AcceleratedScheduler.step`` and
# ``accelerator.optimizer_step_was_skipped``) is its ``_is_overflow``, which only its scaler's step sets.
def accelerate_optimizer(optimizer: Any) -> bool:
    """True for an Accelerate-prepared optimizer (a wrapper whose ``step()`` decides whether to step)."""
    gradient_state = getattr(optimizer, "gradient_state", None)
    return (
        isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer)
        and hasattr(gradient_state, "sync_gradients")
        and "_optimizer_step_pre_hooks" not in vars(optimizer)
    )


def accelerate_syncing(optimizer: Any) -> bool:
    """True when the wrapper's next ``step()`` is a real one (the accumulation's last micro-batch)."""
    return bool(optimizer.gradient_state.sync_gradients)


def accelerate_set_skipped(optimizer: Any, skipped: bool) -> None:
    """Say through the wrapper whether this step happened, as its GradScaler says for an overflow
    (without a scaler the wrapper never sets it: a skip's True would otherwise stay)."""
    optimizer._is_overflow = skipped


# Known to work: transformers 5.24.0. ``Trainer._tr_loss`` is the running sum of step losses
# since the last log (a one-element tensor added to in place); ``_initial_global_step`` is the
# step count ``train_loss`` and the throughput metrics leave out.
def hf_loss_sum(trainer: Any) -> torch.Tensor | None:
    total = getattr(trainer, "_tr_loss", None)
    return total if isinstance(total, torch.Tensor) and total.numel() == 1 else None


def hf_initial_step(trainer: Any) -> int | None:
    first = getattr(trainer, "_initial_global_step", None)
    return first if isinstance(first, int) and not isinstance(first, bool) else None


def hf_set_initial_step(trainer: Any, step: int) -> None:
    trainer._initial_global_step = step


# Known to work: transformers 5.24.0. Callbacks are not handed the Trainer; ``on_train_begin``
# is called from its training loop, a frame whose ``self`` is the Trainer, holding the callbacks
# in ``callback_handler.callbacks``.
def hf_trainer_of(callback: Any) -> Any:
    """The Trainer running ``callback``, found on the stack; None when there is none."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            callbacks = getattr(getattr(owner, "callback_handler", None), "callbacks", None)
            if isinstance(callbacks, list) and any(c is callback for c in callbacks):
                return owner
            frame = frame.f_back
        return None
    finally:
        del frame


def hf_callbacks(trainer: Any) -> list[Any]:
    return trainer.callback_handler.callbacks


# Known to work: ai2-olmo-core 3.0.x. ``Trainer._metrics`` holds each step's recorded metrics
# ({step: {name: tensor}}) until the next ``_log_metrics`` reduces and logs them; there is no
# public way to take one back.
def olmo_drop_metrics(trainer: Any, names: tuple[str, ...]) -> None:
    """Take the current step's metrics ``names`` out of what the OLMo-core trainer will log."""
    recorded = trainer._metrics.get(trainer.global_step)
    if recorded is not None:
        for name in names:
            recorded.pop(name, None)


# Known to work: ai2-olmo-core 3.0.x. ``SkipStepOptimizer`` keeps its rolling window of losses and
# grad norms in ``_losses`` and ``_grad_norms`` (appended to by its ``latest_loss``/``latest_grad_norm``
# setters, with no way to take one back).
def olmo_skip_step_history(optimizer: Any) -> tuple[list[Any], list[Any]]:
    """``(losses, grad norms)``: the lists an OLMo-core ``SkipStepOptimizer`` judges a step against."""
    return optimizer._losses, optimizer._grad_norms


# Known to work: transformers 5.24.0 (``Trainer.training_step``): the loss ``compute_loss`` returns is
# averaged over ``n_gpu`` replicas, then divided by the step's micro-batch count unless it is already
# normalized over the accumulated step (``loss_is_scaled_for_ga``, else a model taking loss kwargs
# given ``num_items_in_batch``, or a ``compute_loss_func``), then handed to ``accelerator.backward``.
def hf_loss_scaling(trainer: Any, num_items_in_batch: Any) -> tuple[bool, int]:
    """(average over GPUs, the divisor) ``training_step`` applies to ``compute_loss``'s loss."""
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        accepts = bool(getattr(trainer, "model_accepts_loss_kwargs", False))
        scaled = (accepts and num_items_in_batch is not None) or getattr(trainer, "compute_loss_func", None) is not None
    divisor = 1 if scaled else int(getattr(trainer, "current_gradient_accumulation_steps", 1) or 1)
    return int(getattr(trainer.args, "n_gpu", 1)) > 1, divisor


def compiled_backend(module: nn.Module) -> Any:
    """The backend a ``torch.compile``d module was compiled with ("inductor", a callable), or None.

    Dynamo keeps it at the end of a chain of wrappers on the compile context's callback, each
    holding the next as ``_torchdynamo_orig_backend`` (torch 2.4 - 2.13).
    """
    backend = getattr(getattr(module, "dynamo_ctx", None), "callback", None)
    for _ in range(8):
        inner = getattr(backend, "_torchdynamo_orig_backend", None)
        if inner is None or inner is backend:
            break
        backend = inner
    return backend if callable(backend) else None


def lookup_backend(name: Any) -> Callable[..., Any]:
    """Dynamo's compiler function for a backend name (``torch._dynamo.lookup_backend``)."""
    import torch._dynamo

    return torch._dynamo.lookup_backend(name)


# Known to work: torch 2.4 - 2.13.0. ``clip_grad_norm_`` computes the total norm, then hands it to the
# module-level ``_clip_grads_with_norm_`` (looked up at each call), also exported as
# ``torch.nn.utils.clip_grads_with_norm_``: every clip, whatever name the loop imported it by, passes
# the norm it computed there before scaling the gradients. It computes that norm with the module-level
# ``_get_total_norm``, also exported as ``torch.nn.utils.get_total_norm`` (which the loops that clip in
# two calls use: accelerate's DTensor clip, OLMo-core's, torchtitan's): over DTensor gradients, the norm
# is reduced over their mesh inside it.
_CLIP_WATCHERS: list[Callable[[Any, torch.Tensor], None]] = []
_CLIP_BEFORE: list[Callable[[list[torch.Tensor]], None]] = []
_CLIP_ORIGINAL: list[tuple[Callable[..., Any], Callable[..., Any]]] = []


def watch_clips(
    watcher: Callable[[Any, torch.Tensor], None], before: Callable[[list[torch.Tensor]], None] | None = None
) -> Callable[[], None]:
    """Call ``watcher(parameters, total_norm)`` before each ``clip_grad_norm_`` (or
    ``clip_grads_with_norm_``) scales the gradients, with the norm it computed; and ``before(grads)``
    before each total norm of gradients is computed (``get_total_norm``, in ``clip_grad_norm_`` too),
    while ``before`` may still change what that norm reduces. Returns the function that stops watching.
    The clip itself runs unchanged, and a watcher that raises only warns.

    Example:
        >>> stop = watch_clips(lambda params, norm: print(float(norm)))
        >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        >>> stop()
    """
    from torch.nn.utils import clip_grad

    if not _CLIP_ORIGINAL:
        original = clip_grad._clip_grads_with_norm_
        original_norm = clip_grad._get_total_norm

        @functools.wraps(original)
        def watched(parameters: Any, max_norm: float, total_norm: torch.Tensor, foreach: bool | None = None) -> None:
            if isinstance(parameters, torch.Tensor):
                parameters = [parameters]
            elif not isinstance(parameters, (list, tuple)):
                parameters = list(parameters)  # a generator is read once: the clip gets the same list
            _tell(_CLIP_WATCHERS, parameters, total_norm)
            return original(parameters, max_norm, total_norm, foreach)

        @functools.wraps(original_norm)
        def measured(tensors: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)  # read once
            if _CLIP_BEFORE:
                _tell(_CLIP_BEFORE, tensors)
            return original_norm(tensors, *args, **kwargs)

        _CLIP_ORIGINAL.append((original, original_norm))
        clip_grad._clip_grads_with_norm_ = watched
        torch.nn.utils.clip_grads_with_norm_ = watched
        clip_grad._get_total_norm = measured
        torch.nn.utils.get_total_norm = measured
    _CLIP_WATCHERS.append(watcher)
    if before is not None:
        _CLIP_BEFORE.append(before)

    def stop() -> None:
        if watcher in _CLIP_WATCHERS:
            _CLIP_WATCHERS.remove(watcher)
        if before is not None and before in _CLIP_BEFORE:
            _CLIP_BEFORE.remove(before)
        if not _CLIP_WATCHERS and _CLIP_ORIGINAL:
            original, original_norm = _CLIP_ORIGINAL.pop()
            clip_grad._clip_grads_with_norm_ = original
            torch.nn.utils.clip_grads_with_norm_ = original
            clip_grad._get_total_norm = original_norm
            torch.nn.utils.get_total_norm = original_norm

    return stop


def _tell(watchers: list[Callable[..., None]], *args: Any) -> None:
    for seen in list(watchers):
        try:
            seen(*args)
        except Exception as err:  # watching a clip must never break it
            warnings.warn(f"nanguard: reading the clip's norm failed: {err!r}", stacklevel=3)
