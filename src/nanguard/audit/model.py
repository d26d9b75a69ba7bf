"""``audit_model``: find model settings that make training non-finite, before it starts.

Statistics of all parameters and buffers are reduced on their device and read back
together (one host read per audit, a second only when something is already non-finite).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd
from torch.nn.modules.loss import _Loss

from nanguard import compat
from nanguard.dtypes import dtype_facts
from nanguard.findings import Finding
from nanguard.stats import INIT_RATIO_HIGH, INIT_RATIO_LOW, fan_in, init_ratio

__all__ = ["audit_model"]

_EPS_ATTRS = ("variance_epsilon", "eps")
# Modules with an ``eps`` that is not a normalization's variance guard.
_NOT_NORMS: tuple[type[nn.Module], ...] = (_Loss, nn.CosineSimilarity, nn.PairwiseDistance)


@dataclass
class _Entry:
    module: str  # qualified module name ("" = root)
    attr: str  # parameter or buffer name inside that module
    kind: str  # "parameter" | "buffer"
    tensor: torch.Tensor

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.attr}" if self.module else self.attr


def audit_model(model: nn.Module, *, data_parallel: bool | None = None) -> list[Finding]:
    """Audit a model for settings that turn training non-finite.

    Checks: parameters/buffers already non-finite; normalization eps zero or too small for
    the dtype; Linear/Conv weights initialized far from 1/sqrt(fan_in); float16/bfloat16
    values near the dtype's max; BatchNorm under data parallelism without SyncBatchNorm.
    ``data_parallel=None`` detects it: a DDP wrapper, or an initialized process group with
    more than one rank. ``Finding.where`` is the module's name in ``model.named_modules()``
    (``""`` for the root).

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8, eps=0.0))
        >>> [(f.cause, f.where) for f in audit_model(model)]
        [('norm.zero_variance', '1')]
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if data_parallel is not None and not isinstance(data_parallel, bool):
        raise ValueError(f"data_parallel must be True, False or None, got {data_parallel!r}")
    if data_parallel is None:
        data_parallel = _detect_data_parallel(model)

    modules = list(model.named_modules())
    entries = _entries(modules)
    weights = _audited_weights(modules)
    absmax, finite, ratios = _stats(entries, weights)

    findings = _nonfinite(entries, finite)
    findings += _norm_eps(modules, _dominant_dtype(entries))
    findings += _scale_findings(zip(entries, absmax, finite, ratios, strict=True), weights)
    if data_parallel:
        findings += _batchnorm_without_sync(modules)
    return findings


def _audited_weights(modules: list[tuple[str, nn.Module]]) -> dict[int, tuple[str, nn.Module]]:
    """The Linear/Conv weights whose init scale is audited (not an embedding's tied weight), by id."""
    embedding_weights = {id(m.weight) for _, m in modules if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
    return {
        id(m.weight): (name, m)
        for name, m in modules
        if isinstance(m, (nn.Linear, _ConvNd))
        and _readable(m.weight)
        and m.weight.ndim >= 2
        and id(m.weight) not in embedding_weights
    }


def _scale_findings(
    rows: Iterable[tuple[_Entry, float, bool, float | None]], weights: dict[int, tuple[str, nn.Module]]
) -> list[Finding]:
    """Each finite tensor's init scale (an audited weight) and closeness to its dtype's max."""
    findings: list[Finding] = []
    for entry, top, ok, ratio in rows:
        if not ok:
            continue
        owner = weights.get(id(entry.tensor))
        if owner is not None and ratio is not None:
            findings += _init_scale(owner[0], owner[1], entry.tensor, ratio, top)
        findings += _near_max(entry, top)
    return findings


# --------------------------------------------------------------------------- collection


def _readable(t: object) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and not compat.is_uninitialized(t)
        and t.device.type != "meta"
        and t.layout == torch.strided
        and t.numel() > 0
    )


def _entries(modules: list[tuple[str, nn.Module]]) -> list[_Entry]:
    seen: set[int] = set()
    out: list[_Entry] = []
    for name, module in modules:
        tensors: list[tuple[str, str, torch.Tensor]] = [
            ("parameter", a, t) for a, t in module.named_parameters(recurse=False)
        ]
        tensors += [("buffer", a, t) for a, t in module.named_buffers(recurse=False)]
        for kind, attr, t in tensors:
            if id(t) in seen or not _readable(t) or not (t.is_floating_point() or t.is_complex()):
                continue
            seen.add(id(t))
            out.append(_Entry(name, attr, kind, t))
    return out


