"""Precursor signals of one training forward, measured as it runs, as device scalars (no host read).

Attention, routers and output logits are found by what they compute, whatever the classes are
called: a ``TorchFunctionMode`` tags each tensor a matmul of two activations made (a score,
q.k^T) and each one a matmul with a parameter made (a linear output, with the module that owns
it), and keeps the tag through the ops that take the tagged tensor first (scaling, a mask fill,
a split, a view). Then

- a softmax over a score (or its ``exp``, a softmax written by hand) is attention: ``attn_logit``
  is the largest logit it saw (a ``-inf`` mask fill is below every logit), for the module the
  softmax ran in;
  ``F.scaled_dot_product_attention`` computes the same scores from q and k (in chunks, its
  mask and ``is_causal`` applied), the one extra matmul of a sampled step;
- a softmax or top-k over a linear output inside a submodule is an MoE router: ``router_logit``;
- a linear output reaching ``cross_entropy``, ``log_softmax`` or ``logsumexp`` outside any submodule
  (or the model's returned logits) is the output layer: ``logit_z``, the RMS over positions of
  its logsumexp;
- each repeated layer (a child of a ``ModuleList``/``ModuleDict``) gives ``output_rms``.

Every value is reduced on the device; nothing is read here. The mode only reads what the ops
computed (and ``detach``es it), so the step's results are those of the step run without it.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from nanguard.stats import local
from nanguard.tracer.modules import _user_modules

__all__ = ["Capture", "Values", "layers", "owners_of"]

Values = dict[tuple[str, str], torch.Tensor]
"""``(module, signal) -> 0-dim float32 device tensor``."""

_SCORE, _LINEAR = "score", "linear"
_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm, torch.baddbmm}
_SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax, torch.exp, torch.Tensor.exp}  # exp: a softmax by hand
_LOGZ = {F.cross_entropy, F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax, torch.logsumexp}
_LOGZ_DIM1 = {F.cross_entropy}  # the class dim of a loss's input is 1
_TOPK = {torch.topk, torch.Tensor.topk}
_CHUNK = 1 << 24  # score elements per chunk of a scaled_dot_product_attention's recomputed logits


def layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated layers of ``model``: the children of its ``ModuleList``/``ModuleDict`` containers.

    Example:
        >>> [name for name, _ in layers(GPT(GPTConfig()))]
        ['blocks.0', 'blocks.1']
    """
    out = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            out += [(f"{name}.{child}" if name else child, m) for child, m in module.named_children()]
    return out


def owners_of(model: nn.Module) -> dict[int, str]:
    """Each parameter's owning module, by the parameter's id."""
    return {id(p): n.rpartition(".")[0] for n, p in model.named_parameters()}


