"""Evidence -> cause: an ordered table of small, pure rules.

Each rule reads the evidence dict that ``locate`` (and the guard's history) builds and
returns a ``Judgement`` or None. The first rule that fits wins; the order puts the more
specific and more upstream causes first: data, parameters, init, divergence, then the
op-level causes.

The last section builds the diagnoses the guard makes from its own state rather than from
a replay (a non-finite update, a transient fault, a collapsed loss scale, replicas that
differ, a batch rejected before the forward) and ``with_run_facts``, which judges one of
those with the run's history: pure functions of their arguments. A traced diagnosis gets the
run's facts before its one ``diagnose`` (``trace(..., run=...)``).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch

from nanguard.causes import row_of
from nanguard.dtypes import dtype_facts
from nanguard.evidence import Evidence, OriginEvidence, RunFacts
from nanguard.findings import Diagnosis, Finding
from nanguard.stats import INIT_RATIO_HIGH
from nanguard.text import short_op as _short

_V = TypeVar("_V")

__all__ = [
    "HINTS",
    "RULES",
    "Judgement",
    "communication_overflow",
    "diagnose",
    "faulty_device",
    "grown_weights",
    "loaded_nonfinite",
    "loss_scale_collapse",
    "nonfinite_shards",
    "nonfinite_update",
    "rejected_batch",
    "replica_divergence",
    "runaway_growth",
    "transient_fault",
    "with_run_facts",
]


def _rule(read: Callable[[Evidence], _V]) -> Callable[[Evidence | Mapping[str, Any]], _V]:
    """A rule reads the typed record; called with a written dict (tests, bundles) it reads it through the record."""

    @functools.wraps(read)
    def rule(evidence: Evidence | Mapping[str, Any]) -> _V:
        return read(Evidence.of(evidence))

    return rule


@dataclass
class Judgement:
    """What a rule makes of the evidence: the cause it names, why, and the fixes to try.

    ``diagnose`` returns the first rule's; ``locate`` builds the ``Diagnosis`` from it. (The guard's
    ``policy.Verdict`` is another record: what a measured step was, before the policy decides.)
    """

    cause: str
    why: str
    fixes: list[str] = field(default_factory=list)
    also: list[dict[str, str]] = field(default_factory=list)
    """Other causes that fit the evidence, most likely first: ``{"cause", "why"}`` each."""
    op_cause: str | None = None
    """With the run's facts (history, initial weight scale): the cause the tracer's own evidence
    names, when the facts name another (written as ``evidence["op_cause"]``)."""


def _origin(ev: Evidence) -> OriginEvidence:
    return ev.origin_or_empty


def _where(o: OriginEvidence) -> str:
    module = o.module
    if module is None:
        return "code outside any module"
    return f"module '{module}'" if module else "the root module"


def _first_input(o: OriginEvidence) -> dict[str, Any]:
    inputs = o.inputs or [{}]
    return inputs[0]


def _node_op(node: str) -> str:
    """``LogBackward0`` -> ``log``, ``Log10Backward0`` -> ``log10``: the op an autograd node is the backward of."""
    name = node.rstrip("0123456789")
    return name.removesuffix("Backward").lower() if name.endswith("Backward") else ""


# -- data ------------------------------------------------------------------------------
@_rule
def index_out_of_range(ev: Evidence) -> Judgement | None:
    o = _origin(ev)
    if o.category != "index":
        return None
    size = o.indexed_size
    index = next((s for s in o.index_inputs or [] if s.get("path")), None)
    index = index or (o.index_inputs or [{}])[0]
    path = index.get("path") or "an integer input"
    lo, hi = index.get("min"), index.get("max")
    why = f"{o.op} got ids in [{lo}, {hi}] from {path}"
    why += f", but the valid range is [0, {size - 1}]" if isinstance(size, int) else ""
    why += f" ({o.error or 'index error'})"
    fixes = [
        f"check {path}: ids must be < {size}" if size else f"check the ids in {path}",
        "make the tokenizer's vocab size match the embedding "
        "(model.resize_token_embeddings(len(tokenizer)) for Hugging Face models)",
        "call ng.check_batch(batch, model=model) before the forward: on CUDA this "
        "error is a device-side assert that kills the process",
    ]
    return Judgement("data.index_out_of_range", why, fixes)


@_rule
def no_valid_targets(ev: Evidence) -> Judgement | None:
    o = _origin(ev)
    if o.get("reduced_elements") == 0 and o.get("targets") == 0 and o.category == "op":
        return _empty_targets(o)
    if (counted := _zero_count_from_batch(o)) is not None:
        return _empty_targets(o, counted)
    if (o.op or "").startswith("aten.nll_loss") and (weighted := _zero_weight_targets(o)) is not None:
        return weighted
    if not (o.op or "").startswith("aten.nll_loss") or o.get("valid_targets") != 0:
        return None
    ignore = o.get("ignore_index", -100)
    why = f"all {o.get('targets')} targets equal ignore_index={ignore}, so the mean loss in {o.op} is 0/0"
    fixes = [
        f"skip or re-pack batches whose labels are all {ignore} (e.g. a sequence cut "
        "to its prompt, or padding-only samples)",
        "use reduction='sum' and divide by max(number of valid targets, 1)",
        "run ng.check_batch(batch) in the data loader to drop such batches",
    ]
    return Judgement("data.no_valid_targets", why, fixes)


def _zero_weight_targets(o: OriginEvidence) -> Judgement | None:
    """A class-weighted mean loss whose valid targets all have weight 0 while other classes have
    weight: the batch holds only zero-weighted classes (a crop of the void class), 0/0."""
    weights, denom = o.get("class_weights") or {}, o.get("denominator") or {}
    if not (o.get("valid_targets") and denom.get("zeros") and weights.get("sum")) or o.get("reduction") != 1:
        return None
    classes = o.get("target_classes") or []
    why = (
        f"every one of the {o.get('valid_targets')} valid targets of {o.op} is of a class with weight 0 "
        f"(classes {classes}; {weights.get('zero_weight_classes')} of {weights.get('classes')} classes weigh 0), "
        "so the weighted mean divides by a total weight of 0"
    )
    fixes = [
        "skip or re-crop batches whose targets are all zero-weighted classes (a crop of only void / background)",
        "use reduction='sum' and divide by max(total weight, eps), or map a void class to ignore_index instead",
        "run ng.check_batch(batch) in the data loader to drop batches with no valid target",
    ]
    return Judgement("data.no_valid_targets", why, fixes)


def _zero_count_from_batch(o: OriginEvidence) -> str | None:
    """The batch tensor a division's all-zero denominator was counted from (``mask.sum()``), if any."""
    if o.category != "op" or _short(o.op) not in ("div", "div_", "true_divide"):
        return None
    inputs = o.inputs or []
    denom = inputs[1] if len(inputs) > 1 else {}
    size = math.prod(denom.get("shape") or [])
    if denom.get("counted_from") is None or denom.get("zeros") != size:
        return None
    return str(denom["counted_from"])


def _empty_targets(o: OriginEvidence, counted: str | None = None) -> Judgement:
    """A mean over targets the batch selected none of: a mean-reduced loss given no targets at all
    (no positive anchor), or a division by a count of 0 computed from the batch (``mask.sum()``)."""
    if counted is None:
        what = "got 0 targets, so its mean over 0 elements is 0/0"
    else:
        what = f"divided by a count of 0 computed from {counted}, so the mean over the selected targets is 0/0"
    why = (
        f"{o.op} in {_where(o)} {what}: the selection of targets from the batch is empty (e.g. an image "
        "without a positive anchor, every label ignored, a mask that keeps nothing)"
    )
    if o.source:
        why += f" at {o.source}"
    fixes = [
        "skip the loss term when the selection is empty: loss = pred[pos].sum() * 0 if not pos.any() else ...",
        "use reduction='sum' and divide by max(number of selected targets, 1)",
        "check the batch: samples without any valid target should be filtered or re-packed",
    ]
    return Judgement("data.no_valid_targets", why, fixes)


@_rule
def nonfinite_data(ev: Evidence) -> Judgement | None:
    o = _origin(ev)
    if o.category not in ("data", "fill"):
        return None
    stats = _first_input(o)
    path = o.path or "an input"
    why = (
        f"{path} arrived holding {stats.get('nan', 0)} NaN, {stats.get('posinf', 0)} +Inf and "
        f"{stats.get('neginf', 0)} -Inf values"
    )
    if o.get("consumer_op"):
        why += f"; first used by {o.get('consumer_op')} in {_where(OriginEvidence(module=o.get('consumer_module')))}"
    fixes = [
        f"find the sample that produced {path}: decoding, normalization (division by a zero "
        "std) or augmentation can write NaN/Inf",
        "validate batches with ng.check_batch(batch) and drop bad ones in the data loader",
        "use ng.Guard(..., policy='skip') so a bad batch costs one step, not the run",
    ]
    return Judgement("data.nonfinite", why, fixes)


