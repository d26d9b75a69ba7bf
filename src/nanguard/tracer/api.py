"""``locate``: run a step under the tracer and name the origin of its first non-finite value."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from nanguard import compat, dist
from nanguard.diagnose import diagnose
from nanguard.evidence import RunFacts
from nanguard.findings import Diagnosis
from nanguard.rng import get_rng_state
from nanguard.stats import init_ratios, local
from nanguard.tracer.collectives import choose
from nanguard.tracer.compiled import compiled_modules, compiler_fault, eager, user_name
from nanguard.tracer.dispatch import Failure, Origin, Tracer
from nanguard.tracer.modules import ModuleStack, is_user_code
from nanguard.tracer.protect import Backup
from nanguard.tracer.taint import many_nonfinite_flags, version
from nanguard.tree import tensors_with_path

__all__ = ["error_origin", "locate"]

_UNREACHED = ("fill", "blank")
# An op that computed the value ranks before memory read unwritten: a latent read of that kind, poisoned in the
# replay, never hides the fault that made the step non-finite; alone, it is the origin.
_CATEGORY_ORDER = {"index": 0, "data": 1, "parameters": 2, "op": 3, "blank": 4, "write": 5, "fill": 6, "comm": 7}
_MAX_RESULTS = 8


def locate(fn: Callable[..., Any], *args: Any, model: nn.Module | None = None, **kwargs: Any) -> Diagnosis | None:
    """Run ``fn(*args, **kwargs)`` under an op tracer; return where its first NaN/Inf came from.

    ``fn`` is usually a training closure (forward and backward). The result is ``None``
    when fn's return value and the gradients it produced are all finite; an element of fresh memory
    (``torch.empty``) read before any op wrote it counts as NaN, whatever the allocator left there
    (``op.uninitialized_read``). Parameters and
    buffers are left as they were; no optimizer is stepped. Under tensor or pipeline
    parallelism (DTensor, ``torch.distributed.pipelining``) call it on every rank, as the step
    itself runs: the ranks agree on the rank whose own compute created the value.

    Example:
        >>> def closure(batch):
        ...     model.zero_grad()
        ...     loss = model(**batch).loss
        ...     loss.backward()
        ...     return loss
        >>> diag = ng.locate(closure, batch, model=model)
        >>> if diag:
        ...     print(diag)          # cause, op, module, source line, evidence, fixes
    """
    compiled = compiled_modules(model) if isinstance(model, nn.Module) else []
    state = get_rng_state() if compiled else None
    diag, collectives = _traced(fn, args, kwargs, model=model)
    if diag is None and compiled and model is not None:
        # Traced eagerly and finite: run the compiled code again from the same RNG state, as the guard does.
        diag = _compiled_again(model, lambda: fn(*args, **kwargs), state)
    if collectives and dist.is_distributed():
        # Tensor or pipeline parallel: every rank ran fn together; agree on the rank whose own
        # compute created the value (a rank it only reached through a collective keeps its own).
        agreed = dist.gather_diagnosis(diag, [], choose=choose)
        return agreed if agreed is not None else diag
    return diag


def _compiled_again(
    model: nn.Module, step: Callable[[], Any], state: dict[str, torch.Tensor] | None
) -> Diagnosis | None:
    """``compile.numerics`` when ``step`` is non-finite through the compiled modules where its eager trace was
    finite; the gradients the eager run left are put back either way."""
    grads = [(p, p.grad.detach().clone() if p.grad is not None else None) for p in model.parameters()]
    try:
        found = compiler_fault(model, step, rng=state, step=0, replay=lambda f: f())
    finally:
        for p, g in grads:
            p.grad = g
    return replace(found, step=None) if found is not None else None


def trace(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict[str, Any],
    *,
    model: nn.Module | None = None,
    inputs: dict[str, Any] | None = None,
    run: RunFacts | None = None,
) -> Diagnosis | None:
    """``locate`` with extra named ``inputs``: tensors a closure captured, such as its batch; this
    rank's own answer (no agreement across ranks). ``run``: what the guard knows of the run (its
    history, the initial weight scale), judged in the diagnosis's one ``diagnose``."""
    return _traced(fn, args, kwargs, model=model, inputs=inputs, run=run)[0]


