"""What the tracer knows about particular aten ops: tables and two registries.

``@op_facts(aten._softmax, ...)`` registers a function that computes, at a creation of a
non-finite value by one of those ops, the facts the diagnosis rules read (``fully_masked_rows``,
``valid_targets``, ``min_variance``, ...). ``@index_op(aten.embedding.default, ...)`` marks an
op that raises on an out-of-range index and says how many entries it indexes. Targets are
op overload packets (every overload) or single overloads.

``info(func)`` gathers what the tracer asks about an op on every call (its name, its table
memberships, whether finite inputs keep it finite, which arguments it writes) once per overload.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nanguard import compat
from nanguard.stats import local
from nanguard.tree import op_leaves

__all__ = [
    "ALLOCATIONS",
    "BLANK",
    "GRAD_FIRST",
    "KEEPS_FINITE",
    "LITERALS",
    "MASK_AWARE",
    "MASK_AWARE_NODES",
    "OVERWRITES",
    "QUIET",
    "SAME_VALUES",
    "WEIGHTED",
    "IndexFacts",
    "OpInfo",
    "creation_facts",
    "ignore_index",
    "ignores_first",
    "index_op",
    "index_size",
    "infinities_met",
    "info",
    "is_index_op",
    "op_facts",
    "op_name",
    "registered",
    "user_facts",
    "user_op_name",
]

aten = torch.ops.aten

# Ops that keep finite inputs finite: they only move, select, copy or bound values (a view
# reads its input's own values; every op below computes nothing that can overflow or divide).
# Casts are not here: float32 -> float16 overflows; nor are sums, products, scalings, nor gelu
# (bfloat16's largest value comes out Inf).
# The tracer skips the output check of these ops when no input (tensor or number) is NaN/Inf.
KEEPS_FINITE = {
    aten.clone,
    aten.cat,
    aten.stack,
    aten.embedding,
    aten.index_select,
    aten.gather,
    aten.index,
    aten.zeros_like,
    aten.ones_like,
    aten.empty_like,
    aten.new_zeros,
    aten.new_ones,
    aten.new_empty,
    aten.new_empty_strided,
    aten.zero_,
    aten._unsafe_view,
    aten.constant_pad_nd,
    aten.flip,
    aten.roll,
    aten.repeat,
    aten.slice_backward,
    aten.select_backward,
    aten.relu,
    aten.tanh,
    aten.sigmoid,
    aten.abs,
    aten.neg,
    aten.clamp,
    aten.where,
    aten.masked_fill,
    aten.threshold_backward,
    aten._softmax,
    aten.maximum,
    aten.minimum,
    aten.max,
    aten.min,
    aten.amax,
    aten.amin,
    aten.sort,
    aten.topk,
    aten.relu_,
    aten.clamp_,
    aten.masked_fill_,
    aten.clamp_min,
    aten.clamp_max,
}
# Views that reinterpret bits or may reach past their input's elements into the storage.
_UNSAFE_VIEWS = {aten.view.dtype, aten.as_strided, aten.as_strided_, aten.as_strided_scatter}
# Ops whose output holds every value of their tensor input, and no other, whenever it has at
# least as many elements: its NaN/Inf flags are the input's, read without a pass over it.
SAME_VALUES = {
    aten.view,
    aten._unsafe_view,
    aten._reshape_alias,
    aten.reshape,
    aten.t,
    aten.transpose,
    aten.permute,
    aten.unsqueeze,
    aten.squeeze,
    aten.expand,
    aten.alias,
    aten.detach,
    aten.clone,
}


# Bookkeeping ops autograd inserts: not worth listing among "the ops before".
def _record_function_ops() -> set[Any]:
    """The ops ``torch.profiler.record_function`` dispatches to mark a region (HF models and Lightning use it)."""
    try:
        return {
            torch.ops.profiler._record_function_enter_new.default,
            torch.ops.profiler._record_function_exit._RecordFunction,
        }
    except (AttributeError, RuntimeError):  # a torch without them: nothing to hide
        return set()


QUIET = {aten.detach.default, aten.alias.default, *_record_function_ops()}
# Ops that wrap a Python number (or a literal) in a tensor: the op that consumes the tensor
# is the one that writes the value (``h[i] = nan`` is lift_fresh, then index_put_).
LITERALS = {aten.lift_fresh.default, aten.lift_fresh_copy.default, aten.scalar_tensor.default}
# Ops (and their backward nodes) built to take -inf as a mask: a NaN they make from an
# all -inf row is theirs (a fully masked row), not the mask fill's.
MASK_AWARE = {"_softmax", "_log_softmax", "_safe_softmax", "logsumexp"}  # op packet names
MASK_AWARE_NODES = ("Softmax", "LogSoftmax", "SafeSoftmax", "Logsumexp")
# Backward kernels of the mask-aware ops whose first argument is the gradient flowing in (op names).
GRAD_FIRST = frozenset({"aten._softmax_backward_data.default", "aten._log_softmax_backward_data.default"})
# Ops that weigh an input as features: a 0/-inf tensor they consume is data, not an additive mask.
WEIGHTED = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.convolution.default,
    aten.mul.Tensor,
}
_LOW = (torch.float16, torch.bfloat16)

Facts = Callable[[tuple], dict[str, Any]]
_FACTS: dict[Any, Facts] = {}
_INDEX: dict[Any, Callable[[tuple], int | None]] = {}
# Ops whose output holds no value any op computed: memory allocated and not written (``empty``,
# ``empty_like``: what dropout's mask and an ``out=`` buffer start as), grown by ``resize_``, or
# pointed at another storage by ``set_``. Reading it reads whatever the allocator left there.
BLANK = {
    aten.empty,
    aten.empty_like,
    aten.new_empty,
    aten.new_empty_strided,
    aten.empty_strided,
    aten.empty_permuted,
    aten.resize_,
    aten.resize_as_,
    aten.set_,
}
# The allocations among them: memory returned holding no value at all (``resize_`` keeps what it had).
ALLOCATIONS = BLANK - {aten.resize_, aten.resize_as_, aten.set_}
# Ops that write every element of their first argument without reading it (a copy, a fill, a random draw):
# what it held is no input of theirs. An ``out=`` argument is the same (``_overwritten``).
OVERWRITES = {
    aten.copy_,
    aten.fill_,
    aten.zero_,
    aten.normal_,
    aten.uniform_,
    aten.bernoulli_,
    aten.random_,
    aten.exponential_,
    aten.geometric_,
    aten.log_normal_,
    aten.cauchy_,
}
_NAMES: dict[Any, str] = {}
# ``beta * input + alpha * (a @ b)``: with ``beta`` 0 the input is not read, and NaN/Inf in it are
# not propagated (torch's documented contract). Attention kernels pass an uninitialized buffer there
# (Megatron's ``baddbmm`` into its global memory buffer).
_BETA = {aten.addmm, aten.baddbmm, aten.addbmm, aten.addmv, aten.addr}


def ignores_first(func: Any, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Does ``func`` leave its first argument unread on this call (an addmm-family op with ``beta=0``)?

    Example:
        >>> ignores_first(aten.baddbmm.default, (buf, q, k), {"beta": 0.0})
        True
    """
    if getattr(func, "overloadpacket", None) not in _BETA:
        return False
    beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
    return isinstance(beta, (int, float)) and beta == 0


