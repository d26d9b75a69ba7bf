"""``module_stats``: replay a step with forward hooks for each module's activation absmax and gradient norm."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from nanguard.stats import local
from nanguard.tracer.compiled import eager, user_name
from nanguard.tracer.protect import Backup
from nanguard.tree import tensors

__all__ = ["module_stats"]


def module_stats(model: nn.Module, closure: Callable[[], Any], *, max_modules: int = 256) -> dict[str, Any]:
    """Run ``closure`` once with forward hooks; return each module's output absmax and grad norm.

    ``closure`` is the training closure of the step (zero grads, forward, backward). Every
    submodule of ``model`` (the root excluded) that ran gets a row, in the order modules
    are first entered: ``absmax`` is the largest finite ``|x|`` over its floating outputs, ``nan``/``inf``
    count its non-finite output elements, and ``grad_norm`` is the L2 norm of the finite
    gradient entries of its own parameters (``grad_nan``/``grad_inf`` count the rest; None
    when it owns no parameter with a gradient). Floating buffers are put back afterwards;
    gradients are left as the closure made them, and RNG state is the caller's business
    (restore it first for a faithful replay). An exception in ``closure`` does not
    propagate: its first line lands in ``error`` and the rows seen so far are kept.

    With more than ``max_modules`` rows, the rows with non-finite values are kept first,
    then the earliest ones; ``omitted`` counts the rest. The result is JSON-safe.

    Example:
        >>> stats = module_stats(model, lambda: train_step(model, batch))
        >>> stats["modules"][0]
        {'name': 'wte', 'type': 'Embedding', 'absmax': 0.08, 'nan': 0, 'inf': 0, 'grad_norm': 0.4, ...}
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(closure):
        raise ValueError(f"closure must be callable, got {type(closure).__name__}")
    if max_modules < 1:
        raise ValueError(f"max_modules must be >= 1, got {max_modules}")

    named = [(user_name(name), m) for name, m in model.named_modules() if user_name(name)]
    # Per module: a list of device scalars [absmax, nan, inf] per call, read back once at the end.
    seen: dict[str, list[torch.Tensor]] = {}
    error = _run_hooked(model, closure, named, seen)
    modules = dict(named)
    grads = {name: _grad_health(modules[name]) for name in seen}
    values = _read({**{("act", n): c for n, c in seen.items()}, **{("grad", n): g for n, g in grads.items()}})
    rows = [_row(name, modules[name], values[("act", name)], values[("grad", name)]) for name in seen]
    kept = _kept(rows, max_modules)
    return {"modules": kept, "omitted": len(rows) - len(kept), "error": error}


def _run_hooked(
    model: nn.Module,
    closure: Callable[[], Any],
    named: list[tuple[str, nn.Module]],
    seen: dict[str, list[torch.Tensor]],
) -> str | None:
    """Run ``closure`` with each of ``named``'s hooks writing into ``seen``, floating buffers put back
    after; the first line of the error it raised, if any."""
    backup = Backup(now=[b for b in model.buffers() if b.is_floating_point()])
    handles = [m.register_forward_pre_hook(_enter_hook(seen, name)) for name, m in named]
    handles += [m.register_forward_hook(_output_hook(seen, name)) for name, m in named]
    try:
        with eager():  # hooks inside a compiled model would make dynamo recompile
            closure()
    except Exception as err:
        return f"{type(err).__name__}: {err}".splitlines()[0][:300]
    finally:
        for handle in handles:
            handle.remove()
        backup.restore()
    return None


def _output_hook(seen: dict[str, list[torch.Tensor]], name: str) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        outputs = [t for t in tensors(output) if t.is_floating_point() and t.numel()]
        with torch.no_grad():
            seen.setdefault(name, []).extend(_health(local(t.detach())) for t in outputs)

    return hook


def _enter_hook(seen: dict[str, list[torch.Tensor]], name: str) -> Callable[..., None]:
    def pre_hook(module: nn.Module, args: Any) -> None:
        seen.setdefault(name, [])  # rows follow the order modules are entered

    return pre_hook


def _row(name: str, module: nn.Module, act: list[list[float]], grad: list[list[float]]) -> dict[str, Any]:
    return {
        "name": name,
        "type": type(module).__name__,
        "absmax": max((v[0] for v in act), default=None),
        "nan": int(sum(v[1] for v in act)),
        "inf": int(sum(v[2] for v in act)),
        "grad_norm": sum(v[0] for v in grad) ** 0.5 if grad else None,
        "grad_nan": int(sum(v[1] for v in grad)),
        "grad_inf": int(sum(v[2] for v in grad)),
    }


def _kept(rows: list[dict[str, Any]], max_modules: int) -> list[dict[str, Any]]:
    """At most ``max_modules`` rows: those with non-finite values first, then the earliest, in order."""
    if len(rows) <= max_modules:
        return rows
    bad = [r for r in rows if _nonfinite(r)]
    keep = {id(r) for r in bad[:max_modules]}
    for r in rows:
        if len(keep) >= max_modules:
            break
        keep.add(id(r))
    return [r for r in rows if id(r) in keep]


def _read(groups: Mapping[Any, list[torch.Tensor]]) -> dict[Any, list[list[float]]]:
    """Every group's 3-vectors as floats, with one device-to-host copy per device."""
    by_device: dict[torch.device, list[tuple[Any, int]]] = {}
    flat: dict[torch.device, list[torch.Tensor]] = {}
    for key, group in groups.items():
        for t in group:
            by_device.setdefault(t.device, []).append((key, len(flat.setdefault(t.device, []))))
            flat[t.device].append(t)
    out: dict[Any, list[list[float]]] = {key: [] for key in groups}
    for device, stacked in flat.items():
        values = torch.stack(stacked).cpu().tolist()
        for key, i in by_device[device]:
            out[key].append(values[i])
    return out


def _health(t: torch.Tensor) -> torch.Tensor:
    """[finite absmax, #nan, #inf] of ``t`` as one float64 device tensor: no host sync."""
    finite = torch.isfinite(t)
    absmax = torch.where(finite, t.abs(), torch.zeros((), dtype=t.dtype, device=t.device)).amax()
    return torch.stack([absmax.double(), torch.isnan(t).sum().double(), torch.isinf(t).sum().double()])


def _grad_health(module: nn.Module) -> list[torch.Tensor]:
    """Per own parameter with a gradient: [squared finite norm, #nan, #inf] on its device."""
    # A DTensor (FSDP2) gradient counts this rank's shard: reducing the full tensor would be a collective.
    grads = [local(p.grad.detach()) for p in module.parameters(recurse=False) if p.grad is not None]
    out = []
    with torch.no_grad():
        for g in grads:
            masked = torch.where(torch.isfinite(g), g, torch.zeros((), dtype=g.dtype, device=g.device))
            wide = torch.float32 if g.dtype in (torch.float16, torch.bfloat16) else None
            norm = torch.linalg.vector_norm(masked, dtype=wide).double()
            out.append(torch.stack([norm.square(), torch.isnan(g).sum().double(), torch.isinf(g).sum().double()]))
    return out


def _nonfinite(row: Mapping[str, Any]) -> bool:
    return bool(row.get("nan") or row.get("inf") or row.get("grad_nan") or row.get("grad_inf"))
