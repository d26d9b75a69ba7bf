"""The op tracer: a ``TorchDispatchMode`` that sees every aten op of forward and backward.

For each op it learns whether the op *created* a non-finite value (NaN from NaN-free
inputs, Inf from all-finite inputs) and carries a *taint* (the set of origins behind a
non-finite tensor) from inputs to outputs, so the origin that reached the results can be
told from dead ends. Statistics are kept only for creations, never clones of tensors.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from nanguard.stats import local, tensor_stats
from nanguard.tracer.modules import ModuleStack, user_source

__all__ = ["Origin", "Tracer", "flatten", "storage_key"]

aten = torch.ops.aten

# Ops that only move or select values: finite in, finite out. Casts are not here:
# float32 -> float16 overflows.
_MOVES = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.expand.default, aten.slice.Tensor,
    aten.select.int, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
    aten.clone.default, aten.detach.default, aten.alias.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.unbind.int, aten.cat.default, aten.stack.default,
    aten.embedding.default, aten.index_select.default, aten.as_strided.default,
    aten.zeros_like.default, aten.zero_.default, aten.view_as_real.default,
    aten.ones_like.default, aten.empty_like.default, aten.new_zeros.default,
    aten.new_empty_strided.default, aten.unsqueeze_.default, aten.chunk.default,
    # Bounded maps: finite inputs give finite outputs.
    aten.relu.default, aten.gelu.default, aten.tanh.default, aten.sigmoid.default, aten.abs.default,
    aten.neg.default, aten.clamp.default, aten.where.self, aten.masked_fill.Scalar,
    aten.threshold_backward.default, aten._softmax.default,
}  # fmt: skip
# Bookkeeping ops autograd inserts: not worth listing among "the ops before".
_QUIET = {aten.detach.default, aten.alias.default}
# Ops that raise on an out-of-range integer input.
INDEX_OPS = {
    "aten.embedding.default", "aten.index_select.default", "aten.gather.default",
    "aten.index.Tensor", "aten.nll_loss_forward.default", "aten.nll_loss2d_forward.default",
    "aten.one_hot.default", "aten.take.default", "aten.embedding_dense_backward.default",
    "aten.scatter.src", "aten.scatter_add.default", "aten.index_put_.default",
}  # fmt: skip
_SOFTMAX = {"aten._softmax.default", "aten._log_softmax.default", "aten._safe_softmax.default"}
_NORMS = {
    "aten.native_layer_norm.default", "aten.native_group_norm.default",
    "aten.native_batch_norm.default", "aten._native_batch_norm_legit.default",
    "aten._native_batch_norm_legit_functional.default", "aten._fused_rms_norm.default",
    "aten.rms_norm.default",
}  # fmt: skip
_LOW = (torch.float16, torch.bfloat16)
_RECENT = 6
_AFTER = 8


def flatten(obj: Any, path: str, out: list[tuple[str, Any]]) -> None:
    """Leaves of nested dicts, lists, tuples and dataclass/``ModelOutput``-like records."""
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
    elif isinstance(obj, dict) or (hasattr(obj, "items") and hasattr(obj, "keys")):
        for key, value in obj.items():
            flatten(value, f"{path}[{key!r}]", out)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            flatten(value, f"{path}[{i}]", out)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            flatten(getattr(obj, name), f"{path}.{name}", out)


def _leaves(obj: Any, out: list[Any]) -> list[Any]:
    """Flat leaves of an op's (nested) arguments; called on every op, so flat args take no recursion."""
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else (obj,)
    for x in items:
        if isinstance(x, (list, tuple, dict)):
            _leaves(x, out)
        else:
            out.append(x)
    return out


@dataclass
class Origin:
    """One place a non-finite value came from: an op that created it, or a source tensor."""

    id: int
    category: str  # "op" | "data" | "parameters" | "fill"
    kind: str  # "nan" | "inf"
    index: int  # op index where it was created or first consumed
    op: str | None
    module: str | None
    phase: str
    source: str | None = None
    node: str | None = None
    forward_op: str | None = None
    module_type: str | None = None
    path: str | None = None
    inputs: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[dict[str, Any]] = field(default_factory=list)
    scalars: list[Any] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    before: list[dict[str, Any]] = field(default_factory=list)
    after: list[dict[str, Any]] = field(default_factory=list)

    def to_evidence(self) -> dict[str, Any]:
        return {
            "category": self.category,
            "op": self.op,
            "module": self.module,
            "module_type": self.module_type,
            "phase": self.phase,
            "node": self.node,
            "forward_op": self.forward_op,
            "source": self.source,
            "path": self.path,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "scalars": self.scalars,
            **self.extra,
        }