# -- parameters and init ---------------------------------------------------------------
@_rule
def nonfinite_parameters(ev: Evidence) -> Judgement | None:
    o = _origin(ev)
    if o.category != "parameters":
        return None
    stats = _first_input(o)
    name = o.path or "a parameter or buffer"
    why = (
        f"{name} (module '{o.module or ''}') already held {stats.get('nan', 0)} NaN and "
        f"{stats.get('posinf', 0) + stats.get('neginf', 0)} Inf values before the step"
    )
    fixes = [
        f"if {name} came from a checkpoint, re-export it: the saved tensor is corrupt",
        "an earlier optimizer step wrote it: run under ng.Guard, which checks parameters "
        "after every update and names the step",
        "ng.audit_model(model) lists every non-finite parameter and buffer",
    ]
    return Judgement("parameters.nonfinite", why, fixes)


_PRODUCTS = ("mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "_scaled_dot_product_flash_attention", "mul")


def _input_absmax(o: OriginEvidence) -> float:
    return max((s.get("absmax") or 0.0 for s in o.inputs or []), default=0.0)


def _grown(ev: Evidence) -> bool:
    """Is the origin an overflow of grown activations: a product of large weights, or inputs already huge?

    log(0) next to large weights is a domain error, not the weights' doing.
    """
    o = _origin(ev)
    return (ev.kind == "inf" and _short(o.op) in _PRODUCTS) or _input_absmax(o) >= 1e4


@_rule
def init_scale(ev: Evidence) -> Judgement | None:
    o = _origin(ev)
    # The guard passes the scale the run started from; locate alone sees the current one.
    scale = ev.scale
    ratio = scale.get("max_ratio") or 0.0
    if o.category != "op" or ratio < INIT_RATIO_HIGH:
        return None
    # A low-precision overflow that float32 computes finitely is precision, even with large
    # (pretrained) weights: init.scale is for activations that blow up in float32 as well.
    if (o.get("fp32_recompute") or {}).get("finite"):
        return None
    if not _grown(ev) or _grew_in_training(ev):
        return None
    absmax = _input_absmax(o)
    why = (
        f"weights of '{scale.get('module')}' have rms x sqrt(fan_in) = {ratio:.3g} (healthy is "
        f"about 0.5-1), so activations grow by that factor per layer until {o.op} "
        f"overflowed (inputs up to {absmax:.3g})"
    )
    fixes = [
        f"re-initialize '{scale.get('module')}' (and its peers) with std ~ 1/sqrt(fan_in), "
        "e.g. nn.init.normal_(w, std=0.02) for transformers or nn.init.kaiming_uniform_",
        "check a custom _init_weights: a std meant for a gain was passed as the std",
        "ng.audit_model(model) flags every weight far from 1/sqrt(fan_in)",
    ]
    return Judgement("init.scale", why, fixes)


TRAINED_WRITES = 16
"""In-place writes to a weight past which it was trained: an init writes it once or twice and a load once,
an optimizer on every update (a fused optimizer's writes are not counted: its weights read as untrained)."""


def _grew_in_training(ev: Evidence) -> bool:
    """Are the weights' size training's doing: grown ``GROWN_WEIGHTS``-fold since the run's start (the
    guard's facts), or, without them, written in place more than an init and a load write them?"""
    if _weight_growth(ev) >= GROWN_WEIGHTS or (_weights_log(ev).get("growth") or 0.0) >= GROWN_WEIGHTS:
        return True
    scale = ev.weight_scale or {}
    writes, large = scale.get("writes"), (scale.get("max_ratio") or 0.0) >= INIT_RATIO_HIGH
    return not _run_facts_given(ev) and large and isinstance(writes, int) and writes >= TRAINED_WRITES


def _run_facts_given(ev: Evidence) -> bool:
    return "initial_weight_scale" in ev.given or ev.initial_weight_scale is not None


def _weights_log(ev: Evidence) -> dict[str, Any]:
    """The guard's weight log at the trip (``guard.growth.WeightLog.evidence``), {} without one."""
    found = (ev.history or {}).get("weights")
    return found if isinstance(found, dict) else {}


def _overflowed(ev: Evidence) -> bool:
    """An overflow of grown values: a product of large weights, inputs already huge, or a
    normalization whose statistics overflowed."""
    o = _origin(ev)
    return o.category == "op" and (_grown(ev) or (_normalization(o) and _statistics_overflowed(o)))


@_rule
def grown_weights(ev: Evidence) -> Judgement | None:
    """An overflow of weights that training grew: their size is no init's, whatever the loss did
    (x1.2 a step is never the tenfold jump ``divergence`` waits for). With the guard's weight log, how
    much, how fast and since when, and the LR (a negative one: descent turned to ascent); from
    ``locate`` alone, that the weights were written by training and the history is unknown."""
    o = _origin(ev)
    if not _overflowed(ev) or not _grew_in_training(ev) or _op_explains(ev):
        return None
    grown, history = _weights_log(ev), ev.history or {}
    scale = ev.weight_scale or {}
    lr = history.get("lr")
    if grown.get("growth", 0.0) >= GROWN_WEIGHTS:
        start, now, rate = grown.get("norm_start", 0), grown.get("norm_now", 0), grown.get("per_step", 1)
        why = (
            f"the weights grew {grown['growth']:.3g}x since the run's start ('{grown.get('parameter')}': norm "
            f"{start:.3g} -> {now:.3g}), about x{rate:.3g} a step since step {grown.get('since')}"
        )
    elif _run_facts_given(ev):
        why = f"the weights of '{scale.get('module')}' are {_weight_growth(ev):.3g}x their scale at the run's start"
    else:
        why = (
            f"the weights of '{scale.get('module')}' are {scale.get('max_ratio', 0):.3g}x the 1/sqrt(fan_in) scale and "
            f"were written in place {scale.get('writes')} times (an optimizer's updates): grown by training, not "
            "initialized so; locate alone does not see the run's history (how fast they grew, since when, the LR): "
            "run the loop under ng.Guard, which records it"
        )
    negative = grown.get("lr_negative_since")
    if isinstance(lr, (int, float)) and not isinstance(lr, bool) and negative is None:
        why += f", under lr {lr:.3g}"
    why += _weights_why({"lr_negative_since": negative}, lr) if negative is not None else ""
    norm = _normalization(o) and _statistics_overflowed(o)
    why += f"; then {_overflow_why(o) if norm else f'{o.op} in {_where(o)} overflowed'}"
    why += "" if norm else f" (inputs up to {_input_absmax(o):.3g})"
    return Judgement("optimizer.divergence", why, _growth_fixes(lr, negative))


def _op_explains(ev: Evidence) -> bool:
    """Does an op-level rule name the origin itself: a float16 overflow float32 computes finitely, an exp
    of a softmax written without its max? Then that is the fix, and the growth a second cause (``also``)."""
    return any(rule(ev) is not None for rule in _OP_RULES)


def _growth_fixes(lr: Any, negative: Any) -> list[str]:
    fixes = []
    if negative is not None:
        fixes.append(
            f"the learning rate went negative at step {negative}: a warmup-then-linear-decay schedule run past its "
            "last step goes below 0; clamp it at 0 (max(0.0, ...)) and give it the number of steps the loop runs"
        )
    fixes += [
        "check the update's sign: weight decay must shrink the weights (p.mul_(1 - lr * wd), or "
        "p.add_(p, alpha=-lr * wd)), and a hand-written update subtracts lr x its direction",
        f"lower the learning rate (now {lr:.3g}) and add gradient clipping"
        if isinstance(lr, (int, float)) and not isinstance(lr, bool)
        else "lower the learning rate and add gradient clipping",
    ]
    return fixes


@_rule
def divergence(ev: Evidence) -> Judgement | None:
    history = ev.history or {}
    if not history.get("diverging"):
        return None
    o = _origin(ev)
    why = (
        f"{history.get('metric', 'grad norm')} grew {history.get('growth', 0):.3g}x over the "
        f"last {history.get('window', 0)} steps before the trip"
    )
    if o.op:
        why += f"; the first non-finite value then appeared in {o.op} ({_where(o)})"
    return Judgement("optimizer.divergence", why, _divergence_fixes(history))


def _divergence_fixes(history: Mapping[str, Any]) -> list[str]:
    return [
        f"lower the learning rate (now {history['lr']:.3g})" if history.get("lr") else "lower the learning rate",
        "add warmup and gradient clipping: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
        "watch the spike events in the run's event log: they start before the NaN",
    ]


# -- op-level --------------------------------------------------------------------------
@_rule
def precision_overflow(ev: Evidence) -> Judgement | None:
    o = _origin(ev)
    ref = o.get("fp32_recompute") or {}
    if not ref.get("finite"):
        return None
    dtype = ref.get("dtype", "float16")
    why = (
        f"{o.op} in {dtype} produced Inf/NaN, but recomputed in float32 it is finite "
        f"with absmax {ref.get('absmax', 0):.3g} (> {dtype} max {ref.get('dtype_max', 0):.3g})"
    )
    fixes = [
        f"switch {dtype} to bfloat16 or keep this op ({_short(o.op)} in {_where(o)}) in float32",
        "scale the operands down first: e.g. divide q by sqrt(head_dim) before q @ k^T, not after",
        "under autocast, wrap the block in torch.autocast(device_type, enabled=False) and cast to float32",
    ]
    return Judgement("precision.overflow", why, fixes)


@_rule
def masked_softmax(ev: Evidence) -> Judgement | None:
    o = _origin(ev)
    node = o.node or ""
    if _short(o.op) in ("_softmax", "_log_softmax", "_safe_softmax") and o.get("fully_masked_rows"):
        why = (
            f"{o.get('fully_masked_rows')} of {o.get('rows')} rows given to {o.op} in {_where(o)} "
            "are entirely -inf, and softmax of an all -inf row is 0/0"
        )
        why += _masked_by(o)
    elif _node_op(node) in ("logsumexp", "softmax", "logsoftmax") and _neginf_inputs(o) >= 2:
        # The backward of logsumexp/softmax computes exp(x - result): -inf - (-inf) on an all -inf row.
        why = (
            f"{o.op} in {node} ({_where(o)}) computed -inf - (-inf): a row given to "
            f"{_node_op(node)} in forward was entirely -inf, so its gradient is exp(NaN)"
        )
    elif _met_sentinels(o):
        return _infinities_met(o)
    else:
        return None
    fixes = [
        "mask with torch.finfo(dtype).min instead of -inf, or give every query row at least one "
        "key (padding queries can attend to themselves)",
        "use F.scaled_dot_product_attention, whose softmax returns 0 for fully masked rows",
        "drop all-padding samples: ng.check_batch flags them as data.fully_masked",
    ]
    return Judgement("op.masked_softmax", why, fixes)


def _masked_by(o: OriginEvidence) -> str:
    """``; the mask came from the batch: batch[0][1] row 3 masks every position``, when the tracer
    followed the -inf back to a mask the batch carried."""
    found = o.get("masked_by")
    if not isinstance(found, dict):
        return ""
    rows = found.get("rows") or []
    return f"; the mask came from the batch: {found.get('path')} row(s) {rows} mask every position (an empty sample)"


@_rule
def _empty_sample_hint(ev: Evidence) -> Judgement | None:
    """A fully masked row whose mask the batch carried: the sample is the cause behind the op."""
    o = _origin(ev)
    found = o.get("masked_by")
    if not isinstance(found, dict):
        return None
    why = f"sample row(s) {found.get('rows')} of {found.get('path')} mask every position"
    return Judgement("data.fully_masked", why, ["drop or re-pack samples whose mask is all zeros"])


@_rule
def _uninitialized_hint(ev: Evidence) -> Judgement | None:
    """Memory read before any op wrote it reached the results too, beside the origin named (``locate``'s
    ``uninitialized_reads``): NaN in the replay, whatever it held in the step; a bug of its own."""
    reads = ev.get("uninitialized_reads")
    if not reads or _origin(ev).category == "blank":
        return None
    first = reads[0]
    where = f" in module '{first.get('module')}'" if first.get("module") else ""
    why = f"the step also reads memory no op wrote: {first.get('op')}{where}"
    if first.get("source"):
        why += f", allocated at {first.get('source')}"
    return Judgement("op.uninitialized_read", why, ["allocate it with zeros, or write every element before it is read"])


def _met_sentinels(o: OriginEvidence) -> bool:
    """Did the origin combine two -inf it was given on purpose (a mask fill, a running max
    initialised to -inf, an additive mask of the batch's)?"""
    sources = o.get("infinity_sources") or []
    met = o.get("infinities_met") or ""
    return "-inf" in met and bool(sources) and all(s.get("category") in ("write", "fill") for s in sources)


def _infinities_met(o: OriginEvidence) -> Judgement:
    """A softmax, logsumexp or online (blockwise) softmax written out by hand over a row or block
    that is entirely -inf: ``x - max(x)`` is ``-inf - (-inf)``."""
    written = sorted({s.get("op") or s.get("path") or "?" for s in o.get("infinity_sources") or []})
    why = (
        f"{o.op} in {_where(o)} ({o.phase}) computed {o.get('infinities_met')} = NaN: two -inf sentinels "
        f"(written by {', '.join(_short(w) for w in written)}) met, as in x - max(x) over a row or key block "
        "that is entirely masked (a softmax, logsumexp or running max written out by hand)"
    )
    fixes = [
        "use a finite sentinel: initialise the running max and fill masked scores with torch.finfo(dtype).min "
        "instead of -inf, so an empty row or block gives exp(0) weights that the mask then zeroes",
        "or guard the empty block: subtract torch.where(m == -inf, 0, m) instead of m, so a fully masked "
        "block contributes exp(-inf) = 0 and its row sum stays 0 (divide by sum.clamp_min(tiny))",
        "drop all-padding samples before the model: ng.check_batch flags them as data.fully_masked",
    ]
    return Judgement("op.masked_softmax", why, fixes)


def _neginf_inputs(o: OriginEvidence) -> int:
    return sum(1 for x in o.inputs or [] if x.get("neginf"))


_NORM_NODES = ("LayerNorm", "GroupNorm", "BatchNorm", "RmsNorm", "RMSNorm")
_NORM_OPS = ("_layer_norm", "_group_norm", "_batch_norm", "rms_norm")


# Normalization layers are named *Norm by convention (LayerNorm, LlamaRMSNorm, T5LayerNorm,
# BatchNorm2d); a NormBlock or Normalizer that divides by an L2 norm is not one. The name is
# only a hint, read where the tracer could not see the computation (no autograd graph).
_NORM_LAYER = re.compile(r"Norm(\d+d)?$")
# Statistics a normalization layer divides by (LayerNorm, RMSNorm, BatchNorm): a variance, not an L2 norm.
_VARIANCES = ("variance", "std", "mean of squares")


def _normalization(o: OriginEvidence) -> bool:
    """Is the origin a normalization layer's division by its variance? A fused norm op (or its
    backward), or, read from the computation (``statistic``, ``normalizes``: the tracer saw a
    variance, std or mean of squares of a tensor divide that same tensor), a hand-written one. The
    class name decides only where the tracer could not see the computation (no autograd graph). A
    statistic over too few elements is a division by zero of its own (``_too_few``)."""
    op, node, mtype = (o.op or ""), (o.node or ""), (o.module_type or "")
    if any(n in op for n in _NORM_OPS) or any(n in node for n in _NORM_NODES):
        return True
    named = bool(_NORM_LAYER.search(mtype))
    if "normalizes" not in o.extra:  # the computation was not visible: the class name decides, in forward only
        return named and o.phase == "forward"
    # A division by an L2 norm (F.normalize, weight_norm, ScaleNorm) has no variance and no eps to
    # fix: a division by zero first, the normalization second (``_normalization_hint``).
    return bool(o.get("normalizes")) and not _too_few_elements(o) and o.get("statistic") in _VARIANCES


def _too_few_elements(o: OriginEvidence) -> bool:
    count, correction = o.get("reduced_elements"), o.get("correction")
    return isinstance(count, int) and isinstance(correction, (int, float)) and count - correction <= 0


_SQUARE_OVERFLOW = math.sqrt(torch.finfo(torch.float32).max)
"""Values past this have squares that overflow float32, where norms compute their statistics."""


def _statistics_overflowed(o: OriginEvidence) -> bool:
    """A normalization's variance overflowed: finite inputs too large for their squares (an
    Inf variance, or in a norm's backward inputs past the square's range), the opposite of a
    zero variance."""
    var = o.get("max_variance")
    return (isinstance(var, (int, float)) and not math.isfinite(var)) or _input_absmax(o) >= _SQUARE_OVERFLOW


GROWN_WEIGHTS = 100.0
"""Weights this many times their scale at the start of the run (rms x sqrt(fan_in)) were grown by training."""


def _weight_growth(ev: Evidence) -> float:
    """How many times the weights' scale grew since the run started (0 when only the guard could tell)."""
    now, start = ev.weight_scale or {}, ev.initial_weight_scale or {}
    ratio, initial = now.get("max_ratio") or 0.0, start.get("max_ratio") or 0.0
    return ratio / initial if initial > 0 and ratio >= INIT_RATIO_HIGH else 0.0


def _overflow_why(o: OriginEvidence) -> str:
    dtype = _first_input(o).get("dtype", "float32")
    name = o.module_type or "the normalization layer"
    return (
        f"{name} in {_where(o)} got inputs up to {_input_absmax(o):.3g}, whose variance overflows {dtype} "
        "(a row variance of inf): an overflow of grown activations, not a zero variance"
    )


@_rule
def zero_variance(ev: Evidence) -> Judgement | None:
    o = _origin(ev)
    mtype = o.module_type or ""
    if not _normalization(o) or _statistics_overflowed(o):
        return None
    eps = o.get("norm_eps", o.get("module_eps"))
    var = o.get("min_variance")
    dtype = _first_input(o).get("dtype", "float32")
    limits = dtype_facts(getattr(torch, dtype, torch.float32)) or dtype_facts(torch.float32)
    floor = max(limits.min_norm_eps, 1e-5) if limits else 1e-5
    name = mtype or "the normalization layer"
    why = f"{name} in {_where(o)} divided by sqrt(variance + eps)"
    why += f" with eps = {eps}" if eps is not None else ""
    why += f" and a row variance of {var:.3g}" if var is not None else ""
    if o.get("statistic") and o.get("normalizes"):
        why += " (a hand-written normalization, read from what it computes: "
        why += f"the {o.get('statistic')} of the very tensor it scales)"
    if isinstance(o.get("group_elements"), int) and o.get("group_elements") <= 1:
        why += f"; each group holds {o.get('group_elements')} element, so its variance is 0 by construction"
    fixes = [
        f"{name} eps is {eps}; use >= {floor:g} (PyTorch's default; {dtype} {limits.eps_reason if limits else ''})"
        if eps is not None
        else f"add an eps >= {floor:g} inside the sqrt of the hand-written norm",
        "constant inputs (padding, a dead channel, a zero embedding row) have zero variance: the eps must cover them",
    ]
    return Judgement("norm.zero_variance", why, fixes)


@_rule
def _normalization_hint(ev: Evidence) -> Judgement | None:
    """A division that normalizes a tensor by its own norm (F.normalize, cosine similarity, weight
    norm, spectral norm, a std over one sample): the normalization layer's failure as a second cause."""
    o = _origin(ev)
    if not o.get("normalizes") or o.get("statistic") not in (*_VARIANCES, "L2 norm", "spectral norm"):
        return None
    why = f"{_where(o)} divides a tensor by its own {o.get('statistic')} with no eps: a normalization whose"
    why += " statistic is 0 (a zero row, a zero weight, one element) leaves 0/0"
    return Judgement("norm.zero_variance", why)


_LOG_OPS = ("log", "log2", "log10", "log_", "log2_", "log10_")
# User-level ops that take a log of a determinant: NaN for a negative one, -inf for a singular matrix.
_LOGDET_OPS = ("logdet", "_linalg_slogdet", "linalg_slogdet", "slogdet")
# Ops with a log (or the log of the gamma function) inside: their domain facts come from tracer.ops.
_LOG_FAMILY = frozenset(
    {"xlogy", "special_xlog1py", "log1p", "log1p_", "logit", "logit_", "lgamma", "lgamma_", "digamma", "digamma_"}
    | {"polygamma", "mvlgamma", "special_entr"}
)


@_rule
def log_domain(ev: Evidence) -> Judgement | None:
    o = _origin(ev)
    op, node = _short(o.op), (o.node or "")
    in_log = op in _LOG_OPS or _node_op(node) in _LOG_OPS
    if op in _LOGDET_OPS and not node:
        return _log_determinant(o)
    if op in _LOG_FAMILY and not node and o.get("domain"):
        return _log_family(o)
    if not in_log:
        return None
    x = _first_input(o)
    why = f"{o.op} in {_where(o)} ({o.phase}) got {x.get('zeros', 0)} zeros"
    why += f" and {x.get('negative', 0)} negative values" if x.get("negative") else ""
    if node:
        why += f" (gradient of log is 1/x, created by {node})"
    fixes = [
        "compute F.log_softmax(logits.float()) instead of log(softmax(...)); F.cross_entropy takes logits directly",
        "if you need log of a probability, clamp it: torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))",
    ]
    return Judgement("op.log_domain", why, fixes)


def _log_family(o: OriginEvidence) -> Judgement:
    """xlogy, log1p, logit, lgamma/digamma and the special functions with a log inside, at or past
    the end of their domain; inside a distribution's method (``Beta.log_prob`` runs
    ``xlogy(a - 1, x)``), a value on the boundary of the distribution's support."""
    user, op = o.get("user_op"), _short(o.op)
    where = f"{op} inside {user}" if user and user != op else op
    why = f"{where} in {_where(o)} ({o.phase}) got {o.get('at_boundary', 0)} values on the edge of its domain"
    why += f" and {o.get('outside_domain')} outside it" if o.get("outside_domain") else ""
    why += f" ({o.get('domain')}): the log there is -inf, or NaN past it"
    fixes = []
    if user and "." in user:
        dist = user.split(".")[0]
        why += f"; {dist}'s support is open at that edge, so a value clipped to its bound has no finite log-density"
        fixes.append(
            f"keep values strictly inside {dist}'s support: x.clamp(eps, 1 - eps) for a Beta action clipped to its "
            "bounds, and compute the log-density of the unclipped sample (or of the clamped value)"
        )
    fixes += [
        f"keep {op}'s argument inside its domain: clamp it away from the edge (torch.finfo(dtype).eps), "
        "or mask the terms that sit on it out of the sum",
        "where a log of a probability is the goal, compute it from logits (F.logsigmoid, F.log_softmax)",
    ]
    return Judgement("op.log_domain", why, fixes)


def _log_determinant(o: OriginEvidence) -> Judgement:
    """logdet of a matrix whose determinant is negative is NaN by definition (torch returns NaN
    through an internal where), and of a singular one -inf: the log's domain, not a write."""
    negative, zero = o.get("negative_determinants"), o.get("zero_determinants")
    user = o.get("user_op") or _short(o.op)
    why = f"{user} in {_where(o)} ({o.phase})"
    if negative:
        why += f" got {negative} of {o.get('matrices')} matrices with a negative determinant: the log of a negative"
        why += f" number, which torch returns as {o.get('returned', 'nan')} by definition"
    elif zero:
        why += f" got {zero} singular matrices: log(0) = -inf"
    else:
        why += " took the log of a determinant outside its domain"
    fixes = [
        "use torch.linalg.slogdet(W).logabsdet when only |det| matters (the log-Jacobian of a flow's 1x1 "
        "convolution): a negative determinant is fine there",
        "parametrize W so its determinant cannot change sign: W = P L (U + diag(s)) with s = exp(log_s) "
        "(Glow's LU form)",
    ]
    return Judgement("op.log_domain", why, fixes)


@_rule
def sqrt_domain(ev: Evidence) -> Judgement | None:
    o = _origin(ev)
    op, node = _short(o.op), (o.node or "")
    # The op itself, in forward or run by a backward of the user's (a custom autograd Function).
    forward = op in ("sqrt", "rsqrt", "pow", "sqrt_", "rsqrt_") and o.phase in ("forward", "backward")
    # An Inf from pow or rsqrt of finite values with no negative base is an overflow or a
    # division by zero (rsqrt(0) = 1/sqrt(0)), not a domain error.
    if forward and (not _first_input(o).get("negative") or (op == "pow" and ev.kind != "nan")):
        forward = False
    backward = any(node.startswith(n) for n in ("SqrtBackward", "RsqrtBackward", "PowBackward"))
    if not (forward or backward):
        return None
    x = _first_input(o)
    if backward:
        why = (
            f"the gradient of {_short(o.forward_op) or 'sqrt'} ({node}) in {_where(o)} "
            f"is 1/(2*sqrt(x)), infinite where x = 0"
        )
    else:
        why = f"{o.op} in {_where(o)} got {x.get('negative', 0)} negative values"
    fixes = [
        "add an eps inside the root: torch.sqrt(x + 1e-12), or torch.sqrt(x.clamp_min(1e-12))",
        "for distances and norms use torch.linalg.vector_norm / torch.cdist, whose gradient at 0 is defined",
    ]
    return Judgement("op.sqrt_domain", why, fixes)


@_rule
def exp_overflow(ev: Evidence) -> Judgement | None:
    o = _origin(ev)
    if _short(o.op) not in ("exp", "exp_", "pow") or ev.kind != "inf":
        return None
    why = f"{o.op} in {_where(o)} got inputs up to {o.get('input_max', 0):.3g}"
    why += "; exp(x) overflows float32 above 88.7" if _short(o.op) != "pow" else ": the power overflows"
    fixes = [
        "subtract the row max before exp: (x - x.amax(-1, keepdim=True)).exp(), "
        "or use torch.softmax / torch.logsumexp, which do",
        "bound the argument (e.g. clamp a log-variance before exp)",
    ]
    return Judgement("op.exp_overflow", why, fixes)


@_rule
def division_by_zero(ev: Evidence) -> Judgement | None:
    o = _origin(ev)
    if _too_few_elements(o):
        return _too_few(o, o.get("reduced_elements"), o.get("correction"))
    return _composite_zero(o) or _root_of_zero(ev, o) or _divided_by_zero(o)


def _divided_by_zero(o: OriginEvidence) -> Judgement | None:
    """A division op (or its backward) whose denominator held zeros, or a tensor divided by the number 0."""
    op, node = _short(o.op), (o.node or "")
    if op not in _DIVISIONS and not node.startswith("DivBackward"):
        return None
    zeros = _denominator_zeros(o, op)
    if _zero_scalar_divisor(o, op):
        why = f"{o.op} in {_where(o)} divided by the number 0 (a Python scalar)"
    elif zeros or node:
        why = f"{o.op} in {_where(o)} divided by a denominator with {zeros} zeros"
    else:
        return None
    if o.source:
        why += f" at {o.source}"
    fixes = [
        "clamp the denominator: x.sum() / mask.sum().clamp_min(1) for a masked mean",
        "or add an eps: x / (d + 1e-8)",
    ]
    return Judgement("op.division_by_zero", why, fixes)


def _denominator_zeros(o: OriginEvidence, op: str) -> Any:
    """The zeros the tracer counted in the op's denominator (its input at ``_DIVISIONS[op]``, else the first)."""
    inputs = o.inputs or []
    at = _DIVISIONS.get(op, 1)
    denom = inputs[at] if len(inputs) > at else inputs[0] if inputs else {}
    return denom.get("zeros", 0) if denom else 0


def _zero_scalar_divisor(o: OriginEvidence, op: str) -> bool:
    """``h / 0.0``: a tensor divided by a Python number, which the tracer keeps in ``scalars``, not ``inputs``."""
    scalars = o.scalars or []
    one_tensor = len(o.inputs or []) == 1
    return op in ("div", "div_", "true_divide") and one_tensor and bool(scalars) and scalars[0] == 0


# Ops that divide, by the position of their denominator among the tensor inputs.
_DIVISIONS = {"div": 1, "div_": 1, "true_divide": 1, "reciprocal": 0, "addcdiv": 2, "addcdiv_": 2}


def _composite_zero(o: OriginEvidence) -> Judgement | None:
    """A composite op that divides inside (weight_norm by ||v||, a class-weighted nll_loss by the
    targets' total weight) with a denominator of 0: the tracer's ``denominator`` says which."""
    denom = o.get("denominator") or {}
    if not denom.get("zeros") or o.category != "op":
        return None
    why = f"{o.op} in {_where(o)} divides by {denom.get('what', 'a denominator')}, which is 0"
    if "size" in denom:
        why = why.removesuffix("which is 0") + f"which is 0 for {denom['zeros']} of {denom['size']}"
    if o.get("composite") == "weight_norm":
        fixes = [
            "do not zero-initialize a weight under weight_norm: w = g * v / ||v|| is 0/0; initialize v "
            "randomly and set g to 0 instead (or apply weight_norm after a non-zero init)",
            "use torch.nn.utils.parametrizations.weight_norm on a non-zero weight, or drop weight_norm on that layer",
        ]
    else:
        weights = o.get("class_weights") or {}
        why += f": every class weight is 0 ({weights.get('classes')} classes)" if weights.get("sum") == 0 else ""
        fixes = [
            "give the classes non-zero weights (weight= of the loss), or use reduction='sum' divided by "
            "max(total weight, eps)",
            "check how the class weights were computed: a frequency of 0, or a weight tensor zeroed on its way "
            "to the device",
        ]
    return Judgement("op.division_by_zero", why, fixes)


def _root_of_zero(ev: Evidence, o: OriginEvidence) -> Judgement | None:
    """rsqrt of an exact zero is 1/sqrt(0): a division by zero, not the root of a negative value."""
    op = _short(o.op)
    x = _first_input(o)
    if op not in ("rsqrt", "rsqrt_") or ev.kind != "inf" or x.get("negative") or not x.get("zeros"):
        return None
    why = f"{o.op} in {_where(o)} got {x.get('zeros')} exact zeros: rsqrt(0) = 1/sqrt(0) divides by zero"
    if o.get("statistic"):
        why += f" (a {o.get('statistic')} of 0)"
    fixes = [
        "add an eps inside the root: torch.rsqrt(x + eps), with eps >= 1e-6 (the dtype's floor)",
        "a zero row (padding, a zero embedding) has a zero mean of squares: the eps must cover it",
    ]
    return Judgement("op.division_by_zero", why, fixes)


def _too_few(o: OriginEvidence, count: int, correction: float) -> Judgement:
    """A mean, std/var or mean-reduced loss over too few elements divides by n - correction <= 0."""
    op = _short(o.op)
    why = f"{o.op} in {_where(o)} reduced {count} element(s) with correction {correction:g}: "
    why += f"it divides by n - correction = {count - correction:g}"
    if o.source:
        why += f" at {o.source}"
    fixes = (
        [
            "guard the normalization: adv.std() is NaN for one sample (correction=1); use "
            "(adv - adv.mean()) / (adv.std(correction=0) + 1e-8) or skip minibatches of size 1",
            "make minibatches at least 2 samples (drop_last=True, or fold the remainder into the previous batch)",
        ]
        if op.startswith(("std", "var"))
        else [
            "a mean over an empty selection is 0/0: use x.sum() / max(n, 1), or skip the term when n == 0",
            "check why the selection (a mask, x[idx]) is empty for this batch",
        ]
    )
    return Judgement("op.division_by_zero", why, fixes)


@_rule
def trig_domain(ev: Evidence) -> Judgement | None:
    o = _origin(ev)
    op = _short(o.op)
    if op not in ("acos", "asin", "acos_", "asin_") or ev.kind != "nan":
        return None
    x = _first_input(o)
    lo, hi = x.get("min"), x.get("max")
    outside = (isinstance(lo, (int, float)) and lo < -1) or (isinstance(hi, (int, float)) and hi > 1)
    if not outside:
        return None
    why = f"{o.op} in {_where(o)} got inputs in [{lo:.9g}, {hi:.9g}], outside its domain [-1, 1]"
    why += ": a cosine computed as a dot product or (trace - 1) / 2 is rounded past 1"
    fixes = [
        "clamp the argument: torch.acos(x.clamp(-1 + 1e-7, 1 - 1e-7)) (the gradient at exactly +-1 is infinite too)",
        "or use atan2(|a x b|, a . b), which needs no clamp and has a finite gradient",
    ]
    return Judgement("op.trig_domain", why, fixes)


@_rule
def _weight_scale_hint(ev: Evidence) -> Judgement | None:
    """Weights large for their fan-in, given as a secondary cause when another wins."""
    scale = ev.scale
    ratio = scale.get("max_ratio") or 0.0
    if ratio < INIT_RATIO_HIGH or _origin(ev).category != "op" or not _grown(ev) or _grew_in_training(ev):
        return None
    why = f"weights of '{scale.get('module')}' are {ratio:.3g}x the 1/sqrt(fan_in) scale"
    return Judgement("init.scale", why)


# -- explicit writes of NaN/Inf (origin category "write", from the tracer) -------------
@_rule
def mask_fill_in_loss(ev: Evidence) -> Judgement | None:
    o = _origin(ev)
    if o.category != "write" or o.get("written") != "-inf":
        return None
    filled = sum(s.get("neginf", 0) for s in o.outputs or o.inputs or [])
    then = [_short(a.get("op")) for a in ev.after or [] if a.get("op")]
    why = f"{o.op} in {_where(o)} filled {filled} positions with -inf{_written_into(o)}"
    why += f" at {o.source}" if o.source else ""
    why += ", and the -inf reached the results"
    why += f" through {' -> '.join(then[:4])}" if then else ""
    why += ": a loss or sum that includes the masked positions turns -inf into Inf, or 0 * -inf into NaN"
    fixes = [
        "fill with torch.finfo(dtype).min (finite) instead of -inf, or drop the masked positions before the loss",
        "zero the masked terms of a sum: torch.where(mask, p * logp, 0) for an entropy over masked logits",
        "label smoothing averages log-probabilities over every class: apply it only over the unmasked classes",
    ]
    return Judgement("op.mask_fill_in_loss", why, fixes)


def _written_into(o: OriginEvidence) -> str:
    """`` of the output of aten.addmm.default in 'head' (through a view of it)``: where a write through a
    view or an alias (``x.data``, ``x.detach()``) landed, when the tracer saw one."""
    into = o.get("written_into")
    if not isinstance(into, dict) or into.get("through") not in ("view", "alias"):
        return ""
    found = into.get("base")
    base: dict[str, Any] = found if isinstance(found, dict) else {}
    made = f"the output of {base.get('op')}" if base.get("op") else f"a tensor of shape {base.get('shape')}"
    made += f" in '{base.get('module')}'" if base.get("module") else ""
    how = "a view" if into.get("through") == "view" else "an alias (.data / .detach())"
    return f" of {made} (through {how} of it)"


@_rule
def nan_write(ev: Evidence) -> Judgement | None:
    o = _origin(ev)
    if o.category != "write" or o.get("written") not in ("nan", "inf"):
        return None
    why = f"{o.op} in {_where(o)} wrote {o.get('written')} into a tensor explicitly{_written_into(o)}"
    if o.source:
        why += f" at {o.source}"
    fixes = [
        "do not mark missing values with NaN inside the model: keep a boolean mask and write 0 (or a finite fill)",
        "if NaN marks missing values on purpose, reduce with torch.nanmean / torch.nansum and mask before the loss",
    ]
    return Judgement("op.nan_write", why, fixes)


@_rule
def uninitialized_read(ev: Evidence) -> Judgement | None:
    o = _origin(ev)
    if o.category != "blank":
        return None
    why = (
        f"{o.op} in {_where(o)} allocated memory that was read before any op wrote it: it holds whatever the "
        "allocator left there (NaN from a freed tensor on a reused GPU block; other values on another run, so "
        "the NaN comes and goes)"
    )
    if o.source:
        why += f"; allocated at {o.source}"
    fixes = [
        "allocate with zeros (torch.zeros, new_zeros, zeros_like) where not every element is written, or write "
        "every element before it is read (a backward that fills only the rows its forward kept)",
        "to find such reads in any run: torch.use_deterministic_algorithms(True) with "
        "torch.utils.deterministic.fill_uninitialized_memory = True fills new memory with NaN",
    ]
    return Judgement("op.uninitialized_read", why, fixes)


@_rule
def norm_overflow(ev: Evidence) -> Judgement | None:
    """A normalization whose statistics overflowed, with nothing upstream to blame: the origin is
    named without a cause, and never as an eps (``zero_variance`` leaves it alone)."""
    o = _origin(ev)
    if not _normalization(o) or not _statistics_overflowed(o):
        return None
    fixes = [
        "find what makes the activations grow: the per-module absmax of this step, ng.audit_model(model)",
        "if the loss grew in the steps before, lower the learning rate and add gradient clipping",
    ]
    return Judgement("unknown", _overflow_why(o), fixes)


@_rule
def unknown(ev: Evidence) -> Judgement:
    o = _origin(ev)
    why = f"first non-finite value created by {o.op or 'an unknown op'} in {_where(o)}"
    fixes = [
        "inspect the origin op's input statistics in the evidence",
        "run ng.check_batch(batch) and ng.audit_model(model) for upstream causes",
    ]
    return Judgement("unknown", why, fixes)


RULES: list[Callable[[Evidence | Mapping[str, Any]], Judgement | None]] = [
    index_out_of_range,
    no_valid_targets,
    nonfinite_data,
    nonfinite_parameters,
    init_scale,
    grown_weights,
    divergence,
    precision_overflow,
    masked_softmax,
    zero_variance,
    log_domain,
    sqrt_domain,
    exp_overflow,
    division_by_zero,
    trig_domain,
    # explicit writes
    mask_fill_in_loss,
    nan_write,
    uninitialized_read,
    norm_overflow,
]
# The op-level rules a growth of the weights defers to (``_op_explains``).
_OP_RULES = RULES[RULES.index(precision_overflow) : RULES.index(trig_domain) + 1]
# Rules that never name the cause, only add a secondary one to ``also``.
HINTS: list[Callable[[Evidence | Mapping[str, Any]], Judgement | None]] = [
    _weight_scale_hint,
    _normalization_hint,
    _empty_sample_hint,
    _uninitialized_hint,
]


def diagnose(evidence: Evidence | Mapping[str, Any]) -> Judgement:
    """Apply ``RULES`` in order; the first that fits names the cause. ``evidence`` is the record
    or its written form (``diag.evidence``); it is read into the record once.

    Example:
        >>> diagnose({"origin": {"category": "op", "op": "aten.log.default",
        ...                      "inputs": [{"zeros": 3}]}}).cause
        'op.log_domain'
    """
    record = Evidence.of(evidence)
    judged = [(rule, rule(record)) for rule in [*RULES, *HINTS]]
    fitting = [v for _, v in judged if v is not None]
    judgement = fitting[0] if fitting else unknown(record)
    if "history" in record.given or "initial_weight_scale" in record.given:
        own = _op_cause(record, judged)
        judgement.op_cause = own if own != judgement.cause else None
    seen = {judgement.cause}
    for other in fitting[1:]:
        if other.cause not in seen:
            seen.add(other.cause)
            judgement.also.append({"cause": other.cause, "why": other.why})
    return judgement


# The rules that read the run's facts; the others answer the same with or without them.
_READ_RUN_FACTS = (init_scale, grown_weights, divergence, _weight_scale_hint)


def _op_cause(record: Evidence, judged: list[tuple[Callable[..., Judgement | None], Judgement | None]]) -> str:
    """The cause without the run's facts: only the rules that read them are asked again."""
    own = replace(
        record,
        history=None,
        initial_weight_scale=None,
        given=tuple(k for k in record.given if k not in ("history", "initial_weight_scale")),
    )
    for rule, judgement in judged:
        judgement = rule(own) if rule in _READ_RUN_FACTS else judgement
        if judgement is not None:
            return judgement.cause
    return "unknown"


# -- diagnoses the guard builds from its own state -------------------------------------
def nonfinite_update(
    *,
    step: int,
    optimizer: str,
    hyperparameters: Mapping[str, Any],
    bad_parameters: list[str],
    rank: int | None,
    ranks: list[int],
    dtype: str | None = None,
) -> Diagnosis:
    """Finite gradients, yet the optimizer's update left ``bad_parameters`` (of ``dtype``) non-finite.

    Example:
        >>> nonfinite_update(step=3, optimizer="Adam", hyperparameters={"eps": 0.0}, bad_parameters=["fc.weight"],
        ...                  rank=None, ranks=[]).module
        'fc'
    """
    first = bad_parameters[0] if bad_parameters else None
    return Diagnosis(
        cause="optimizer.nonfinite_update",
        kind="nan",
        phase="optimizer",
        op=f"{optimizer}.step",
        module=first.rpartition(".")[0] if first else None,
        rank=rank,
        ranks=ranks,
        step=step,
        evidence={
            "parameters": bad_parameters[:16],
            "nonfinite_parameters": len(bad_parameters),
            "optimizer": optimizer,
            "hyperparameters": dict(hyperparameters),
            **({"dtype": dtype} if dtype else {}),
            "why": f"gradients were finite, but after {optimizer}.step "
            f"{len(bad_parameters)} parameter tensor(s) hold NaN/Inf, first {first}",
        },
        fixes=_update_fixes(hyperparameters, dtype),
    )


def _update_fixes(hp: Mapping[str, Any], dtype: str | None = None) -> list[str]:
    fixes = []
    eps = hp.get("eps")
    if isinstance(eps, (int, float)) and eps <= 1e-12:
        fixes.append(
            f"optimizer eps is {eps}; use 1e-8 (1e-6 or more with bf16/fp16 states): "
            "a zero second moment divides 0 by 0"
        )
    elif isinstance(eps, (int, float)) and eps > 0 and (lost := _rounds_to_zero(eps, dtype)):
        fixes.append(
            f"optimizer eps={eps:g} is 0 in {dtype} (its smallest value is {lost:.3g}), the dtype of the "
            "parameters and so of the optimizer's state: a zero second moment divides 0 by 0; keep float32 "
            "master weights (autocast, or a mixed-precision optimizer) or use eps >= 1e-4"
        )
    fixes += [
        "check the optimizer state for NaN/Inf (a resumed state from another run or dtype)",
        f"lower the learning rate (now {hp.get('lr')})" if "lr" in hp else "lower the learning rate",
    ]
    return fixes


def _rounds_to_zero(value: float, dtype: str | None) -> float:
    """The smallest positive ``dtype`` value when ``value`` rounds to 0 in that dtype, else 0."""
    torch_dtype = getattr(torch, dtype, None) if dtype else None
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        return 0.0
    if torch.tensor(value, dtype=torch_dtype).item() != 0:
        return 0.0
    return float(torch.finfo(torch_dtype).smallest_normal * torch.finfo(torch_dtype).eps)


def runaway_growth(
    *,
    step: int,
    history: Mapping[str, Any],
    lr: Any,
    rank: int | None,
    ranks: list[int],
    weights: Mapping[str, Any] | None = None,
) -> Diagnosis:
    """A finite step whose gradients (or loss) grew so fast that the run is diverging, caught
    before its clip and update (``History.runaway``'s ``history``): nothing is non-finite yet,
    but a float32 clip would compute an Inf norm (``float32_overflow``), or will soon.

    Example:
        >>> runaway_growth(step=3, history={"metric": "grad_norm", "growth": 4e18, "float32_overflow": True,
        ...                "grad_norm": 7e19, "window": 3}, lr=1e3, rank=None, ranks=[]).cause
        'optimizer.divergence'
    """
    overflow = bool(history.get("float32_overflow"))
    metric, growth = history.get("metric", "grad_norm"), history.get("growth", 0.0)
    norm = history.get("grad_norm", 0.0)
    why = (
        f"the gradients are finite, but their norm {norm:.3g} "
        if math.isfinite(norm)
        else "the gradients are finite on every rank, but their norm over the ranks "
    )
    why = (
        why + "is past float32's range once squared: a float32 clip_grad_norm_ computes an Inf norm"
        if overflow
        else f"{metric} grew {growth:.3g}x over the last {history.get('window', 0)} step(s)"
    )
    if overflow and growth:
        at_least = "" if math.isfinite(norm) else "over "
        why += f"; it grew {at_least}{growth:.3g}x over the last {history.get('window', 0)} step(s)"
    weights = dict(weights or {})
    why += _weights_why(weights, lr)
    negative = weights.get("lr_negative_since")
    grew = negative is not None or weights.get("growth", 0.0) >= GROWN_WEIGHTS
    return Diagnosis(
        cause="optimizer.divergence",
        kind="inf" if overflow else "invalid",  # nothing non-finite exists yet
        phase="backward",  # the gradients it made; no update ran
        rank=rank,
        ranks=ranks,
        step=step,
        evidence={
            "history": {**history, "lr": lr, **({"weights": weights} if weights else {})},
            "loss": history.get("loss"),
            "grad_norm": history.get("grad_norm"),
            "why": why + ", caught before the clip and the update",
        },
        fixes=_growth_fixes(lr, negative) if grew else _divergence_fixes({"lr": lr}),
    )


def _weights_why(weights: Mapping[str, Any], lr: Any) -> str:
    """``; the weights grew 1e+06x since the run's start (...), x1.2 a step since step 40; the learning rate
    is negative since step 100``: the weight log's part of a divergence's why (empty without one)."""
    why = ""
    if weights.get("growth", 0.0) >= GROWN_WEIGHTS:
        why += (
            f"; the weights grew {weights['growth']:.3g}x since the run's start ('{weights.get('parameter')}'), "
            f"about x{weights.get('per_step', 1):.3g} a step since step {weights.get('since')}"
        )
    if weights.get("lr_negative_since") is not None:
        shown = f" ({lr:.3g})" if isinstance(lr, (int, float)) and not isinstance(lr, bool) else ""
        why += f"; the learning rate is negative{shown} since step {weights['lr_negative_since']}"
        why += ": each update climbs the loss, not descends"
    return why


def transient_fault(
    *,
    step: int,
    loss: float,
    grad_norm: float,
    flagged_ranks: list[int],
    located: bool,
    distributed: bool,
    attempted: bool = False,
    unobserved: Sequence[str] = (),
) -> Diagnosis:
    """A step went non-finite but no rank's replay reproduces it (or no replay finished: ``located``
    False; ``attempted`` says whether one was started, so the text says why there is none).

    The hardware is suspected only when the replay was faithful: ``unobserved`` lists what it
    could not observe of the step (its backward, a part of the model). Then the cause is
    ``unknown``, the evidence says what was not seen, and no advice points at the hardware
    (the run's history may still make it a divergence: ``with_run_facts``).

    ``distributed.transient`` needs torch.distributed; a single process whose replay is finite
    gets ``step.not_reproduced``, which claims no distribution; without a replay it is ``unknown``.

    Example:
        >>> transient_fault(step=4, loss=float("nan"), grad_norm=1.0, flagged_ranks=[0], located=True,
        ...                 distributed=False).cause
        'step.not_reproduced'
    """
    if located and unobserved:
        return _unobserved(step, loss, grad_norm, flagged_ranks, list(unobserved), distributed)
    if located:
        why = "the step went non-finite, but replaying it from the same RNG state and parameters"
        why += " on every rank gives finite values" if distributed else " gives finite values"
        cause = "distributed.transient" if distributed else "step.not_reproduced"
    elif attempted:
        why, cause = "the step went non-finite, and its replay failed (see nanguard's warning)", "unknown"
    else:
        why, cause = "the step went non-finite (locate is off, so no replay was run)", "unknown"
    fixes = [
        "a fault that does not reproduce points at hardware (a flaky GPU, memory errors), "
        + ("the communication layer, " if distributed else "")
        + "or nondeterministic kernels",
    ]
    if distributed:
        fixes.append(
            "if it repeats on the same rank or node, drain that node; run NCCL with "
            "TORCH_NCCL_NAN_CHECK=1 to catch a bad collective"
        )
    else:
        fixes.append(
            "a value at the edge of its range (a borderline overflow) can round either way: "
            "if it repeats, lower the learning rate or run ng.locate on the saved bundle"
        )
    # No rank reproduces it: ``ranks`` (where it originated) lists none; ``rank`` is where it was seen
    # first, every rank reporting the same, and the flagged ranks stay in the evidence.
    return Diagnosis(
        cause=cause,
        kind="nan" if math.isnan(loss) or math.isnan(grad_norm) else "inf",
        phase="communication" if distributed else "backward",
        rank=flagged_ranks[0] if flagged_ranks and distributed else None,
        ranks=[],
        step=step,
        evidence={"loss": loss, "grad_norm": grad_norm, "flagged_ranks": flagged_ranks, "why": why},
        fixes=fixes,
    )


def faulty_device(*, step: int, origin: Diagnosis, proof: Mapping[str, Any]) -> Diagnosis:
    """The suspect rank's device computes the step non-finite (or different) where a peer replica,
    re-computing the same step (the suspect's batch and RNG state, the same parameters), does not:
    ``proof`` is the evidence of both computations (``guard/proof.py``); ``origin`` the ordinary
    diagnosis, whose op and module say where the bad value appeared on that device.

    Example:
        >>> faulty_device(step=7, origin=diag, proof={"suspect": 2, "peer": 0, ...}).cause
        'hardware.faulty_device'
    """
    from nanguard.text import device_words

    suspect, peer = int(proof["suspect"]), int(proof["peer"])
    here, there = proof.get("suspect_where") or {}, proof.get("peer_where") or {}
    named = device_words(here) if here else f"rank {suspect}'s device"
    why = (
        f"rank {suspect} computes step {step} {proof.get('suspect_result', 'non-finite')} on {named}; "
        f"rank {peer} re-computed the same step (rank {suspect}'s batch and RNG state, the same parameters) "
        f"{proof.get('peer_result', 'finite')}" + (f" on {device_words(there)}" if there else "")
    )
    fixes = [
        f"drain {named} and run its diagnostics (ECC error counters, DCGM diagnostics), then resume without it",
        "the step itself is sound (a peer computes it finite): no change to the model, data or hyperparameters",
    ]
    kind = origin.kind if origin.kind in ("nan", "inf") else "nan"
    phase = origin.phase if origin.phase in ("forward", "backward") else "backward"
    evidence = {**origin.evidence, "origin_cause": origin.cause, "proof": dict(proof), "why": why}
    return Diagnosis(
        cause="hardware.faulty_device",
        kind=kind,
        phase=phase,
        op=origin.op,
        module=origin.module,
        rank=suspect,
        ranks=[suspect],
        step=step,
        evidence=evidence,
        fixes=fixes,
    )


def _unobserved(
    step: int, loss: float, grad_norm: float, flagged: list[int], unobserved: list[str], distributed: bool
) -> Diagnosis:
    """A finite replay that could not observe everything the step did: it proves nothing."""
    seen = "; ".join(unobserved)
    return Diagnosis(
        cause="unknown",
        kind="nan" if math.isnan(loss) or math.isnan(grad_norm) else "inf",
        phase="backward",
        rank=flagged[0] if flagged and distributed else None,
        ranks=list(flagged) if distributed else [],
        step=step,
        evidence={
            "loss": loss,
            "grad_norm": grad_norm,
            "flagged_ranks": flagged,
            "unobserved": unobserved,
            "why": f"the step went non-finite; its replay is finite but could not observe {seen}, "
            "so nothing points at the hardware",
        },
        fixes=[
            f"let the replay see the whole step ({seen}): compute the loss in the model, or "
            "decorate the loss function with guard.micro_step (torchtitan: TitanGuard.loss)",
            "check the loss and gradient-norm curves before this step (nanguard report RUN_DIR)",
        ],
    )


def nonfinite_shards(*, step: int, parameters: list[str], nan: int, inf: int, rank: int) -> Diagnosis:
    """This rank's own shards of ``parameters`` (FSDP2) hold ``nan`` NaN and ``inf`` Inf values:
    every rank sees them after the all-gather, but they live here.

    Example:
        >>> nonfinite_shards(step=3, parameters=["blocks.1.mlp.fc.weight"], nan=1, inf=0, rank=2).module
        'blocks.1.mlp.fc'
    """
    first = parameters[0]
    module = first.rpartition(".")[0]
    origin = {"category": "parameters", "path": first, "module": module, "inputs": [{"nan": nan, "posinf": inf}]}
    judgement = nonfinite_parameters({"origin": origin})
    assert judgement is not None
    return Diagnosis(
        cause=judgement.cause,
        kind="nan" if nan else "inf",
        phase="parameters",
        module=module,
        rank=rank,
        ranks=[rank],
        step=step,
        evidence={
            "origin": origin,
            "parameters": parameters[:16],
            "sharded": True,
            "why": f"rank {rank}'s own shard of " + judgement.why,
        },
        fixes=judgement.fixes,
    )


def loaded_nonfinite(*, step: int, found: list[dict[str, Any]], rank: int | None, ranks: list[int]) -> Diagnosis:
    """Parameters non-finite before any update of the guard: as the model was built or a state dict
    (a checkpoint) loaded it. ``found`` holds per parameter, in ``named_parameters`` order, its
    ``name``, ``module`` (None for one only the optimizer holds), ``nan`` and ``inf`` counts and
    the ``rows`` (dim 0) that hold them.

    Example:
        >>> loaded_nonfinite(step=0, found=[{"name": "wte.weight", "module": "wte", "nan": 64, "inf": 0,
        ...                                  "rows": [7]}], rank=None, ranks=[]).module
        'wte'
    """
    first = found[0] if found else {}
    name, module, rows = first.get("name", "a parameter"), first.get("module"), first.get("rows", [])
    nan, inf = first.get("nan", 0), first.get("inf", 0)
    origin = {"category": "parameters", "path": name, "module": module, "inputs": [{"nan": nan, "posinf": inf}]}
    judgement = nonfinite_parameters({"origin": origin})
    assert judgement is not None
    where = f" (rows {rows} of {name})" if rows else ""
    if rows and first.get("token_ids"):
        where = f" (rows {rows} of {name}: the embeddings of token ids {rows})"
    return Diagnosis(
        cause=judgement.cause,
        kind="nan" if nan else "inf",
        phase="parameters",
        module=module,
        rank=rank,
        ranks=ranks,
        step=step,
        evidence={
            "origin": origin,
            "parameters": [f["name"] for f in found][:16],
            "rows": rows,
            **({"token_ids": first["token_ids"]} if first.get("token_ids") else {}),
            "loaded": True,
            "why": judgement.why.replace("before the step", f"before step {step}, as built or loaded{where}"),
        },
        fixes=judgement.fixes,
    )


def communication_overflow(
    *, step: int, hook: str, wire_dtype: str, parameters: list[str], absmax: float, rank: int
) -> Diagnosis:
    """A DDP compression hook cast finite local gradients of ``parameters`` (up to ``absmax``)
    to ``wire_dtype``, where they overflowed: Inf made by the communication, on every step
    that reaches such values, never by the compute.

    Example:
        >>> communication_overflow(step=4, hook="fp16_compress_hook", wire_dtype="float16",
        ...                        parameters=["fc.weight"], absmax=1e5, rank=1).phase
        'communication'
    """
    first = parameters[0] if parameters else None
    wire_max = torch.finfo(getattr(torch, wire_dtype)).max
    return Diagnosis(
        cause="precision.overflow",
        kind="inf",
        phase="communication",
        op=hook,
        module=first.rpartition(".")[0] if first else None,
        rank=rank,
        ranks=[rank],
        step=step,
        evidence={
            "parameters": parameters[:16],
            "wire_dtype": wire_dtype,
            "absmax": absmax,
            "dtype_max": wire_max,
            "why": f"rank {rank}'s gradients were finite (absmax {absmax:.3g}), but {hook} sends them in "
            f"{wire_dtype} (max {wire_max:.3g}): the cast made Inf in the bucket of {first}",
        },
        fixes=[
            "use bf16_compress_hook (float32's exponent range) or no compression hook",
            "average the loss instead of summing it (or lower the loss multiplier), so local gradients "
            "stay far below the wire dtype's max",
            f"find why {first} gets gradients above {wire_max:.3g}: ng.audit_model(model) and the step's grad norms",
        ],
    )


def loss_scale_collapse(
    *, step: int, scale: float, floor: float, streak: int, overflows: int, rank: int | None
) -> Diagnosis:
    """The GradScaler's scale fell below ``floor``, or overflow lasted ``streak`` steps in a row."""
    return Diagnosis(
        cause="precision.loss_scale",
        kind="inf",
        phase="backward",
        rank=rank,
        step=step,
        evidence={
            "scale": scale,
            "floor": floor,
            "overflow_streak": streak,
            "overflows": overflows,
            "why": f"the GradScaler scale fell to {scale:.3g} after {streak} overflowing steps in a row "
            f"(floor {floor:g}): gradients overflow float16 at any scale",
        },
        fixes=[
            "switch float16 autocast to bfloat16, which needs no loss scaling",
            "find the overflowing op: ng.locate(closure, model=model) on this step",
            "lower the learning rate or clip gradients: overflow usually follows growth",
        ],
    )


def replica_divergence(
    *,
    step: int,
    ranks: list[int],
    first_parameter: str | None,
    source: int | None = 0,
    nonfinite_ranks: list[int] | None = None,
) -> Diagnosis:
    """After ``step`` the parameters of ``ranks`` are non-finite (``nonfinite_ranks``) or differ
    from those of rank ``source`` (the majority among finite ranks; None when no rank is finite),
    first at ``first_parameter``.

    Example:
        >>> replica_divergence(step=9, ranks=[0], first_parameter="fc.weight", source=1, nonfinite_ranks=[0]).rank
        0
    """
    first = first_parameter
    bad = list(nonfinite_ranks or [])
    why = f"after step {step} the parameters of rank(s) {ranks} "
    why += f"hold NaN/Inf (rank(s) {bad}) or " if bad else ""
    why += f"differ from rank {source}'s" if source is not None else "are non-finite on every rank"
    resync = (
        f"the guard re-broadcasts rank {source}'s parameters and buffers (the majority among finite ranks); "
        "optimizer state may still differ"
        if source is not None
        else "no rank holds finite parameters: the guard rolls back to its snapshot, or raises without one"
    )
    return Diagnosis(
        cause="distributed.replica_divergence",
        kind="nan" if bad else "invalid",  # finite replicas that differ hold nothing non-finite
        phase="parameters",
        module=first.rpartition(".")[0] if first else None,
        rank=ranks[0] if ranks else None,
        ranks=ranks,
        step=step,
        evidence={
            "first_parameter": first,
            "ranks_differing": ranks,
            "nonfinite_ranks": bad,
            "source_rank": source,
            "why": why + f", first at {first}",
        },
        fixes=[
            "a rank stepped while another skipped, or a parameter was changed on one rank only "
            "(a custom init, loading a checkpoint on rank 0 without a broadcast)",
            "parameters that DDP does not all-reduce (requires_grad=False, or unused with "
            "find_unused_parameters=False) drift when changed in place",
            resync,
        ],
    )


def rejected_batch(errors: list[Finding], *, step: int, rank: int | None, ranks: list[int]) -> Diagnosis:
    """``check_batch`` found ``errors`` (non-empty, error severity) before the forward: the first names the cause."""
    first = errors[0]
    return Diagnosis(
        cause=first.cause,
        kind="nan" if first.cause == "data.nonfinite" else "invalid",  # the forward never ran
        phase="data",
        module=None,
        rank=rank,
        ranks=ranks,
        step=step,
        evidence={
            "findings": [f.to_dict() for f in errors],
            "where": first.where,
            "why": f"check_batch before the forward: {first.message}",
        },
        fixes=[first.fix] if first.fix else list(row_of(first.cause).fixes),
    )


def with_run_facts(diag: Diagnosis, run: RunFacts) -> Diagnosis:
    """``diag`` judged with what only the guard knows (``RunFacts``: the run's history, the weight
    scale it started from), for a diagnosis the guard built from its own state. A traced one is
    judged once already (``trace(..., run=...)`` hands the facts to its one ``diagnose``) and is
    returned as it is. Returns a new Diagnosis; ``diag`` is left as it was.

    A located diagnosis (one with an ``origin``) goes through ``RULES`` with the facts, and a cause
    that changes keeps the op-level one as ``evidence["op_cause"]``. A diagnosis without an
    origin (a non-finite update, a step whose replay is finite or did not run) becomes
    divergence when the history shows it: growth wins over non-reproduction, since a
    borderline value may round either way on replay. A non-finite update keeps its own
    ``why``, since it says what the update did.

    Example:
        >>> grew = RunFacts(history={"diverging": True, "metric": "loss", "growth": 40.0, "window": 5})
        >>> with_run_facts(diag, grew).cause
        'optimizer.divergence'
    """
    history = run.history
    evidence = dict(diag.evidence)
    located = "origin" in evidence
    if located and RunFacts.judged(evidence):
        return diag
    if located:
        evidence["initial_weight_scale"] = run.initial_weight_scale
    elif not row_of(diag.cause).history_overrules or not history.get("diverging"):
        return diag
    if history:
        evidence["history"] = history
    judgement = diagnose(evidence)
    if judgement.cause == diag.cause:
        return replace(diag, evidence=evidence, also=judgement.also if located else diag.also)
    evidence["op_cause"] = diag.cause
    also = judgement.also if located else [{"cause": diag.cause, "why": str(diag.evidence.get("why", ""))}]
    if located or diag.cause != "optimizer.nonfinite_update":
        evidence["why"] = judgement.why
    return replace(diag, cause=judgement.cause, fixes=judgement.fixes, evidence=evidence, also=also)