def _stats(
    entries: list[_Entry], weights: dict[int, tuple[str, nn.Module]]
) -> tuple[list[float], list[bool], list[float | None]]:
    """Per entry: absmax, all-finite flag, and the init ratio of audited weights, in one host read."""
    if not entries:
        return [], [], []
    target = next((e.tensor.device for e in entries if e.tensor.device.type != "cpu"), torch.device("cpu"))
    rows = []
    with torch.no_grad():
        for e in entries:
            t = e.tensor.detach()
            top = torch.linalg.vector_norm(t, math.inf)
            audited = id(e.tensor) in weights and not t.is_complex()
            ratio = init_ratio(t) if audited else torch.full_like(top, -1.0)
            # The finite flag is taken before the cast: a large float64 is finite yet
            # overflows float32.
            rows.append(torch.stack([top.float(), top.isfinite().float(), ratio.float()]).to(target))
        values = torch.stack(rows).tolist()
    absmax = [v[0] for v in values]
    finite = [v[1] > 0 for v in values]
    ratios = [v[2] if v[2] >= 0 else None for v in values]
    return absmax, finite, ratios


def _dominant_dtype(entries: list[_Entry]) -> torch.dtype:
    sizes: dict[torch.dtype, int] = {}
    for e in entries:
        if e.kind == "parameter" and e.tensor.is_floating_point():
            sizes[e.tensor.dtype] = sizes.get(e.tensor.dtype, 0) + e.tensor.numel()
    return max(sizes, key=sizes.__getitem__) if sizes else torch.get_default_dtype()


def _detect_data_parallel(model: nn.Module) -> bool:
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return True
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _num(x: float) -> str:
    """1e-05 -> '1e-5': the way people write eps in code."""
    if x == 0:
        return "0.0"
    return re.sub(r"e([+-])0*(\d)", lambda m: f"e{m[1].replace('+', '')}{m[2]}", f"{x:g}")


# --------------------------------------------------------------------------- checks


def _nonfinite(entries: list[_Entry], finite: list[bool]) -> list[Finding]:
    bad = [e for e, ok in zip(entries, finite, strict=True) if not ok]
    if not bad:
        return []
    target = bad[0].tensor.device
    with torch.no_grad():
        counts = torch.stack(
            [torch.stack([e.tensor.isnan().sum(), e.tensor.isinf().sum()]).to(target) for e in bad]
        ).tolist()
    findings = []
    for e, (nan, inf) in zip(bad, counts, strict=True):
        if e.kind == "buffer":
            fix = (
                "Reset or recompute the buffer (BatchNorm: module.reset_running_stats()) "
                "and find the step that wrote it with nanguard.Guard."
            )
        else:
            fix = (
                "Restore the last finite checkpoint or re-initialize this tensor, and run "
                "training under nanguard.Guard to catch the step that produced it."
            )
        findings.append(
            Finding(
                cause="parameters.nonfinite",
                where=e.module,
                message=(f"{e.kind} {e.qualname!r} holds {nan} NaN and {inf} Inf of {e.tensor.numel()} values"),
                fix=fix,
                details={
                    "tensor": e.qualname,
                    "kind": e.kind,
                    "nan": nan,
                    "inf": inf,
                    "numel": e.tensor.numel(),
                    "dtype": str(e.tensor.dtype).removeprefix("torch."),
                },
            )
        )
    return findings


