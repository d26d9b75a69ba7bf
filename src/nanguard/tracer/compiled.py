"""``torch.compile``d models: replayed eagerly, named as the user wrote them; and when the
eager replay is finite, replayed compiled again to tell a compiler's numerics from a transient.

A replay under the tracer must not go through dynamo: dynamo would trace the tracer itself
(slow, or a crash), and the aten ops the tracer must see would be hidden in a compiled graph.

The differential replay (``compiler_fault``): the step runs once more through the compiled code,
from the same RNG state. Non-finite again where eager was finite, the compiler made the value
(``compile.numerics``). It is then narrowed on the forward the compiled module saw: a fresh
compile of the same module with each dynamo graph's compiled output compared to the graph run
eagerly on the same inputs names the first graph that differs, the modules it covers and its
output node; the same graph under ``aot_eager`` (AOTAutograd, no inductor code generation) says
whether the backend's code generation or the graph capture is to blame.
"""

from __future__ import annotations

import contextlib
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nanguard import compat
from nanguard.findings import Diagnosis
from nanguard.tree import tensors

__all__ = ["Narrowed", "compiled_modules", "compiler_fault", "eager", "narrow", "user_name"]


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Run every ``torch.compile``d function and module inside eagerly, without compiling.

    Example:
        >>> with eager():
        ...     loss = compiled_model(x).sum()   # plain eager ops, module hooks fire
    """
    # Nothing was compiled unless dynamo is loaded; importing it would cost seconds.
    set_stance = getattr(torch.compiler, "set_stance", None) if "torch._dynamo" in sys.modules else None
    if set_stance is None:  # or torch < 2.6, which has no stance: compiled code is traced as before
        yield
        return
    with set_stance("force_eager"), warnings.catch_warnings():
        # The tracer's global module hooks fire on the OptimizedModule too: expected, and harmless.
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        yield


def user_name(name: str) -> str:
    """A qualified module or parameter name as the user wrote the model: the levels wrappers add
    are left out (``torch.compile``'s ``_orig_mod``, activation checkpointing's
    ``_checkpoint_wrapped_module``, FSDP1's ``_fsdp_wrapped_module``, Fabric's).

    Example:
        >>> user_name("_orig_mod.layers.0._checkpoint_wrapped_module.head.weight")
        'layers.0.head.weight'
    """
    if "_" not in name or not any(w in name for w in _WRAPPER_LEVELS):
        return name
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_LEVELS)


_WRAPPER_LEVELS = frozenset(
    {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_forward_module", "_original_module"}
)


def compiled_modules(model: nn.Module) -> list[nn.Module]:
    """The ``torch.compile``d modules in ``model`` (itself, or inside a DDP wrapper); [] without dynamo."""
    if "torch._dynamo" not in sys.modules:
        return []
    from torch._dynamo.eval_frame import OptimizedModule

    return [m for m in model.modules() if isinstance(m, OptimizedModule)]


def _nonfinite(values: Any) -> bool:
    return any(t.is_floating_point() and not bool(torch.isfinite(t.detach()).all()) for t in tensors(values))


@dataclass
class Narrowed:
    """Where a compiled forward first differs from eager: the graph, its modules and output node."""

    backend: str
    graphs: int = 0
    """How many dynamo graphs the forward compiled into."""
    graph: int | None = None
    """The first graph (in call order) whose compiled output is non-finite where eager is finite."""
    modules: list[str] = field(default_factory=list)
    node: str | None = None
    """The FX node that produced the graph's first differing output."""
    outputs: int = 0
    """How many of that graph's outputs differ."""
    node_module: str | None = None
    aot_eager_finite: bool | None = None
    """That graph under ``aot_eager``: finite means the backend's code generation made the value."""


def _backend_name(backend: Any) -> str:
    if isinstance(backend, str):
        return backend
    fn = getattr(backend, "compiler_fn", None)  # torch.compile's wrapper of a user's backend
    if fn is not None:
        return str(getattr(fn, "__name__", None) or type(fn).__name__)
    return str(getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None) or type(backend).__name__)


_SELF = re.compile(r"^L\['[^']*'\]\.?")


def _module_of(node: Any) -> str | None:
    stack = node.meta.get("nn_module_stack") if hasattr(node, "meta") else None
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return user_name(_SELF.sub("", str(path)))