@dataclass
class _Where:
    op: str
    module: str | None
    module_type: str | None
    phase: str
    node: str | None
    forward_op: str | None
    source: str | None
    eps: float | None


@dataclass
class _Status:
    version: int
    nan: bool
    inf: bool
    taint: frozenset[int]


@dataclass
class _Failure:
    op: str
    where: _Where
    error: BaseException
    index_args: list[dict[str, Any]]
    indexed_size: int | None


class Tracer(TorchDispatchMode):
    """Runs ops as usual and records where non-finite values are created.

    ``sources`` are the user's input tensors with their paths (``batch['x']``);
    ``protected`` holds parameters and buffers that in-place ops must not change for good:
    they are copied before the first write, and ``restore()`` puts them back.
    """

    def __init__(
        self,
        modules: ModuleStack,
        sources: list[tuple[str, torch.Tensor]],
        protected: list[torch.Tensor],
    ) -> None:
        super().__init__()
        self.modules = modules
        self.sources = {id(t): path for path, t in sources}
        self.source_storage = {storage_key(t): path for path, t in reversed(sources)}
        self.protected = {id(t): t for t in protected}
        # With a model its parameters' gradients are the results; without one, leaf tensors seen.
        self.track_leaves = modules.root is None
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.status: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.storage_taint: dict[int, frozenset[int]] = {}
        self.origins: list[Origin] = []
        self.nodes: dict[int, tuple[str | None, str | None, str, str | None, float | None]] = {}
        self.leaves: dict[int, torch.Tensor] = {}
        self.recent: deque[tuple[Any, str | None, str]] = deque(maxlen=_RECENT)
        self.index = 0
        self.failure: _Failure | None = None
        self._writes: dict[Any, tuple[int, ...]] = {}

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # The tracer never runs under torch.compile; skipping dynamo's wrapper saves a
        # Python frame on every op.
        return False

    # -- per-op work -------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.index += 1
        flat_in = _leaves(args, [])
        if kwargs:
            _leaves(kwargs, flat_in)
        self._protect(func, args)

        in_nan = in_inf = False
        taint: set[int] = set()
        inf_taint: set[int] = set()
        for x in flat_in:
            if isinstance(x, torch.Tensor):
                if not (x.is_floating_point() or x.is_complex()):
                    continue
                st = self._status_of(x)
                if st.nan or st.inf:
                    taint |= st.taint
                    if st.inf and not st.nan:
                        inf_taint |= st.taint
                in_nan |= st.nan
                in_inf |= st.inf
            elif isinstance(x, float) and not math.isfinite(x):
                in_nan |= math.isnan(x)
                in_inf |= math.isinf(x)

        try:
            out = func(*args, **kwargs)
        except BaseException as err:
            if self.failure is None:
                self.failure = self._failure(func, args, err)
            raise

        flat_out = [o for o in _leaves(out, []) if isinstance(o, torch.Tensor)]
        where: _Where | None = None
        for o in flat_out:
            if not (o.is_floating_point() or o.is_complex()):
                continue
            if func in _MOVES and not (in_nan or in_inf):
                self._set(o, False, False, frozenset())
                continue
            nan, inf = _flags(o)
            if not (nan or inf):
                self._set(o, False, False, frozenset())
                continue
            created_nan = nan and not in_nan
            created_inf = inf and not in_nan and (not in_inf or _new_inf(o, flat_in))
            if not (created_nan or created_inf) and not any(isinstance(x, torch.Tensor) for x in flat_in):
                # A factory op filled with NaN or +Inf (torch.full(..., nan)) creates it;
                # a -inf fill is a mask.
                created_nan, created_inf = nan, inf and not _only_neginf(o)
            out_taint = frozenset(taint)
            if created_nan or created_inf:
                where = where or self._where(func)
                origin = self._creation(func, args, kwargs, out, where, "nan" if created_nan else "inf")
                # A NaN made from an Inf keeps the Inf's origin: the Inf came first.
                out_taint = frozenset({origin.id} | (inf_taint if created_nan else set()))
            self._set(o, nan, inf, out_taint)
            self._note_after(func, out_taint, nan, where)

        if flat_out and torch.is_grad_enabled():
            self._note_nodes(func, flat_in)
        if func not in _QUIET:
            self.recent.append((func, self.modules.current_name(), _phase()))
        return out

    # -- helpers -----------------------------------------------------------------------
    def _status_of(self, t: torch.Tensor) -> _Status:
        version = _version(t)
        st = self.status.get(t)
        if st is not None and st.version == version:
            return st
        nan, inf = _flags(t)
        taint: frozenset[int] = frozenset()
        if nan or inf:
            key = storage_key(t)
            taint = self.storage_taint.get(key, frozenset()) if st is None else st.taint
            if not taint:
                taint = frozenset({self._source(t, nan, inf).id})
        st = _Status(version, nan, inf, taint)
        self._put(t, st)
        return st

    def _set(self, t: torch.Tensor, nan: bool, inf: bool, taint: frozenset[int]) -> None:
        self._put(t, _Status(_version(t), nan, inf, taint))
        if taint:
            self.storage_taint[storage_key(t)] = taint

    def _put(self, t: torch.Tensor, st: _Status) -> None:
        with contextlib.suppress(TypeError):
            self.status[t] = st

    def _source(self, t: torch.Tensor, nan: bool, inf: bool) -> Origin:
        """A tensor that arrived non-finite: user data, a parameter/buffer, or a constant."""
        where = self._where(None)
        path = self.sources.get(id(t)) or self.source_storage.get(storage_key(t))
        kind = "nan" if nan else "inf"
        stats = tensor_stats(t)
        # A tensor holding only -inf (and finite values) is a mask fill, not an origin by itself.
        only_neginf = not nan and not stats.get("posinf")
        if path is not None:
            category = "fill" if only_neginf else "data"
            owner = None
        elif isinstance(t, torch.nn.Parameter) or id(t) in self.protected:
            category = "parameters"
            path = self.modules.state_name(t)
            owner = path.rpartition(".")[0] if path is not None else None
        else:
            # Captured from outside fn (a closure's batch): treated as data.
            category = "fill" if only_neginf else "data"
            owner = None
        origin = Origin(
            id=len(self.origins),
            category=category,
            kind=kind,
            index=self.index,
            op=None,
            module=owner if category == "parameters" and owner is not None else where.module,
            module_type=where.module_type,
            phase="data" if category in ("data", "fill") else "parameters",
            source=where.source,
            path=path,
            inputs=[stats],
            extra={"consumer_op": where.op, "consumer_module": where.module},
            before=self.recent_ops(),
        )
        self.origins.append(origin)
        return origin

    def _where(self, func: Any) -> _Where:
        node = torch._C._current_autograd_node()
        module = self.modules.current
        if node is None:
            return _Where(
                op=_name(func) if func is not None else None,
                module=self.modules.current_name(),
                module_type=type(module).__name__ if module is not None else None,
                phase="forward",
                node=None,
                forward_op=None,
                source=user_source(),
                eps=self.modules.eps(module),
            )
        info = self.nodes.get(node._sequence_nr())
        node_name = node.name()
        if info is None:
            mod_name, mod_type, fwd, source, eps = _accumulate_owner(self.modules, node), None, None, None, None
        else:
            mod_name, mod_type, fwd, source, eps = info
        return _Where(
            op=_name(func) if func is not None else None,
            module=mod_name,
            module_type=mod_type,
            phase="backward",
            node=node_name,
            forward_op=fwd,
            source=source,
            eps=eps,
        )

    def _creation(self, func, args, kwargs, out, where: _Where, kind: str) -> Origin:
        tensors_in = [x for x in _leaves(args, []) if isinstance(x, torch.Tensor)]
        tensors_out = [o for o in _leaves(out, []) if isinstance(o, torch.Tensor)]
        scalars = [_scalar(x) for x in _leaves(args, []) if isinstance(x, (int, float, bool))]
        origin = Origin(
            id=len(self.origins),
            category="op",
            kind=kind,
            index=self.index,
            op=where.op,
            module=where.module,
            module_type=where.module_type,
            phase=where.phase,
            source=where.source,
            node=where.node,
            forward_op=where.forward_op,
            inputs=[tensor_stats(t) for t in tensors_in],
            outputs=[tensor_stats(t) for t in tensors_out],
            scalars=scalars,
            extra=_op_extra(func, args, kwargs, out, where),
            before=self.recent_ops(),
        )
        self.origins.append(origin)
        return origin

    def recent_ops(self) -> list[dict[str, Any]]:
        return [{"op": _name(func), "module": module, "phase": phase} for func, module, phase in self.recent]

    def _note_after(self, func: Any, taint: frozenset[int], nan: bool, where: _Where | None) -> None:
        if func in _QUIET:
            return
        for oid in taint:
            origin = self.origins[oid]
            if origin.index == self.index or len(origin.after) >= _AFTER:
                continue
            if origin.after and origin.after[-1].get("index") == self.index:
                continue
            w = where or self._where(func)
            origin.after.append({"index": self.index, "op": w.op, "module": w.module, "phase": w.phase, "nan": nan})

    def _note_nodes(self, func: Any, ins: list[Any]) -> None:
        """Remember which module and line each forward op ran in, keyed by the sequence
        number of the autograd node it creates, so its backward can be attributed."""
        if torch._C._current_autograd_node() is not None:
            return
        # Inside dispatch, autograd has already built this op's node: its number is one less.
        seq = torch._C._autograd._get_sequence_nr() - 1
        if seq not in self.nodes:
            module = self.modules.current
            self.nodes[seq] = (
                self.modules.current_name(),
                type(module).__name__ if module is not None else None,
                _name(func),
                user_source(),
                self.modules.eps(module),
            )
        if self.track_leaves:
            for x in ins:
                if isinstance(x, torch.Tensor) and x.requires_grad and x.is_leaf:
                    self.leaves[id(x)] = x

    def _protect(self, func: Any, args: tuple) -> None:
        writes = self._writes.get(func)
        if writes is None:
            writes = tuple(
                i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
            )
            self._writes[func] = writes
        for i in writes:
            if i < len(args):
                t = args[i]
                if isinstance(t, torch.Tensor) and id(t) in self.protected and id(t) not in self.saved:
                    self.saved[id(t)] = (t, t.detach().clone())

    def restore(self) -> None:
        with torch.no_grad():
            for t, copy in self.saved.values():
                t.copy_(copy)
        self.saved.clear()

    def _failure(self, func: Any, args: tuple, err: BaseException) -> _Failure:
        name = str(func)
        where = self._where(func)
        index_args = []
        indexed_size = None
        if name in INDEX_OPS:
            ints = [
                (i, x)
                for i, x in enumerate(_leaves(args, []))
                if isinstance(x, torch.Tensor) and not x.is_floating_point() and x.dtype != torch.bool
            ]
            for _, x in ints:
                stats = tensor_stats(x)
                stats["path"] = self.sources.get(id(x)) or self.source_storage.get(storage_key(x))
                index_args.append(stats)
            indexed_size = _indexed_size(name, args)
        return _Failure(name, where, err, index_args, indexed_size)