def _traced(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict[str, Any],
    *,
    model: nn.Module | None = None,
    inputs: dict[str, Any] | None = None,
    run: RunFacts | None = None,
) -> tuple[Diagnosis | None, int]:
    """``trace``, and how many communication ops the step ran."""
    if not callable(fn):
        raise ValueError(f"fn must be callable (a function or closure), got {type(fn).__name__}")
    if model is not None and not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    tracer, result, error = _run(fn, args, kwargs, model, inputs)
    root = model if model is not None else tracer.modules.root
    if error is not None:
        origin = _error_origin(tracer, error)
        return _diagnosis(origin, [], root, tracer.comm.ops, run), tracer.comm.ops
    bad = _nonfinite_results(result, root, tracer)
    if not bad:
        return None, tracer.comm.ops
    taint = _results_taint(tracer, bad)
    origin = _first_origin(tracer, taint, bad)
    diag = _diagnosis(origin, bad, root, tracer.comm.ops, run, latent=_latent_reads(tracer, taint, origin))
    return diag, tracer.comm.ops


def _run(
    fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], model: nn.Module | None, inputs: dict[str, Any] | None
) -> tuple[Tracer, Any, Exception | None]:
    """Run ``fn`` under a tracer, the parameters and buffers put back after: the tracer, and fn's result or error."""
    sources = _input_tensors(fn, args, kwargs)
    for name, value in (inputs or {}).items():
        sources += tensors_with_path(value, name)
    if model is not None:
        buffers = list(model.buffers())
        backup = Backup(on_write=[*model.parameters(), *buffers], now=buffers)
    else:
        backup = Backup()
    modules = ModuleStack(model)
    tracer = Tracer(modules, sources, backup)
    with modules:
        try:
            # A compiled model runs eagerly: dynamo must not trace the tracer.
            with eager(), tracer:
                return tracer, fn(*args, **kwargs), None
        except Exception as err:
            return tracer, None, err
        finally:
            tracer.restore()


def _error_origin(tracer: Tracer, error: Exception) -> Origin:
    """The origin behind fn's raise: an id out of range, or the non-finite value read just before; else
    the error is fn's own and is raised again."""
    failure = tracer.failure
    if failure is None or failure.index is None or not _out_of_range(failure, error):
        raised = _raised_after_nonfinite(tracer, error)
        if raised is None:
            raise error
        return raised
    return Origin(
        id=-1,
        category="index",
        kind="invalid",  # the op raised: nothing non-finite was created
        index=tracer.index,
        op=failure.op,
        module=failure.where.module,
        module_type=failure.where.module_type,
        phase=failure.where.phase,
        source=failure.where.source,
        library_source=failure.where.library,
        extra={
            "error": f"{type(error).__name__}: {error}".splitlines()[0][:300],
            "index_inputs": failure.index.inputs,
            "indexed_size": failure.index.size,
        },
        before=tracer.recent_ops(),
    )


def _results_taint(tracer: Tracer, bad: list[tuple[str, torch.Tensor, str]]) -> set[int]:
    """The origins behind the non-finite results ``bad``."""
    taint: set[int] = set()
    for _, t, _ in bad:
        taint |= tracer.taint.taint_of(t)
    return taint


def _latent_reads(tracer: Tracer, taint: set[int], origin: Origin) -> list[dict[str, Any]]:
    """The reads of new memory that reached the results beside the origin named (``blank`` origins, ranked
    after an op's creation): a latent bug the replay's NaN fill showed, for ``diag.also``."""
    found = [tracer.origins[i] for i in sorted(taint)]
    blank = [o for o in found if o.category == "blank" and o is not origin]
    return [{"op": o.op, "module": o.module, "source": o.source} for o in blank]


def _first_origin(tracer: Tracer, taint: set[int], bad: list[tuple[str, torch.Tensor, str]]) -> Origin:
    """The origin behind the non-finite results ``bad`` (whose origins are ``taint``) that came first (by
    category, then op index)."""
    # Without a taint, a fill or an allocation (whose NaN the tracer wrote) reached nothing known.
    candidates = [tracer.origins[i] for i in taint] or [o for o in tracer.origins if o.category not in _UNREACHED]
    candidates = candidates or tracer.origins
    if candidates:
        return min(candidates, key=lambda o: (_CATEGORY_ORDER[o.category], o.index))
    return Origin(id=-1, category="op", kind=bad[0][2], index=0, op=None, module=None, phase="backward")