def _register(table: dict[Any, Any], targets: tuple[Any, ...], fn: Any) -> None:
    for target in targets:
        if not compat.is_op_overload(target):
            raise ValueError(f"targets must be aten ops or op overloads (aten.exp), got {target!r}")
        if target in table:
            raise ValueError(f"{target} is registered twice")
        table[target] = fn


def _lookup(table: dict[Any, Any], func: Any) -> Any:
    found = table.get(func)
    return found if found is not None else table.get(getattr(func, "overloadpacket", None))


def op_facts(*targets: Any) -> Callable[[Facts], Facts]:
    """Register ``fn(args) -> dict`` as the facts to record when one of ``targets`` creates NaN/Inf.

    Example:
        >>> @op_facts(aten.exp)
        ... def _exp(args):
        ...     return {"input_max": float(args[0].max())}
    """

    def register(fn: Facts) -> Facts:
        _register(_FACTS, targets, fn)
        return fn

    return register


def index_op(*targets: Any) -> Callable[[Callable[[tuple], int | None]], Callable[[tuple], int | None]]:
    """Register ``size(args) -> int | None``, the number of entries ``targets`` index (None: unknown)."""

    def register(fn: Callable[[tuple], int | None]) -> Callable[[tuple], int | None]:
        _register(_INDEX, targets, fn)
        return fn

    return register