_NAMES: dict[Any, str] = {}


def _name(func: Any) -> str:
    name = _NAMES.get(func)
    if name is None:
        name = _NAMES[func] = str(func)
    return name


def _phase() -> str:
    return "backward" if torch._C._current_autograd_node() is not None else "forward"


def _flags(t: torch.Tensor) -> tuple[bool, bool]:
    t = local(t)
    if t.numel() == 0:
        return False, False
    # A finite float32 sum proves every element finite in one pass with no temporary;
    # only a non-finite sum (or an overflow of huge finite values) needs the exact check.
    if t.is_floating_point() and math.isfinite(t.sum(dtype=torch.float32).item()):
        return False, False
    if bool(torch.isfinite(t).all()):
        return False, False
    return bool(torch.isnan(t).any()), bool(torch.isinf(t).any())


def _only_neginf(t: torch.Tensor) -> bool:
    return not bool((t == math.inf).any()) and not bool(torch.isnan(t).any())


def _new_inf(out: torch.Tensor, inputs: list[Any]) -> bool:
    """Did an elementwise op make Inf where all its inputs were finite? ``exp`` of a masked
    row turns finite scores into +Inf beside the mask's -Inf: that is a creation."""
    if any(isinstance(x, float) and math.isinf(x) for x in inputs):
        return False  # an explicit +-inf fill value
    finite = torch.ones(out.shape, dtype=torch.bool, device=out.device)
    try:
        for x in inputs:
            if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
                finite &= torch.isfinite(x).broadcast_to(out.shape)
    except RuntimeError:
        return False  # not elementwise: fall back to "any Inf input means not created"
    return bool((torch.isinf(out) & finite).any())


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return -1


def storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return -1


def _scalar(x: Any) -> Any:
    return x if not isinstance(x, float) or math.isfinite(x) else str(x)


def _accumulate_owner(modules: ModuleStack, node: Any) -> str | None:
    variable = getattr(node, "variable", None)
    return modules.owner_of(variable) if isinstance(variable, torch.Tensor) else None


def _indexed_size(name: str, args: tuple) -> int | None:
    try:
        if name == "aten.embedding.default":
            return int(args[0].shape[0])
        if name in ("aten.index_select.default", "aten.gather.default"):
            return int(args[0].shape[args[1]])
        if name.startswith("aten.nll_loss"):
            return int(
                args[0].shape[-1] if args[0].dim() == 2 else args[0].shape[1] if args[0].dim() > 2 else args[0].shape[0]
            )
        if name == "aten.one_hot.default":
            return int(args[1]) if len(args) > 1 else None
        if name == "aten.index.Tensor":
            return int(args[0].shape[0])
    except (IndexError, TypeError, RuntimeError):
        return None
    return None


def _op_extra(func: Any, args: tuple, kwargs: dict, out: Any, where: _Where) -> dict[str, Any]:
    """Op-specific facts the rules need, computed only at a creation."""
    name = str(func)
    extra: dict[str, Any] = {}
    if where.eps is not None:
        extra["module_eps"] = where.eps
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    try:
        if name in _SOFTMAX and x is not None:
            dim = int(args[1])
            masked = (x == -math.inf).all(dim=dim)
            extra["rows"] = int(masked.numel())
            extra["fully_masked_rows"] = int(masked.sum())
            extra["input_max"] = float(x.detach().float().nan_to_num(0.0, 0.0, 0.0).max())
        elif name.startswith("aten.nll_loss") and len(args) >= 5:
            target, ignore_index = args[1], int(args[4])
            extra["targets"] = int(target.numel())
            extra["valid_targets"] = int((target != ignore_index).sum())
            extra["ignore_index"] = ignore_index
            extra["reduction"] = int(args[3])
        elif name in _NORMS:
            eps = next((a for a in reversed(args) if isinstance(a, float)), None)
            if eps is not None:
                extra["norm_eps"] = eps
            if x is not None and x.numel():
                flat = x.detach().float().reshape(x.shape[0], -1) if x.dim() > 1 else x.detach().float()[None]
                if name == "aten.native_layer_norm.default":
                    norm_numel = math.prod(args[1])
                    flat = x.detach().float().reshape(-1, norm_numel)
                extra["min_variance"] = float(flat.var(dim=-1, unbiased=False).min())
        elif name in ("aten.exp.default", "aten.exp_.default", "aten.pow.Scalar") and x is not None:
            extra["input_max"] = float(x.detach().float().nan_to_num(0.0, 0.0, 0.0).max())
    except (RuntimeError, IndexError, TypeError, ValueError):
        pass
    extra.update(_fp32_recompute(func, args, kwargs, out))
    return extra