# A raise this many ops after an op read a non-finite value is about that value: a distribution's
# validate_args reads it, compares it and raises within a few ops; multinomial raises on it.
_RAISE_WINDOW = 16


def _raised_after_nonfinite(tracer: Tracer, error: BaseException) -> Origin | None:
    """The origin of the non-finite value the ops just before ``error`` read, if any: the NaN that
    surfaced as a raise (``Categorical(logits=nan)``, ``torch.multinomial``, an ``assert isfinite``).
    A -inf mask fill alone is no origin: masked logits are valid."""
    if not tracer.last_taint or tracer.index - tracer.last_taint_index > _RAISE_WINDOW:
        return None
    candidates = [tracer.origins[i] for i in tracer.last_taint if tracer.origins[i].category != "fill"]
    if not candidates:
        return None
    origin = min(candidates, key=lambda o: (_CATEGORY_ORDER[o.category], o.index))
    origin.extra["exception"] = {
        "type": type(error).__name__,
        "message": (str(error).splitlines() or [""])[0][:300],
        "raised_at": _raise_site(error),
        "ops_after_read": tracer.index - tracer.last_taint_index,
    }
    return origin


def _raise_site(error: BaseException) -> str | None:
    """``file:line`` of the innermost frame of the user's own code in ``error``'s traceback."""
    site = None
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if is_user_code(code):
            site = f"{code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return site


def error_origin(fn: Callable[[], Any], error: BaseException, *, model: nn.Module | None = None) -> str | None:
    """Replay ``fn``, which raised ``error``, under the tracer: one line naming the origin of the
    NaN/Inf that surfaced as that error, or None when there was none (or the replay differs).
    Never raises: it only adds to an error that is already on its way to the user.

    Example:
        >>> error_origin(closure, err, model=model)
        'nanguard: the NaN behind this error was created by aten.div.Tensor in module "" at train.py:12 (...)'
    """
    try:
        diag = trace(fn, (), {}, model=model)
    except Exception:
        return None
    raised = (diag.evidence.get("exception") or {}) if diag is not None else {}
    if diag is None or raised.get("type") != type(error).__name__:
        return None
    where = "outside any module" if diag.module is None else f"in module '{diag.module}'"
    line = f"nanguard: the {'NaN' if diag.kind == 'nan' else 'Inf'} behind this error was created by "
    line += f"{diag.op} {where} ({diag.phase})"
    line += f" at {diag.source}" if diag.source else ""
    return line + f": {diag.cause}"


def _out_of_range(failure: Failure, error: BaseException) -> bool:
    """Did an index op fail because an id was out of range (not, say, a shape bug)?"""
    index = failure.index
    if index is None or not isinstance(error, (IndexError, RuntimeError)):
        return False
    size = index.size
    if size is None:
        text = str(error).lower()
        return "out of range" in text or "out of bounds" in text
    for stats in index.inputs:
        lo, hi = stats.get("min"), stats.get("max")
        if (isinstance(hi, int) and hi >= size) or (isinstance(lo, int) and lo < 0 and lo != index.ignore_index):
            return True
    return False


def _diagnosis(
    origin: Origin,
    bad: list[tuple[str, torch.Tensor, str]],
    root: nn.Module | None,
    collectives: int = 0,
    run: RunFacts | None = None,
    latent: list[dict[str, Any]] | None = None,
) -> Diagnosis:
    evidence = _evidence(origin, bad, root, collectives, run)
    if latent:
        evidence["uninitialized_reads"] = latent
    judgement = diagnose(evidence)
    evidence["why"] = judgement.why
    if judgement.op_cause is not None:
        evidence["op_cause"] = judgement.op_cause
    phase = "data" if judgement.cause.startswith("data.") else origin.phase
    if phase == "data" and origin.category in ("op", "index"):
        # The contract's phase of a data cause is "data"; the op that met the bad input keeps its own phase here.
        evidence["created_in"] = {"op": origin.op, "phase": origin.phase}
    if judgement.cause == "parameters.nonfinite":
        phase = "parameters"
    rank = dist.rank_or_none()
    return Diagnosis(
        cause=judgement.cause,
        kind=origin.kind,
        phase=phase,
        op=origin.op if origin.op is not None else origin.extra.get("consumer_op"),
        module=origin.module,
        rank=rank,
        ranks=[rank] if rank is not None else [],
        source=origin.source,
        evidence=evidence,
        fixes=judgement.fixes,
        also=judgement.also,
    )