def registered() -> set[Any]:
    """Every op with registered creation facts."""
    return set(_FACTS)


def _existing(*names: str) -> list[Any]:
    """The ops of these names that this torch version has (``_safe_softmax`` is recent)."""
    return [op for op in (getattr(aten, name, None) for name in names) if op is not None]


def op_name(func: Any) -> str:
    """``aten.exp.default``: the op's name, cached (``str`` of an op is slow, and the tracer asks per op)."""
    name = _NAMES.get(func)
    if name is None:
        name = _NAMES[func] = str(func)
    return name


@dataclass(frozen=True)
class OpInfo:
    """What the tracer asks about an op on every call, worked out once per overload."""

    name: str
    literal: bool  # wraps a Python number in a tensor (LITERALS)
    quiet: bool  # bookkeeping, left out of "the ops before" (QUIET)
    weighted: bool  # weighs an input as features (WEIGHTED)
    keeps_finite: bool  # finite inputs give finite outputs (KEEPS_FINITE, or a plain view)
    same_values: bool  # the output holds its input's values (SAME_VALUES)
    mask_aware: bool  # takes -inf as a mask (MASK_AWARE)
    view: bool  # returns a view of its first argument (any view: a dtype view too)
    flat: bool  # no argument is a list of tensors or floats: the positional arguments are the leaves
    read: int  # of a flat op's positional arguments, the first ``read`` may hold a tensor or a number (``_never_read``)
    writes: tuple[tuple[int, str], ...]  # (position, name) of the arguments the schema writes into
    call: Callable[..., Any]  # runs the op: an OpOverload's own C++ callable (one Python frame fewer), else the op
    blank: bool = False  # its output is memory no op has written (BLANK)
    allocates: bool = False  # a fresh allocation, its memory left as the allocator had it (ALLOCATIONS)
    overwrites: str | None = None  # "self" or "out": the argument it writes whole without reading (``_overwritten``)
    comm: bool = False  # communication between ranks (``collectives.is_comm``)
    beta: bool = False  # an addmm-family op, which may leave its first argument unread (``ignores_first``)


_INFO: dict[int, tuple[Any, OpInfo]] = {}


def info(func: Any) -> OpInfo:
    """The tracer's facts about ``func``, cached per op overload.

    The cache is keyed by ``id``: an ``OpOverload`` hashes in Python, and the tracer asks on every op.

    Example:
        >>> info(aten.view.default).keeps_finite
        True
    """
    hit = _INFO.get(id(func))
    if hit is not None and hit[0] is func:
        return hit[1]
    found = _describe(func)
    _INFO[id(func)] = (func, found)
    return found


def _in(table: set[Any], func: Any) -> bool:
    return func in table or getattr(func, "overloadpacket", None) in table