class Capture(TorchFunctionMode):
    """Measures the precursors of the forward run inside it into ``values`` (see the module docstring).

    Example:
        >>> with Capture(model) as capture:
        ...     model(x)
        >>> sorted(capture.values)[0]
        ('blocks.0', 'output_rms')
    """

    def __init__(
        self,
        model: nn.Module,
        owners: dict[int, str] | None = None,
        repeated: list[tuple[str, nn.Module]] | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.values: Values = {}
        self._tags: dict[int, tuple[weakref.ref[torch.Tensor], str, str]] = {}
        self._owners = owners if owners is not None else owners_of(model)
        self._layers = repeated if repeated is not None else layers(model)
        self._stack = _Names(model)
        self._hooks: list[Any] = []
        self._handlers: dict[Any, Callable[[Any, tuple, dict], None]] = {}
        for funcs, handler in ((_SOFTMAX, self._softmax), (_LOGZ, self._logz), (_TOPK, self._topk)):
            self._handlers.update(dict.fromkeys(funcs, handler))
        self._handlers[F.scaled_dot_product_attention] = self._sdpa
        markers: dict[Any, Callable[[Any, tuple], None]] = dict.fromkeys(_MATMULS, self._matmul_out)
        markers[F.linear] = self._linear_out
        self._table: dict[Any, tuple[Any, Any]] = {
            f: (self._handlers.get(f), markers.get(f)) for f in {*self._handlers, *markers}
        }

    def __enter__(self) -> Capture:
        self.values = {}
        self._stack.__enter__()
        self._hooks = [m.register_forward_hook(self._layer_out(n)) for n, m in self._layers]
        return super().__enter__()

    def enter_within(self, module: nn.Module) -> Capture:
        """Install from inside ``module``'s own forward pre-hook (the stack enters it here)."""
        self.values = {}
        self._stack.enter_within(module)
        self._hooks = [m.register_forward_hook(self._layer_out(n)) for n, m in self._layers]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._stack.__exit__()
        self._tags.clear()

    def model_output(self, output: Any) -> None:
        """The model returned ``output``: its logits give ``logit_z`` when no loss in the forward did."""
        if any(signal == "logit_z" for _, signal in self.values):
            return
        logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
        if logits is None and isinstance(output, dict):
            logits = output.get("logits")
        if logits is None and isinstance(output, (tuple, list)) and output:
            logits = output[0]
        if isinstance(logits, torch.Tensor) and (tag := self._tag(logits)) is not None and tag[0] == _LINEAR:
            self._put(tag[1], "logit_z", _logz_rms(logits, -1))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        entry = self._table.get(func)  # one lookup an op: most ops only pass a tag on
        if entry is None:
            out = func(*args, **kwargs)
            found = self._tags.get(id(args[0])) if args else None
            if found is not None and found[0]() is args[0]:  # a freed tensor's id reused is no tag
                self._mark(out, found[1], found[2])  # a scale, mask fill, split or view keeps the tag
            return out
        handler, marker = entry
        if handler is not None:
            handler(func, args, kwargs)
        out = func(*args, **kwargs)
        if marker is not None:
            marker(out, args)
        return out

    def _linear_out(self, out: Any, args: tuple) -> None:
        self._mark(out, _LINEAR, self._stack.current_name() or "")

    def _matmul_out(self, out: Any, args: tuple) -> None:
        """A matmul with a parameter is a linear layer's output (its owner's); of two activations, a score."""
        if len(args) < 2:
            return
        a, b = args[-2], args[-1]
        param = a if isinstance(a, nn.Parameter) else b if isinstance(b, nn.Parameter) else None
        if param is not None:
            self._mark(out, _LINEAR, self._owners.get(id(param), self._stack.current_name() or ""))
        elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            self._mark(out, _SCORE, self._stack.current_name() or "")

    # -- what each kind of call measures -------------------------------------------------
    def _softmax(self, func: Any, args: tuple, kwargs: dict) -> None:
        found = self._tagged_input(args, kwargs)
        if found is None:
            return
        x, (kind, owner) = found
        here = self._stack.current_name()
        if kind == _SCORE:
            self._put(here or owner, "attn_logit", _max_logit(x))
        elif here:  # a linear output's softmax inside a submodule: a router (a loss's softmax runs at the root)
            self._put(owner, "router_logit", _finite_absmax(x))

    def _topk(self, func: Any, args: tuple, kwargs: dict) -> None:
        found = self._tagged_input(args, kwargs)
        if found is not None and found[1][0] == _LINEAR and self._stack.current_name():
            self._put(found[1][1], "router_logit", _finite_absmax(found[0]))

    def _logz(self, func: Any, args: tuple, kwargs: dict) -> None:
        found = self._tagged_input(args, kwargs)
        if found is None or found[1][0] != _LINEAR or found[0].dim() == 0 or self._stack.current_name():
            return  # the output layer's loss runs at the model's root or outside it; a submodule's is a router's
        x, (_, owner) = found
        dim = 1 if func in _LOGZ_DIM1 and x.dim() > 1 else kwargs.get("dim", args[1] if len(args) > 1 else -1)
        if isinstance(dim, int):
            self._put(owner, "logit_z", _logz_rms(x, dim))

    def _tagged_input(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, tuple[str, str]] | None:
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor):
            return None
        tag = self._tag(x)
        return None if tag is None else (x, tag)

    def _sdpa(self, func: Any, args: tuple, kwargs: dict) -> None:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        call = dict(zip(names, args, strict=False)) | kwargs
        q, k = call["query"], call["key"]
        value = _sdpa_absmax(q, k, call.get("attn_mask"), bool(call.get("is_causal")), call.get("scale"))
        self._put(self._stack.current_name() or "", "attn_logit", value)

    def _layer_out(self, name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            out = output[0] if isinstance(output, (tuple, list)) and output else output
            if isinstance(out, torch.Tensor) and out.is_floating_point() and out.numel():
                with torch._C.DisableTorchFunction():  # our own ops: not through the mode
                    x = local(out).detach()
                    rms = torch.linalg.vector_norm(x, dtype=torch.float32) / math.sqrt(x.numel())
                self._put(name, "output_rms", rms)

        return hook

    # -- bookkeeping -----------------------------------------------------------------------
    def _put(self, module: str, signal: str, value: torch.Tensor) -> None:
        key = (module, signal)
        seen = self.values.get(key)
        self.values[key] = value if seen is None else torch.maximum(seen, value.to(seen.device))

    def _mark(self, out: Any, kind: str, module: str) -> None:
        if isinstance(out, torch.Tensor):
            self._tags[id(out)] = (weakref.ref(out), kind, module)  # an integer tensor's tag is never asked for
        elif isinstance(out, (tuple, list)):
            for t in out:
                if isinstance(t, torch.Tensor):
                    self._tags[id(t)] = (weakref.ref(t), kind, module)

    def _tag(self, t: torch.Tensor) -> tuple[str, str] | None:
        found = self._tags.get(id(t))
        if found is None or found[0]() is not t:  # a freed tensor's id reused
            return None
        return found[1], found[2]


class _Names:
    """The innermost running module's name, by two global module hooks: ``ModuleStack``'s names (as the
    user wrote the model, built once) at a few calls a module. A module's own forward hooks run after
    it has left (the capture attributes nothing to them)."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self._names: dict[int, str] | None = None
        self._named: list[str | None] = []
        self._handles: list[Any] = []

    def __enter__(self) -> _Names:
        if self._names is None:
            self._names = {id(m): n for n, m in _user_modules(self.root)}
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._push),
            nn.modules.module.register_module_forward_hook(self._pop, always_call=True),
        ]
        return self

    def enter_within(self, module: nn.Module) -> _Names:
        """Install from inside ``module``'s own forward pre-hook: the global ones ran for it already."""
        self.__enter__()
        self._push(module, ())
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._named.clear()

    def _push(self, module: nn.Module, args: Any) -> None:
        named = self._named
        names = self._names or {}
        named.append(names.get(id(module), named[-1] if named else None))  # outside the root: its parent's

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._named:
            self._named.pop()

    def current_name(self) -> str | None:
        return self._named[-1] if self._named else None


def _max_logit(x: torch.Tensor) -> torch.Tensor:
    """The largest logit: one pass (a ``-inf`` mask fill is below every logit; a NaN is the guard's business)."""
    with torch.no_grad():
        return local(x).detach().amax().float()


def _finite_absmax(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        x = local(x).detach()
        a = x.abs()
        return torch.where(torch.isfinite(a), a, 0).amax().float()


def _logz_rms(x: torch.Tensor, dim: int) -> torch.Tensor:
    with torch.no_grad():
        z = torch.logsumexp(local(x).detach().float(), dim=dim)
        return z.square().mean().sqrt()


def _sdpa_absmax(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float | None
) -> torch.Tensor:
    """The largest q.k^T * scale of an attention call, its mask applied (masked pairs are no logits)."""
    with torch.no_grad():
        q, k = local(q).detach(), local(k).detach()
        if k.dim() >= 3 and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:  # grouped-query attention
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        s = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
        length, source = q.shape[-2], k.shape[-2]
        keep = None
        if causal:
            keep = torch.ones(length, source, dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            m = local(mask)
            scores = (q @ k.transpose(-2, -1)).float() * s
            scores = scores.masked_fill(~m, -math.inf) if m.dtype == torch.bool else scores + m.float()
            if keep is not None:
                scores = scores.masked_fill(~keep, -math.inf)
            return _max_logit(scores)
        qf = q.reshape(-1, length, q.shape[-1])
        kf = k.expand(*q.shape[:-2], source, k.shape[-1]).reshape(-1, source, k.shape[-1])
        rows = max(1, _CHUNK // max(1, length * source))
        best = torch.full((), -math.inf, device=q.device)
        for i in range(0, qf.shape[0], rows):
            scores = (qf[i : i + rows] @ kf[i : i + rows].transpose(-2, -1)).float() * s
            if keep is not None:
                scores = scores.masked_fill(~keep, -math.inf)
            best = torch.maximum(best, _max_logit(scores))
        return best