def _evidence(
    origin: Origin,
    bad: list[tuple[str, torch.Tensor, str]],
    root: nn.Module | None,
    collectives: int,
    run: RunFacts | None,
) -> dict[str, Any]:
    """What the rules judge: the origin, the non-finite results, the weights' scale and the run's facts."""
    evidence: dict[str, Any] = {
        "origin": origin.to_evidence(),
        "kind": origin.kind,
        "before": origin.before,
        "after": origin.after,
        "results": [{"path": path, "kind": kind} for path, _, kind in bad[:_MAX_RESULTS]],
        "nonfinite_results": len(bad),
    }
    if origin.library_source is not None:
        evidence["library_source"] = origin.library_source
    if collectives:
        # The replay communicated (tensor or pipeline parallel): ranks agree on who created it.
        evidence["communication"] = {
            "collectives": collectives,
            "arrived": origin.category == "comm",
            "index": origin.index,
        }
    if "exception" in origin.extra:
        evidence["exception"] = origin.extra["exception"]
    masked_by = origin.extra.get("masked_by")
    if isinstance(masked_by, dict) and masked_by.get("rows"):
        evidence["rows"] = list(masked_by["rows"])  # the empty samples: what a quarantine takes
    if root is not None:
        evidence["weight_scale"] = weight_scale(root)
    if run is not None:
        evidence.update(run.written())
    return evidence


def _input_tensors(fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """The user's input tensors with readable paths, named after fn's parameters."""
    # *args and **kwargs arrive as one tuple and one dict: their paths read args[0], kwargs['k'].
    try:
        named = list(inspect.signature(fn).bind_partial(*args, **kwargs).arguments.items())
    except (TypeError, ValueError):
        named = [("args", args), *kwargs.items()]
    return [leaf for name, value in named for leaf in tensors_with_path(value, name)]


def _nonfinite_results(result: Any, root: nn.Module | None, tracer: Tracer) -> list[tuple[str, torch.Tensor, str]]:
    """Non-finite tensors among fn's return value and the gradients it produced."""
    candidates = tensors_with_path(result, "result") + _gradients(root, tracer)
    floats = [(p, local(t)) for p, t in candidates if t.is_floating_point()]
    flags = many_nonfinite_flags([t for _, t in floats])
    return [
        (path, t, "nan" if nan else "inf") for (path, t), (nan, inf) in zip(floats, flags, strict=True) if nan or inf
    ]


def _gradients(root: nn.Module | None, tracer: Tracer) -> list[tuple[str, torch.Tensor]]:
    """The gradients fn produced, with their paths: the root's parameters' and the leaf tensors' it saw."""
    params = list(root.named_parameters()) if root is not None else []
    candidates = [(f"{n}.grad", p.grad) for n, p in params if p.grad is not None]
    if root is not None:
        # FSDP2 with gradient sync off (the replay) keeps a backward's gradients unsharded, off p.grad.
        candidates += [(f"{n}.grad", g) for n, g in compat.fsdp_unsharded_grads(root)]
    seen = {id(p) for _, p in params}
    candidates += [
        (f"leaf[{i}].grad", t.grad)
        for i, t in enumerate(tracer.leaves.values())
        if id(t) not in seen and t.grad is not None
    ]
    return candidates


def weight_scale(root: nn.Module, top: int = 3) -> dict[str, Any]:
    """How far Linear/Conv weights sit from the 1/sqrt(fan_in) scale: ``stats.init_ratio``, rms * sqrt(fan_in)."""
    named = [
        (user_name(name), m.weight)
        for name, m in root.named_modules()
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and m.weight.numel() > 1
    ]
    if not named:
        return {}
    with torch.no_grad():
        ratios = init_ratios([w for _, w in named]).nan_to_num(0.0, 0.0, 0.0).tolist()
    ranked = sorted(zip((n for n, _ in named), ratios, strict=True), key=lambda x: -x[1])
    weights = dict(named)
    return {
        "max_ratio": ranked[0][1],
        "module": ranked[0][0],
        "top": [{"module": n, "ratio": r} for n, r in ranked[:top]],
        # In-place writes to it since it was made: an init and a load write a weight a few times, training
        # on every update (diagnose.TRAINED_WRITES).
        "writes": version(weights[ranked[0][0]]),
    }