def _describe(func: Any) -> OpInfo:
    schema = getattr(func, "_schema", None)
    arguments = schema.arguments if schema is not None else []
    writes = tuple((i, a.name) for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write)
    view = bool(getattr(func, "is_view", False)) and not _in(_UNSAFE_VIEWS, func)
    return OpInfo(
        name=op_name(func),
        literal=func in LITERALS,
        quiet=func in QUIET,
        weighted=func in WEIGHTED,
        keeps_finite=view or _in(KEEPS_FINITE, func),
        same_values=_in(SAME_VALUES, func) and not _in(_UNSAFE_VIEWS, func),
        mask_aware=getattr(getattr(func, "overloadpacket", None), "__name__", None) in MASK_AWARE,
        view=bool(getattr(func, "is_view", False)),
        flat=schema is not None and all(_flat_type(str(a.type)) for a in arguments),
        read=_read_prefix(arguments),
        writes=writes,
        blank=_in(BLANK, func),
        allocates=_in(ALLOCATIONS, func),
        overwrites=_overwritten(func, writes),
        comm=getattr(func, "namespace", None) in compat.COMM_NAMESPACES,
        beta=getattr(func, "overloadpacket", None) in _BETA,
        call=_runner(func),
    )


def _runner(func: Any) -> Callable[..., Any]:
    """What runs ``func``: an ``OpOverload``'s ``_op`` where its ``__call__`` only forwards to it, else ``func``."""
    overload = torch._ops.OpOverload
    forwards = isinstance(func, overload) and type(func).__call__ is overload.__call__
    inner = getattr(func, "_op", None) if forwards else None
    return inner if inner is not None else func


# Schema types that never hold a tensor or a float (dims, sizes, flags, dtypes as ints, devices): an
# argument of these types can neither carry NaN/Inf nor be a tensor the tracer follows.
_NEVER_READ = frozenset({"int", "bool", "str", "Device", "Generator", "List[int]", "List[bool]"})


def _overwritten(func: Any, writes: tuple[tuple[int, str], ...]) -> str | None:
    """The argument ``func`` writes every element of without reading it: "self" for ``OVERWRITES``, "out"
    for an ``out=`` overload with one output; None for any other (``add_``, ``masked_fill_`` read theirs)."""
    if _in(OVERWRITES, func):
        return "self"
    return "out" if [name for _, name in writes] == ["out"] else None


def _read_prefix(arguments: list[Any]) -> int:
    """How many leading positional arguments may hold a tensor or a number: past the last that may,
    only dims, sizes and flags follow (``view(self, size)``, ``transpose(self, dim0, dim1)``: 1)."""
    positional = [a for a in arguments if not a.kwarg_only]
    read = [i for i, a in enumerate(positional) if not _never_read(str(a.type))]
    return read[-1] + 1 if read else 0


def _never_read(name: str) -> bool:
    inner = name[len("Optional[") : -1] if name.startswith("Optional[") else name
    return inner in _NEVER_READ


def _flat_type(name: str) -> bool:
    """Is an argument of this schema type a leaf, or a list of ints the tracer never reads?"""
    return "List[" not in name or name.removeprefix("Optional[").startswith(("List[int]", "List[SymInt]", "List[bool]"))


# ------------------------------------------------------------------------ creation facts


def creation_facts(func: Any, args: tuple, kwargs: dict, out: Any, module_eps: float | None) -> dict[str, Any]:
    """Op-specific facts the rules need, computed only at a creation."""
    extra: dict[str, Any] = {}
    if module_eps is not None:
        extra["module_eps"] = module_eps
    facts = _lookup(_FACTS, func)
    if facts is not None:
        with contextlib.suppress(RuntimeError, IndexError, TypeError, ValueError, AttributeError):
            extra.update(facts(args))
    counted = _lookup(_COUNTS, func)
    if counted is not None:
        with contextlib.suppress(RuntimeError, IndexError, TypeError, ValueError, AttributeError):
            extra.update(counted(args, kwargs))
    extra.update(_fp32_recompute(func, args, kwargs, out))
    return extra


def _finite_max(x: torch.Tensor) -> float:
    return float(x.detach().float().nan_to_num(0.0, 0.0, 0.0).max())


@op_facts(aten._softmax, aten._log_softmax, *_existing("_safe_softmax"))
def _softmax(args: tuple) -> dict[str, Any]:
    x, dim = args[0], int(args[1])
    masked = (x == -math.inf).all(dim=dim)
    facts = {"rows": int(masked.numel()), "fully_masked_rows": int(masked.sum()), "input_max": _finite_max(x)}
    if masked.dim() and bool(masked.any()):
        # The samples (dim 0) those rows belong to: where a batch mask emptied them, the samples to drop.
        facts["fully_masked_samples"] = masked.reshape(masked.shape[0], -1).any(1).nonzero().flatten()[:16].tolist()
    return facts