def narrow(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Narrowed:
    """Compile ``module``'s original module afresh with its own backend, each graph checked against
    itself run eagerly on the same inputs; the first graph that differs is tried under ``aot_eager``.

    Example:
        >>> narrow(compiled_model, (x,), {}).graph, narrow(compiled_model, (x,), {}).modules
        (1, ['blocks.1.mlp.fc'])
    """
    backend = compat.compiled_backend(module) or "inductor"
    found = Narrowed(backend=_backend_name(backend))
    fresh = torch.compile(getattr(module, "_orig_mod", module), backend=_Differential(backend, found))
    with torch.no_grad():
        fresh(*args, **kwargs)
    return found


class _Differential:
    """A backend that compiles each graph with ``backend`` and runs it beside the same graph run eagerly,
    until one graph's compiled outputs are non-finite where its eager ones are not: that graph goes
    into ``found``."""

    def __init__(self, backend: Any, found: Narrowed) -> None:
        self.inner = compat.lookup_backend(backend)
        self.found = found

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        compiled = self.inner(gm, example_inputs)
        index = self.found.graphs
        self.found.graphs += 1

        def run(*inputs: Any) -> Any:
            out = compiled(*inputs)
            if self.found.graph is None:
                self.compare(gm, index, inputs, out, example_inputs)
            return out

        return run

    def compare(self, gm: torch.fx.GraphModule, index: int, inputs: tuple[Any, ...], out: Any, example: Any) -> None:
        bad = _differing(gm, inputs, out)
        if not bad:
            return
        _record(self.found, gm, index, bad)
        if self.found.backend != "aot_eager":
            self.found.aot_eager_finite = _aot_eager_finite(gm, example, inputs)


def _differing(gm: torch.fx.GraphModule, inputs: tuple[Any, ...], out: Any) -> list[int]:
    """The positions of the compiled outputs ``out`` that are non-finite where ``gm`` run eagerly is finite."""
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    reference = gm(*[t.clone() if isinstance(t, torch.Tensor) else t for t in inputs])
    refs = list(reference) if isinstance(reference, (list, tuple)) else [reference]
    return [i for i, (o, r) in enumerate(zip(outs, refs, strict=False)) if _nonfinite(o) and not _nonfinite(r)]


def _record(found: Narrowed, gm: torch.fx.GraphModule, index: int, bad: list[int]) -> None:
    """Graph ``index`` differs at its outputs ``bad``: its modules, and the node and module of the first."""
    found.graph = index
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    found.modules = sorted({m for m in (_module_of(n) for n in nodes) if m is not None})
    found.outputs = len(bad)
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    produced = output.args[0]
    produced = produced[bad[0]] if isinstance(produced, (list, tuple)) else produced
    if isinstance(produced, torch.fx.Node):
        found.node = produced.name
        # One differing output names its module; several leave the graph's modules to speak.
        found.node_module = _module_of(produced) if len(bad) == 1 else None


def _aot_eager_finite(gm: torch.fx.GraphModule, example: Any, inputs: tuple[Any, ...]) -> bool | None:
    """Is the graph finite under ``aot_eager`` (no code generation)? None when that could not run."""
    try:
        again = compat.lookup_backend("aot_eager")(gm, example)(*inputs)
        return not _nonfinite(again)
    except Exception:  # the comparison is evidence only
        return None


def compiler_fault(
    model: nn.Module,
    closure: Callable[[], Any],
    *,
    rng: Mapping[str, torch.Tensor] | None,
    step: int,
    replay: Callable[[Callable[[], Any]], Any],
) -> Diagnosis | None:
    """A ``compile.numerics`` diagnosis when ``closure`` (whose eager replay was finite) goes
    non-finite again through the compiled code from the same RNG state; None when it stays finite
    or nothing is compiled. ``replay`` runs a function as the guard replays (gradient sync off).

    Example:
        >>> compiler_fault(compiled_model, closure, rng=rng, step=7, replay=lambda fn: fn()).evidence["graph"]
        1
    """
    from nanguard.rng import set_rng_state

    compiled = compiled_modules(model)
    if not compiled:
        return None
    started = time.perf_counter()
    if rng is not None:
        set_rng_state(rng)
    loss, seen = _replay_capturing(compiled, closure, replay)
    grads = [p.grad for m in compiled for p in m.parameters() if p.grad is not None]
    if not _nonfinite(loss) and not _nonfinite(grads):
        return None
    target = compiled[0]
    # A submodule compiled inside an eager model (model.head = torch.compile(model.head)): its graphs
    # name modules relative to it, so its own name in the model prefixes them.
    prefix = next((user_name(n) for n, m in model.named_modules() if m is target), "")
    narrowed = None
    if id(target) in seen:
        narrowed = _prefixed(narrow(target, *seen[id(target)]), prefix)
    backend = narrowed.backend if narrowed else _backend_name(compat.compiled_backend(target) or "inductor")
    return _diagnosis(step, loss, backend, narrowed, time.perf_counter() - started, prefix or None)


def _replay_capturing(
    compiled: list[nn.Module], closure: Callable[[], Any], replay: Callable[[Callable[[], Any]], Any]
) -> tuple[Any, dict[int, tuple[tuple[Any, ...], dict[str, Any]]]]:
    """Replay ``closure`` with grad on; return its result and the inputs each compiled module got first."""
    seen: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def capture(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if id(module) not in seen:
            seen[id(module)] = (_detached(args), _detached(kwargs))

    handles = [m.register_forward_pre_hook(capture, with_kwargs=True) for m in compiled]
    try:
        with torch.enable_grad():
            return replay(closure), seen
    finally:
        for handle in handles:
            handle.remove()


def _prefixed(found: Narrowed, prefix: str) -> Narrowed:
    """``found`` with its module names made qualified in the whole model (``proj`` -> ``head.proj``)."""
    if not prefix:
        return found
    join = lambda name: f"{prefix}.{name}" if name else prefix  # noqa: E731
    found.modules = [join(m) for m in found.modules] or [prefix]
    found.node_module = join(found.node_module) if found.node_module is not None else None
    return found


def _common_module(modules: list[str]) -> str | None:
    """The innermost module holding all of ``modules`` (None when only the root does)."""
    if not modules:
        return None
    parts = [m.split(".") for m in modules]
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common) or None


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    return value


def _diagnosis(
    step: int, loss: Any, backend: str, narrowed: Narrowed | None, seconds: float, compiled: str | None = None
) -> Diagnosis:
    """``compiled``: the qualified name of the compiled submodule, when the model itself is not the one compiled."""
    module = (narrowed.node_module if narrowed else None) or compiled
    why = f"the step's eager replay is finite, but compiled ({backend}) from the same RNG state it is non-finite"
    why += f" again{_where(narrowed)}"
    value = next((t for t in tensors(loss) if t.is_floating_point()), None)
    nan = value is not None and bool(torch.isnan(value.detach()).any())
    evidence: dict[str, Any] = {
        "why": why,
        "backend": backend,
        "eager_replay": "finite",
        "compiled_replay": "non-finite",
        "diagnose_seconds": seconds,
    }
    if compiled is not None:
        evidence["compiled_module"] = compiled
    if narrowed is not None:
        evidence.update(
            graph=narrowed.graph,
            graphs=narrowed.graphs,
            graph_modules=narrowed.modules,
            node=narrowed.node,
            outputs_differing=narrowed.outputs,
            aot_eager_finite=narrowed.aot_eager_finite,
        )
    return Diagnosis(
        cause="compile.numerics",
        kind="nan" if nan or value is None else "inf",
        phase="forward" if narrowed is not None and narrowed.graph is not None else "backward",
        module=module,
        step=step,
        evidence=evidence,
        fixes=_fixes(backend, narrowed, module),
    )


def _where(narrowed: Narrowed | None) -> str:
    """Where in the compiled code the value differs, as the end of the diagnosis's why."""
    if narrowed is None:
        return ""
    if narrowed.graph is None:
        return ": every forward graph matches eager, so the backward's compiled graph is the likely place"
    where = f": the forward's graph {narrowed.graph} of {narrowed.graphs} is non-finite compiled and finite eager"
    if narrowed.modules:
        shown = ", ".join(narrowed.modules[:4]) + (", ..." if len(narrowed.modules) > 4 else "")
        where += f", over modules {shown}"
    if narrowed.node:
        where += f" (output node {narrowed.node}" + (f", in {narrowed.node_module})" if narrowed.node_module else ")")
    return where


def _fixes(backend: str, narrowed: Narrowed | None, module: str | None) -> list[str]:
    codegen = narrowed.aot_eager_finite if narrowed is not None else None
    fixes = []
    if codegen:
        fixes.append(
            f"the same graph under backend='aot_eager' (no {backend} code generation) is finite: the "
            f"backend's generated code is wrong; compile with torch.compile(model, backend='aot_eager') "
            "until it is fixed"
        )
    else:
        fixes.append(
            "compile with torch.compile(model, backend='aot_eager') or mode='default' instead of "
            "'max-autotune', and see whether the run stays finite"
        )
    target = module or (_common_module(narrowed.modules) if narrowed is not None else None)
    if target:
        fixes.append(f"run the module eagerly: model.{target}.forward = torch._dynamo.disable(model.{target}.forward)")
    fixes.append(
        "make inductor follow eager numerics: torch._inductor.config.emulate_precision_casts = True "
        "(and fallback_random = True when random ops are involved)"
    )
    fixes.append(
        "file a minimal repro: TORCHDYNAMO_REPRO_AFTER='aot' TORCHDYNAMO_REPRO_LEVEL=4 minifies the "
        "graph; attach it with the torch version to an issue on pytorch/pytorch"
    )
    return fixes