def _fp32_recompute(func: Any, args: tuple, kwargs: dict, out: Any) -> dict[str, Any]:
    """For a low-precision creation, re-run the op in float32: is it finite there?"""
    outs = [o for o in _leaves(out, []) if isinstance(o, torch.Tensor)]
    if not outs or not any(o.dtype in _LOW for o in outs):
        return {}
    if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
        return {}

    def up(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dtype in _LOW:
            return x.detach().float()
        if isinstance(x, torch.dtype) and x in _LOW:
            return torch.float32
        if isinstance(x, (list, tuple)):
            return type(x)(up(v) for v in x)
        return x

    try:
        ref = func(*up(args), **{k: up(v) for k, v in kwargs.items()})
    except (RuntimeError, TypeError, ValueError):
        return {}
    refs = [r for r in _leaves(ref, []) if isinstance(r, torch.Tensor) and r.is_floating_point()]
    if not refs:
        return {}
    finite = all(bool(torch.isfinite(r).all()) for r in refs)
    absmax = max(float(r.detach().abs().nan_to_num(0.0, 0.0, 0.0).max()) if r.numel() else 0.0 for r in refs)
    low = next(o.dtype for o in outs if o.dtype in _LOW)
    return {
        "fp32_recompute": {
            "finite": finite,
            "absmax": absmax,
            "dtype": str(low).removeprefix("torch."),
            "dtype_max": float(torch.finfo(low).max),
        }
    }