def _norm_eps(modules: list[tuple[str, nn.Module]], default: torch.dtype) -> list[Finding]:
    findings = []
    for name, module in modules:
        if isinstance(module, _NOT_NORMS):
            continue
        attr = next((a for a in _EPS_ATTRS if _is_number(getattr(module, a, None))), None)
        if attr is None:
            continue
        eps = float(getattr(module, attr))
        own = [
            t
            for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))
            if _readable(t) and t.is_floating_point()
        ]
        dtype = own[0].dtype if own else default
        facts = dtype_facts(dtype)
        if facts is None or eps >= facts.min_norm_eps:
            continue
        dname = facts.name
        rounds_to_zero = eps != 0 and torch.tensor(eps, dtype=dtype).item() == 0
        zero = " (it rounds to 0 in " + dname + ")" if rounds_to_zero else ""
        label = type(module).__name__
        findings.append(
            Finding(
                cause="norm.zero_variance",
                where=name,
                message=(
                    f"{label} {attr} is {_num(eps)}{zero}; "
                    f"use >= {_num(facts.min_norm_eps)} ({facts.eps_reason}). A constant "
                    "input has zero variance and rsqrt(var + eps) blows up."
                ),
                fix=(
                    f"Build it with {attr}={_num(facts.min_norm_eps)} or larger (or set "
                    f"model.get_submodule({name!r}).{attr} = {_num(facts.min_norm_eps)}), or "
                    "run the normalization in float32."
                ),
                details={
                    "module_type": type(module).__name__,
                    "attribute": attr,
                    "eps": eps,
                    "dtype": dname,
                    "min_eps": facts.min_norm_eps,
                    "rounds_to_zero": rounds_to_zero,
                },
            )
        )
    return findings


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _init_scale(name: str, module: nn.Module, weight: torch.Tensor, ratio: float, absmax: float) -> list[Finding]:
    fans = fan_in(weight)
    rms = ratio / math.sqrt(fans)
    label = type(module).__name__
    details = {
        "module_type": type(module).__name__,
        "rms": rms,
        "fan_in": fans,
        "ratio": ratio,
        "expected_rms": 1 / math.sqrt(fans),
    }
    if ratio > INIT_RATIO_HIGH:
        return [
            Finding(
                cause="init.scale",
                where=name,
                message=(
                    f"{label} weight rms {rms:.3g} is {ratio:.3g}x 1/sqrt(fan_in={fans}); "
                    f"each such layer multiplies activations by ~{ratio:.3g}, which overflows "
                    "within a few layers"
                ),
                fix=(
                    "Re-initialize it at scale 1/sqrt(fan_in) (nn.init.kaiming_uniform_, "
                    "nn.init.xavier_uniform_, or normal_(std=fan_in ** -0.5)); if the weights "
                    "were loaded or converted, check for a missing or doubled scale factor."
                ),
                details=details,
            )
        ]
    if ratio < INIT_RATIO_LOW:
        fix = "Re-initialize it at scale 1/sqrt(fan_in) (nn.init.kaiming_uniform_ or nn.init.xavier_uniform_)."
        if absmax == 0:
            what = "weight is all zeros"
            fix = f"Fine if deliberate (zero-init residual branch, LoRA B). Otherwise: {fix}"
        else:
            what = f"weight rms {rms:.3g} is only {ratio:.3g}x 1/sqrt(fan_in={fans})"
        return [
            Finding(
                cause="init.scale",
                where=name,
                message=(
                    f"{label} {what}; signals and gradients through it vanish, and 16-bit gradients round to zero"
                ),
                fix=fix,
                severity="warning",
                details=details,
            )
        ]
    return []


def _near_max(entry: _Entry, absmax: float) -> list[Finding]:
    facts = dtype_facts(entry.tensor.dtype)
    if facts is None or not facts.low_precision or absmax <= facts.overflow_threshold:
        return []
    return [
        Finding(
            cause="precision.overflow",
            where=entry.module,
            message=(
                f"{entry.kind} {entry.qualname!r} ({facts.name}) reaches |x| = {absmax:.4g}, "
                f"{absmax / facts.max:.0%} of the {facts.name} max {facts.max:.4g}; a residual "
                "add or a product with it overflows to inf"
            ),
            fix=(
                "Keep master weights in float32 and let torch.autocast cast per op, or rescale "
                "this tensor (and its consumers) well below the dtype's max."
            ),
            details={
                "tensor": entry.qualname,
                "kind": entry.kind,
                "absmax": absmax,
                "dtype": facts.name,
                "dtype_max": facts.max,
                "fraction_of_max": absmax / facts.max,
            },
        )
    ]


def _batchnorm_without_sync(modules: list[tuple[str, nn.Module]]) -> list[Finding]:
    return [
        Finding(
            cause="distributed.replica_divergence",
            where=name,
            message=(
                f"{type(module).__name__} normalizes with per-rank batch statistics "
                "under data parallelism: small per-GPU batches give noisy (or zero) "
                "variance, and running statistics differ between replicas"
            ),
            fix=("Convert before wrapping in DDP: model = nn.SyncBatchNorm.convert_sync_batchnorm(model)."),
            severity="warning",
            details={"module_type": type(module).__name__},
        )
        for name, module in modules
        if isinstance(module, _BatchNorm) and not isinstance(module, nn.SyncBatchNorm)
    ]