# Forward only: the backward ops take (grad, self, target, weight, reduction, ignore_index, ...).
@op_facts(aten.nll_loss_forward, aten.nll_loss2d_forward)
def _nll_loss(args: tuple) -> dict[str, Any]:
    target, weight, reduction, ignore_index = args[1], args[2], int(args[3]), int(args[4])
    valid = target != ignore_index
    facts: dict[str, Any] = {
        "targets": int(target.numel()),
        "valid_targets": int(valid.sum()),
        "ignore_index": ignore_index,
        "reduction": reduction,
    }
    if isinstance(weight, torch.Tensor) and weight.numel():
        # A mean with class weights divides by the weights of the valid targets, not their count.
        picked = weight.detach()[target[valid].clamp(0, weight.numel() - 1)]
        total = float(picked.sum())
        facts["class_weights"] = {
            "classes": int(weight.numel()),
            "zero_weight_classes": int((weight == 0).sum()),
            "sum": float(weight.detach().sum()),
        }
        facts["denominator"] = {"what": "the total class weight of the valid targets", "value": total}
        facts["denominator"]["zeros"] = int(total == 0)
        if total == 0 and facts["valid_targets"]:
            facts["target_classes"] = sorted({int(c) for c in target[valid].unique()[:8]})
    return facts


@op_facts(aten._weight_norm_interface)
def _weight_norm(args: tuple) -> dict[str, Any]:
    """weight_norm divides v by its own norm, one per slice along ``dim`` (the whole tensor for dim -1)."""
    v, dim = args[0].detach().float(), int(args[2]) if len(args) > 2 else 0
    if dim == -1 or v.dim() == 0:
        norms = torch.linalg.vector_norm(v).reshape(1)
    else:
        norms = torch.linalg.vector_norm(v.transpose(0, dim).reshape(v.shape[dim], -1), dim=1)
    return {
        "statistic": "L2 norm",
        "normalizes": True,
        "composite": "weight_norm",
        "denominator": {
            "what": "the L2 norm of weight_v per output channel",
            "size": int(norms.numel()),
            "zeros": int((norms == 0).sum()),
            "min": float(norms.min()),
        },
    }


@op_facts(aten.logdet, aten.linalg_slogdet, aten.slogdet)
def _determinant(args: tuple) -> dict[str, Any]:
    sign, _ = torch.linalg.slogdet(args[0].detach())
    return {
        "matrices": int(sign.numel()),
        "negative_determinants": int((sign < 0).sum()),
        "zero_determinants": int((sign == 0).sum()),
    }


def user_op_name(name: str | None) -> str:
    """The aten op of a user-level torch call (``logdet`` -> ``aten.logdet.default``), or ``torch.<name>``."""
    packet = getattr(aten, name or "", None)
    if isinstance(packet, torch._ops.OpOverloadPacket) and "default" in packet.overloads():
        return op_name(packet.default)
    return f"torch.{name}"


def user_facts(op: str, args: tuple) -> dict[str, Any]:
    """The registered creation facts of a user-level call's own aten op, read from the call's arguments."""
    packet = getattr(aten, op.removeprefix("aten.").split(".")[0], None) if op.startswith("aten.") else None
    facts = _lookup(_FACTS, packet) if packet is not None else None
    if facts is None:
        return {}
    with contextlib.suppress(RuntimeError, IndexError, TypeError, ValueError, AttributeError):
        return facts(args)
    return {}


