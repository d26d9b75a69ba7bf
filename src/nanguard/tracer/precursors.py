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

The first forward sees every op; it learns the sites, the modules whose own code made, carried or
consumed a measured tensor. Later forwards turn the mode on in the sites and in modules never seen
run before, off in the others (each module's forward is wrapped while the capture runs: it names
the running module and switches the mode): the same measurements from fewer ops. One that misses a
measurement learned before took another path, and the next forward learns from scratch.

Every value is reduced on the device; nothing is read here. The mode only reads what the ops
computed (and ``detach``es it), so the step's results are those of the step run without it.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from nanguard.stats import local
from nanguard.tracer.modules import user_modules

__all__ = ["Capture", "Values", "layers", "owners_of"]

Values = dict[tuple[str, str], torch.Tensor]
"""``(module, signal) -> 0-dim float32 device tensor``."""

_SCORE, _LINEAR = "score", "linear"
_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm, torch.baddbmm}
_EXP = {torch.exp, torch.Tensor.exp}
_SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax, *_EXP}  # exp: a softmax by hand
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


_Tag = tuple[str, str, frozenset[str | None]]
"""A tagged tensor's kind (score or linear output), its module, and the modules its ops ran in."""
_NOWHERE: frozenset[str | None] = frozenset()


def _is_param(t: Any) -> bool:
    """``isinstance(t, nn.Parameter)`` without its Python check for a plain tensor (never one)."""
    return type(t) is not torch.Tensor and isinstance(t, nn.Parameter)


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
        self.raw: set[tuple[str, str]] = set()
        """This forward's measurements taken at an ``exp`` of the logits (a softmax written without the max
        subtraction): float32's exp overflow is their limit for sure."""
        self._tags: dict[int, tuple[weakref.ref[torch.Tensor], str, str, frozenset[str | None]]] = {}
        self._owners = owners if owners is not None else owners_of(model)
        self._layers = {id(m): n for n, m in (repeated if repeated is not None else layers(model))}
        self._names: dict[int, tuple[nn.Module, str]] | None = None  # built at the first forward
        self._forwards: dict[int, _Forward] = {}
        self._running = self._on = self._broken = False
        self._here: str | None = None
        """The innermost running module's name, as the user wrote the model (None: outside the root)."""
        # What the forwards so far taught (``_learn``): the modules that ran, those the measured ops ran in
        # (the sites), and what they measured; and this forward's sites and modules not known before.
        self._known: set[str | None] = set()
        self._sites: set[str | None] = set()
        self._keys: set[tuple[str, str]] = set()
        self._seen: set[str | None] = set()
        self._found: set[tuple[str, str]] = set()  # this forward's measurements through the mode
        self._ran: set[str | None] = set()
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
        return self._start(None)

    def enter_within(self, module: nn.Module) -> Capture:
        """Install from inside ``module``'s own forward pre-hook (its forward runs as ``module``'s name)."""
        return self._start(module)

    def _start(self, module: nn.Module | None) -> Capture:
        self.values, self._broken, self._seen, self._ran, self._found = {}, False, set(), set(), set()
        self.raw = set()
        if self._names is None:
            self._names = {id(m): (m, n) for n, m in user_modules(self.model)}  # a shared module: its last name
        self._wrap()
        self._here = self._names[id(module)][1] if module is not None and id(module) in self._names else None
        self._running = True
        if self._here not in self._known:
            self._ran.add(self._here)
        if self._here in self._sites or self._here not in self._known:
            self._switch(True)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._running:
            return
        self._running = False
        if self._on:
            super().__exit__(*exc)  # the innermost mode: ours
            self._on = False
        for forward in self._forwards.values():
            own = forward.module.__dict__
            if "forward" in own and own["forward"] is forward.wrapped:
                if forward.own is None:
                    del own["forward"]
                else:
                    own["forward"] = forward.own
        self._here = None
        self._tags.clear()
        self._learn(exc[0] is None and not self._broken)

    def _learn(self, complete: bool) -> None:
        """After a forward that ran to its end: the modules that ran are known, the ones its measured ops ran
        in are sites, what it measured is expected. A later forward sees the ops of the sites and of modules
        never seen before alone (the others do what they did: they measure nothing); one that misses an
        expected measurement took another path, and the next forward learns from scratch."""
        if not complete:
            return
        if not self._keys <= self._found:  # (a layer's output RMS is measured wherever it runs: not counted)
            self._known, self._sites, self._keys = set(), set(), set()
            return
        self._known |= self._ran
        self._sites |= self._seen
        self._keys |= self._found

    def _wrap(self) -> None:
        """Each module's forward wrapped to run as its name (the wrapper built once, again for a module whose
        forward changed since); set on the instance, as a forward of the user's would be, until ``__exit__``."""
        forwards, layer = self._forwards, self._layers
        for key, (module, name) in (self._names or {}).items():
            if key not in forwards or module.forward != forwards[key].original:
                forwards[key] = _Forward(self, module, name, layer.get(key))
            module.__dict__["forward"] = forwards[key].wrapped

    def _switch(self, on: bool) -> bool:
        """The mode on (pushed) or off (popped, when it is the innermost mode); whether it switched."""
        if on:
            torch._C._push_on_torch_function_stack(self)
        elif (top := torch._C._pop_torch_function_stack()) is not self:
            torch._C._push_on_torch_function_stack(top)  # a mode of the user's inside ours: ours left on (sees more)
            return False
        self._on = on
        return True

    def _call(self, name: str, layer: str | None, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``forward`` run as module ``name``: the mode on in a site or a module not known yet, off elsewhere."""
        here, was = self._here, self._on
        self._here = name
        on = name in self._sites or name not in self._known
        if on and name not in self._known:
            self._ran.add(name)
        switched = on is not was and self._switch(on)
        try:
            output = forward(*args, **kwargs)
        finally:
            self._here = here
            if switched:
                self._switch(was)
        if layer is not None:
            self._layer_out(layer, output)
        return output

    def model_output(self, output: Any) -> None:
        """The model returned ``output``: its logits give ``logit_z`` when no loss in the forward did."""
        if output is None:
            self._broken = True  # the forward raised: nothing learned from it
            return
        if any(signal == "logit_z" for _, signal in self.values):
            return
        logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
        if logits is None and isinstance(output, dict):
            logits = output.get("logits")
        if logits is None and isinstance(output, (tuple, list)) and output:
            logits = output[0]
        if isinstance(logits, torch.Tensor) and (tag := self._tag(logits)) is not None and tag[0] == _LINEAR:
            self._put(tag[1], "logit_z", _logz_rms(logits, -1), tag[2])

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        table, tags = self._table, self._tags  # ``in`` then ``[]``: no call of their own, an op's few
        if func not in table:  # most ops only pass a tag on
            out = func(*args, **kwargs)
            key = id(args[0]) if args else None
            if key in tags and (found := tags[key])[0]() is args[0]:  # a freed tensor's id reused is no tag
                self._mark(out, found[1], found[2], found[3] | {self._here})  # a scale, mask fill, split or view
            return out
        handler, marker = table[func]
        if handler is not None:
            handler(func, args, kwargs)
        out = func(*args, **kwargs)
        if marker is not None:
            marker(out, args)
        return out

    def _linear_out(self, out: Any, args: tuple) -> None:
        self._mark(out, _LINEAR, self._here or "", frozenset((self._here,)))

    def _matmul_out(self, out: Any, args: tuple) -> None:
        """A matmul with a parameter is a linear layer's output (its owner's); of two activations, a score."""
        if len(args) < 2:
            return
        a, b = args[-2], args[-1]
        param = a if _is_param(a) else b if _is_param(b) else None
        if param is not None:
            self._mark(out, _LINEAR, self._owners.get(id(param), self._here or ""), frozenset((self._here,)))
        elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            self._mark(out, _SCORE, self._here or "", frozenset((self._here,)))

    # -- what each kind of call measures -------------------------------------------------
    def _softmax(self, func: Any, args: tuple, kwargs: dict) -> None:
        found = self._tagged_input(args, kwargs)
        if found is None:
            return
        x, (kind, owner, sites) = found
        here = self._here
        if kind == _SCORE:
            key = (here or owner, "attn_logit")
            self._put(*key, _max_logit(x), sites | {here})
        elif here:  # a linear output's softmax inside a submodule: a router (a loss's softmax runs at the root)
            key = (owner, "router_logit")
            self._put(*key, _finite_absmax(x), sites | {here})
        else:
            return
        if func in _EXP:
            self.raw.add(key)

    def _topk(self, func: Any, args: tuple, kwargs: dict) -> None:
        found = self._tagged_input(args, kwargs)
        if found is not None and found[1][0] == _LINEAR and self._here:
            self._put(found[1][1], "router_logit", _finite_absmax(found[0]), found[1][2] | {self._here})

    def _logz(self, func: Any, args: tuple, kwargs: dict) -> None:
        found = self._tagged_input(args, kwargs)
        if found is None or found[1][0] != _LINEAR or found[0].dim() == 0 or self._here:
            return  # the output layer's loss runs at the model's root or outside it; a submodule's is a router's
        x, (_, owner, sites) = found
        dim = 1 if func in _LOGZ_DIM1 and x.dim() > 1 else kwargs.get("dim", args[1] if len(args) > 1 else -1)
        if isinstance(dim, int):
            self._put(owner, "logit_z", _logz_rms(x, dim), sites | {self._here})

    def _tagged_input(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, _Tag] | None:
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
        self._put(self._here or "", "attn_logit", value, frozenset((self._here,)))

    def _layer_out(self, name: str, output: Any) -> None:
        out = output[0] if isinstance(output, (tuple, list)) and output else output
        if not isinstance(out, torch.Tensor):
            return
        with torch._C.DisableTorchFunction():  # our own ops: not through the mode
            if not (out.is_floating_point() and out.numel()):
                return
            x = local(out).detach()
            rms = torch.linalg.vector_norm(x, dtype=torch.float32) / math.sqrt(x.numel())
        self._put(name, "output_rms", rms, _NOWHERE)

    # -- bookkeeping -----------------------------------------------------------------------
    def _put(self, module: str, signal: str, value: torch.Tensor, sites: frozenset[str | None]) -> None:
        """``value`` of ``(module, signal)`` (the largest of a forward's); ``sites``: the modules its ops ran in."""
        key = (module, signal)
        seen = self.values.get(key)
        self.values[key] = value if seen is None else torch.maximum(seen, value.to(seen.device))
        if sites:
            self._seen |= sites
            self._found.add(key)

    def _mark(self, out: Any, kind: str, module: str, sites: frozenset[str | None]) -> None:
        if isinstance(out, torch.Tensor):
            self._tags[id(out)] = (weakref.ref(out), kind, module, sites)  # an integer tensor's is never asked for
        elif isinstance(out, (tuple, list)):
            for t in out:
                if isinstance(t, torch.Tensor):
                    self._tags[id(t)] = (weakref.ref(t), kind, module, sites)

    def _tag(self, t: torch.Tensor) -> _Tag | None:
        found = self._tags.get(id(t))
        if found is None or found[0]() is not t:  # a freed tensor's id reused
            return None
        return found[1], found[2], found[3]


class _Forward:
    """A module's forward, wrapped for a capture's forwards: it runs as the module's name (``Capture._call``);
    outside a running capture it is the module's own forward."""

    def __init__(self, capture: Capture, module: nn.Module, name: str, layer: str | None) -> None:
        self.module = module
        self.own = module.__dict__.get("forward")  # a forward set on the instance (None: the class's)
        self.original = forward = module.forward

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not capture._running:  # called after the capture (a checkpoint's recompute, say)
                return forward(*args, **kwargs)
            return capture._call(name, layer, forward, args, kwargs)

        self.wrapped = functools.update_wrapper(wrapped, forward)  # its signature, for code that reads it


# The measurements below start from a detached tensor: nothing they compute joins the graph.
def _max_logit(x: torch.Tensor) -> torch.Tensor:
    """The largest logit: one pass (a ``-inf`` mask fill is below every logit; a NaN is the guard's business)."""
    return local(x).detach().amax().float()


def _finite_absmax(x: torch.Tensor) -> torch.Tensor:
    a = local(x).detach().abs()
    return torch.where(torch.isfinite(a), a, 0).amax().float()


def _logz_rms(x: torch.Tensor, dim: int) -> torch.Tensor:
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