def _norm_facts(x: torch.Tensor, args: tuple, width: int | None) -> dict[str, Any]:
    """The norm's eps (its last float argument), and the smallest and largest variance among the rows
    it normalizes (the largest is Inf where finite inputs are too large for their squares)."""
    facts: dict[str, Any] = {}
    eps = next((a for a in reversed(args) if isinstance(a, float)), None)
    if eps is not None:
        facts["norm_eps"] = eps
    if x.numel():
        flat = x.detach().float()
        if width is not None:
            flat = flat.reshape(-1, width)
        else:
            flat = flat.reshape(x.shape[0], -1) if x.dim() > 1 else flat[None]
        var = flat.var(dim=-1, unbiased=False)
        facts["min_variance"], facts["max_variance"] = torch.stack([var.min(), var.max()]).tolist()
    return facts


@op_facts(aten.native_layer_norm)
def _layer_norm(args: tuple) -> dict[str, Any]:
    return _norm_facts(args[0], args, math.prod(args[1]))


@op_facts(aten.native_group_norm)
def _group_norm(args: tuple) -> dict[str, Any]:
    """native_group_norm(x, weight, bias, N, C, HxW, groups, eps): a variance per (sample, group)."""
    x, n, c, hw, groups = args[0], int(args[3]), int(args[4]), int(args[5]), int(args[6])
    facts = _norm_facts(x, args, None)
    per_group = (c // groups) * hw if groups else 0
    facts["group_elements"] = per_group
    if x.numel() and per_group:
        facts["min_variance"] = float(x.detach().float().reshape(n * groups, -1).var(dim=-1, unbiased=False).min())
    return facts


@op_facts(
    aten.native_batch_norm,
    aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_functional,
    *_existing("_fused_rms_norm", "rms_norm"),
)
def _norm(args: tuple) -> dict[str, Any]:
    return _norm_facts(args[0], args, None)


# pow.Scalar (2 ** x) takes its tensor second: the first tensor argument is the one that grows.
@op_facts(aten.exp, aten.exp_, aten.pow)
def _growth(args: tuple) -> dict[str, Any]:
    return {"input_max": _finite_max(next(a for a in args if isinstance(a, torch.Tensor)))}


# -- reductions over too few elements (a mean, std or mean-reduced loss over nothing) -------
# These read kwargs too: std/var pass ``correction`` as a keyword.
_COUNTS: dict[Any, Callable[[tuple, dict], dict[str, Any]]] = {}


def _reduced(x: torch.Tensor, dim: Any) -> int:
    """How many elements of ``x`` each output element of a reduction over ``dim`` sums."""
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return int(x.numel())
    dims = [dim] if isinstance(dim, int) else list(dim)
    return math.prod(int(x.shape[d]) for d in dims) if x.dim() else 1


def _std_var(args: tuple, kwargs: dict) -> dict[str, Any]:
    correction = kwargs.get("correction")
    correction = 1.0 if correction is None else float(correction)
    return {
        "reduced_elements": _reduced(args[0], args[1] if len(args) > 1 else kwargs.get("dim")),
        "correction": correction,
    }


def _mean(args: tuple, kwargs: dict) -> dict[str, Any]:
    return {"reduced_elements": _reduced(args[0], args[1] if len(args) > 1 else kwargs.get("dim")), "correction": 0}


def _loss(args: tuple, kwargs: dict) -> dict[str, Any]:
    reduction = int(args[2]) if len(args) > 2 else int(kwargs.get("reduction", 1))
    facts: dict[str, Any] = {"targets": int(args[1].numel()), "reduction": reduction}
    if reduction == 1:  # mean: divides by the number of elements
        facts.update(reduced_elements=int(args[0].numel()), correction=0)
    return facts


_MEAN_LOSSES = (
    "smooth_l1_loss",
    "mse_loss",
    "l1_loss",
    "huber_loss",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "soft_margin_loss",
    "kl_div",
)
_register(_COUNTS, tuple(_existing("std", "var", "std_mean", "var_mean")), _std_var)
_register(_COUNTS, (aten.mean,), _mean)
_register(_COUNTS, tuple(_existing(*_MEAN_LOSSES)), _loss)


def _fp32_recompute(func: Any, args: tuple, kwargs: dict, out: Any) -> dict[str, Any]:
    """For a low-precision creation, re-run the op in float32: is it finite there? A DTensor
    argument is re-run on this rank's shard: the recompute runs on this rank alone, so it must
    neither communicate nor reduce a sharded result into a collective."""
    low = next((o.dtype for o in op_leaves(out) if isinstance(o, torch.Tensor) and o.dtype in _LOW), None)
    if low is None or any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
        return {}
    try:
        ref = func(*_up(args), **{k: _up(v) for k, v in kwargs.items()})
    except (RuntimeError, TypeError, ValueError):
        return {}
    refs = [local(r) for r in op_leaves(ref) if isinstance(r, torch.Tensor) and r.is_floating_point()]
    return {"fp32_recompute": _recomputed(refs, low)} if refs else {}


def _recomputed(refs: list[torch.Tensor], low: torch.dtype) -> dict[str, Any]:
    """What the float32 re-run of a ``low``-precision op gave: finite or not, and its largest magnitude."""
    return {
        "finite": all(bool(torch.isfinite(r).all()) for r in refs),
        "absmax": max(float(r.detach().abs().nan_to_num(0.0, 0.0, 0.0).max()) if r.numel() else 0.0 for r in refs),
        "dtype": str(low).removeprefix("torch."),
        "dtype_max": float(torch.finfo(low).max),
    }


def _up(x: Any) -> Any:
    """``x`` with its 16-bit float tensors (this rank's shard of a DTensor) and dtypes made float32."""
    if isinstance(x, torch.Tensor):
        x = local(x)
        return x.detach().float() if x.dtype in _LOW else x
    if isinstance(x, torch.dtype) and x in _LOW:
        return torch.float32
    if isinstance(x, (list, tuple)):
        return type(x)(_up(v) for v in x)
    return x


# ------------------------------------------------------------------------ index ops


@dataclass
class IndexFacts:
    """An index op that failed: its integer inputs' statistics and the size they index."""

    inputs: list[dict[str, Any]]
    size: int | None
    ignore_index: int | None


def is_index_op(func: Any) -> bool:
    """Does ``func`` raise on an out-of-range integer input?"""
    return _lookup(_INDEX, func) is not None


def index_size(func: Any, args: tuple) -> int | None:
    """How many entries ``func`` indexes with these arguments (None when unknown)."""
    size = _lookup(_INDEX, func)
    try:
        return size(args) if size is not None else None
    except (IndexError, TypeError, RuntimeError, AttributeError):
        return None


def ignore_index(func: Any, args: tuple) -> int | None:
    """The target value a loss skips (``nll_loss``'s ``ignore_index``), None for other ops."""
    if _lookup(_INDEX, func) is not _nll_classes:
        return None
    try:
        return int(args[4])
    except (IndexError, TypeError, ValueError):
        return None


@index_op(aten.embedding.default, aten.index.Tensor)
def _rows(args: tuple) -> int | None:
    return int(args[0].shape[0])


@index_op(aten.index_select.default, aten.gather.default)
def _along_dim(args: tuple) -> int | None:
    return int(args[0].shape[args[1]])


@index_op(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def _nll_classes(args: tuple) -> int | None:
    x = args[0]
    return int(x.shape[-1] if x.dim() == 2 else x.shape[1] if x.dim() > 2 else x.shape[0])


@index_op(aten.one_hot.default)
def _one_hot(args: tuple) -> int | None:
    return int(args[1]) if len(args) > 1 else None


@index_op(
    aten.take.default,
    aten.embedding_dense_backward.default,
    aten.scatter.src,
    aten.scatter_add.default,
    aten.index_put_.default,
)
def _unknown_size(args: tuple) -> int | None:
    return None


# -- infinities meeting infinities (inf - inf, inf + -inf, inf / inf) -------------------------
# The ops that combine two operands elementwise, and how each makes NaN from two infinities.
_MEETS: dict[Any, str] = {
    aten.sub: "-",
    aten.sub_: "-",
    aten.rsub: "r-",
    aten.add: "+",
    aten.add_: "+",
    aten.div: "/",
    aten.div_: "/",
}


def infinities_met(func: Any, flat_in: Sequence[Any], out: torch.Tensor) -> str | None:
    """``"-inf - (-inf)"``, ``"inf + (-inf)"`` or ``"inf / inf"`` when the NaN that ``func`` (a
    subtraction, an addition or a division) made sits where both its operands were infinite: the
    arithmetic combined two infinities. None for any other op or any other NaN (``0 / 0``)."""
    sign = _lookup(_MEETS, func)
    operands = [x for x in flat_in if isinstance(x, (torch.Tensor, float))][:2]
    if sign is None or len(operands) < 2 or not isinstance(out, torch.Tensor):
        return None
    if sign == "r-":
        sign, operands = "-", operands[::-1]
    with contextlib.suppress(RuntimeError):
        a, b = (torch.as_tensor(x, device=out.device).detach() for x in operands)
        met = torch.isnan(out) & torch.isinf(a) & torch.isinf(b)
        if not bool(met.any()):
            return None
        first = met.nonzero()[0].tolist()
        x, y = (float(t.broadcast_to(out.shape)[tuple(first)]) for t in (a, b))
        right = f"({_inf(y)})" if y < 0 else _inf(y)
        return f"{_inf(x)} {sign} {right}"
    return None


def _inf(x: float) -> str:
    return "-inf" if x < 0 else "inf"


# -- the log family: ops with a log (or a pole) inside, and where their domain ends --------------
def _count(mask: torch.Tensor) -> int:
    return int(mask.sum())


def _domain(boundary: torch.Tensor, outside: torch.Tensor, what: str) -> dict[str, Any]:
    return {"domain": what, "at_boundary": _count(boundary), "outside_domain": _count(outside)}


@op_facts(aten.xlogy)
def _xlogy(args: tuple) -> dict[str, Any]:
    """xlogy(x, y) = x * log(y): -inf where y == 0 and x != 0, NaN where y < 0."""
    x, y = (torch.as_tensor(a).detach() for a in args[:2])
    return _domain((y == 0) & (x != 0), y < 0, "y > 0 where x != 0 (x * log(y))")


@op_facts(aten.special_xlog1py)
def _xlog1py(args: tuple) -> dict[str, Any]:
    """xlog1py(x, y) = x * log(1 + y): -inf where y == -1 and x != 0, NaN where y < -1."""
    x, y = (torch.as_tensor(a).detach() for a in args[:2])
    return _domain((y == -1) & (x != 0), y < -1, "y > -1 where x != 0 (x * log(1 + y))")


@op_facts(aten.log1p, aten.log1p_)
def _log1p(args: tuple) -> dict[str, Any]:
    x = args[0].detach()
    return _domain(x == -1, x < -1, "x > -1 (log(1 + x))")


@op_facts(aten.logit, aten.logit_)
def _logit(args: tuple) -> dict[str, Any]:
    p = args[0].detach()
    eps = args[1] if len(args) > 1 and isinstance(args[1], float) else None
    if eps is not None:
        p = p.clamp(eps, 1 - eps)
    return _domain((p == 0) | (p == 1), (p < 0) | (p > 1), "0 < p < 1 (log(p / (1 - p)))")


@op_facts(aten.lgamma, aten.lgamma_, aten.digamma, aten.digamma_, aten.polygamma, aten.mvlgamma)
def _gamma_poles(args: tuple) -> dict[str, Any]:
    """lgamma, digamma and polygamma have poles at 0, -1, -2, ...: +-inf (or NaN) there."""
    x = next(a for a in args if isinstance(a, torch.Tensor)).detach()
    pole = (x <= 0) & (x == x.floor())
    return _domain(pole, torch.zeros_like(pole), "x not in {0, -1, -2, ...} (a pole of the gamma function)")


@op_facts(aten.special_entr)
def _entr(args: tuple) -> dict[str, Any]:
    x = args[0].detach()
    return _domain(torch.zeros_like(x, dtype=torch.bool), x < 0, "x >= 0 (-x * log(x))")
