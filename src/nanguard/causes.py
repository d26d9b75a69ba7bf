"""The cause table: one record per cause id, every fact the other parts read about a cause.

``findings.CAUSES`` (the public id -> meaning map), the order of ``diagnose.RULES``, the guard's
policy (what a skip can repair, what repeats, what a remedy costs) and the cause table of docs/causes.md
are all read from, or checked against, ``TABLE`` (``tests/test_causes.py``). Adding a cause is one
row here, one rule in ``diagnose.py`` and one test (docs/causes.md, "Adding a cause").

Imports nothing from nanguard: every other module may read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["REMEDIES", "STAGES", "TABLE", "Cause", "row_of"]

STAGES = ("data", "parameters", "init", "divergence", "op", "fallback")
"""How far upstream a cause sits; ``diagnose.RULES`` tries the earlier stages first."""
REMEDIES = ("quarantine", "upcast", "rollback_lower_lr", "rollback", "reset_scale", "resync", "skip")
"""What ``policy="auto"`` does for a cause (``nanguard.guard.policy``)."""


@dataclass(frozen=True, kw_only=True)
class Cause:
    """Everything nanguard knows about one cause id, apart from the rule that finds it.

    Example:
        >>> row_of("parameters.nonfinite").skippable
        False
    """

    id: str
    meaning: str
    """One line, the public ``ng.CAUSES[id]`` and the table of docs/causes.md."""
    stage: str
    """One of ``STAGES``: when several rules fit, the more upstream stage wins."""
    phase: str | None
    """The phase every diagnosis of this cause has; None when it is the origin's phase."""
    skippable: bool
    """Does skipping the step leave the run sound? False when the parameters already hold the damage."""
    repeatable: bool
    """Does it come from the model or its precision, not the batch, so the next step repeats it?"""
    remedy: str
    """What ``policy="auto"`` does (one of ``REMEDIES``)."""
    budgeted: bool
    """Does the remedy change the run (upcast, rollback, LR), so it counts against ``remedy_budget``?"""
    history_overrules: bool
    """A diagnosis without a located origin that the run's growth history turns into divergence."""
    computed_from_inputs: bool
    """Does its origin op compute the non-finite value from the inputs it got, on any device (a log of a
    negative)? Then a peer that computes the same batch finite proves the inputs differ on the suspect
    rank (``guard/proof.py``: a rank-local verdict), not a faulty device."""
    fixes: tuple[str, ...]
    """What to try, most likely first, when the rule that found it has nothing more specific."""

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {self.stage!r} ({self.id})")
        if self.remedy not in REMEDIES:
            raise ValueError(f"remedy must be one of {REMEDIES}, got {self.remedy!r} ({self.id})")
        if not self.meaning or not self.fixes:
            raise ValueError(f"cause {self.id!r} needs a meaning and at least one fix")


def _cause(
    id: str,
    meaning: str,
    stage: str,
    *,
    phase: str | None = None,
    skippable: bool = True,
    repeatable: bool = False,
    remedy: str = "skip",
    budgeted: bool = False,
    history_overrules: bool = False,
    computed_from_inputs: bool = False,
    fixes: tuple[str, ...],
) -> Cause:
    return Cause(
        id=id,
        meaning=meaning,
        stage=stage,
        phase=phase,
        skippable=skippable,
        repeatable=repeatable,
        remedy=remedy,
        budgeted=budgeted,
        history_overrules=history_overrules,
        computed_from_inputs=computed_from_inputs,
        fixes=fixes,
    )


_ROWS = [
    _cause(
        "data.nonfinite",
        "a floating-point input already holds NaN/Inf",
        "data",
        phase="data",
        remedy="quarantine",
        fixes=("find where the batch gets NaN/Inf: ng.check_batch(batch) in the data loader",),
    ),
    _cause(
        "data.index_out_of_range",
        "an integer input (token id, label, index) is outside its valid range",
        "data",
        phase="data",
        remedy="quarantine",
        fixes=("make the ids fit the embedding or class count: ng.check_batch(batch, model=model)",),
    ),
    _cause(
        "data.fully_masked",
        "a sample's attention mask masks every position",
        "data",
        phase="data",
        remedy="quarantine",
        fixes=("drop or re-pack samples whose mask is all zeros",),
    ),
    _cause(
        "data.no_valid_targets",
        "every target is ignored (e.g. all labels == -100), so a mean loss is 0/0",
        "data",
        phase="data",
        remedy="quarantine",
        fixes=("skip batches with no valid target, or divide a summed loss by max(valid targets, 1)",),
    ),
    _cause(
        "data.invalid_mask",
        "an attention or loss mask holds values other than 0/1 (or True/False)",
        "data",
        phase="data",
        remedy="quarantine",
        fixes=("build masks as 0/1 (bool) tensors of the expected dtype",),
    ),
    _cause(
        "parameters.nonfinite",
        "parameters or buffers are non-finite before the step",
        "parameters",
        phase="parameters",
        skippable=False,
        repeatable=True,
        remedy="rollback",
        budgeted=True,
        fixes=("roll back to the last finite checkpoint; find the update that wrote the NaN",),
    ),
    _cause(
        "op.log_domain",
        "log of zero or a negative value (e.g. a loss on probabilities)",
        "op",
        computed_from_inputs=True,
        fixes=("clamp the argument of log (x.clamp_min(eps)) or use log_softmax / a *_with_logits loss",),
    ),
    _cause(
        "op.sqrt_domain",
        "sqrt/rsqrt/pow of a negative value, or the gradient of sqrt at zero",
        "op",
        computed_from_inputs=True,
        fixes=("add eps inside the sqrt (torch.sqrt(x + eps)) or clamp the argument at 0",),
    ),
    _cause(
        "op.division_by_zero",
        "division by zero in model or loss code",
        "op",
        computed_from_inputs=True,
        fixes=("add eps to the denominator or clamp it away from zero",),
    ),
    _cause(
        "op.exp_overflow",
        "exp (or softmax written without max subtraction) overflowing in float32",
        "op",
        computed_from_inputs=True,
        fixes=("subtract the max before exp (torch.softmax / logsumexp do) or clamp the argument",),
    ),
    _cause(
        "op.masked_softmax",
        "softmax over a row that is entirely -inf (a fully masked row)",
        "op",
        computed_from_inputs=True,
        fixes=("give every row at least one unmasked position, or fill masked rows with a finite value",),
    ),
    _cause(
        "norm.zero_variance",
        "a normalization layer divided by (near) zero variance: eps missing or too small",
        "op",
        computed_from_inputs=True,
        fixes=("give the normalization an eps that suits the dtype (1e-5 or more under float16)",),
    ),
    _cause(
        "precision.overflow",
        "a float16/bfloat16 op overflowed where float32 stays finite",
        "op",
        repeatable=True,
        remedy="upcast",
        budgeted=True,
        computed_from_inputs=True,
        fixes=("run the overflowing module in float32, or switch float16 autocast to bfloat16",),
    ),
    _cause(
        "precision.loss_scale",
        "the loss scaler collapsed or gradients overflow persistently",
        "op",
        phase="backward",
        remedy="reset_scale",
        fixes=("switch float16 autocast to bfloat16, which needs no loss scaling",),
    ),
    _cause(
        "optimizer.divergence",
        "gradient norm or loss grew rapidly in the steps before: LR too high, no warmup or clipping",
        "divergence",
        remedy="rollback_lower_lr",
        budgeted=True,
        computed_from_inputs=True,
        fixes=("lower the learning rate, add warmup, or clip gradients (clip_grad_norm=1.0)",),
    ),
    _cause(
        "optimizer.nonfinite_update",
        "the optimizer turned finite gradients into non-finite parameters (eps, state, lr)",
        "parameters",
        phase="optimizer",
        skippable=False,
        remedy="rollback",
        budgeted=True,
        history_overrules=True,
        computed_from_inputs=True,
        fixes=("check the optimizer's eps and lr, and its state for NaN/Inf",),
    ),
    _cause(
        "init.scale",
        "parameters initialized at a scale far too large, blowing up activations early",
        "init",
        repeatable=True,
        computed_from_inputs=True,
        fixes=("initialize weights near 1/sqrt(fan_in): ng.audit_model(model) names them",),
    ),
    _cause(
        "distributed.replica_divergence",
        "model replicas hold different parameters across ranks",
        "parameters",
        phase="parameters",
        remedy="resync",
        fixes=("broadcast parameters from rank 0 after any rank-local change (init, checkpoint load)",),
    ),
    _cause(
        "distributed.transient",
        "the step does not reproduce on replay: hardware, communication or nondeterminism",
        "fallback",
        phase="communication",
        history_overrules=True,
        fixes=("check the rank's hardware (ECC errors, NCCL logs) if it happens again on the same rank",),
    ),
    _cause(
        "unknown",
        "none of the above fits: the evidence is still reported",
        "fallback",
        history_overrules=True,
        fixes=("inspect the origin op's input statistics in the evidence",),
    ),
    _cause(
        "op.mask_fill_in_loss",
        "a -inf mask fill inside the model reaches the loss or a sum over the masked positions "
        "(label smoothing, an entropy over masked logits)",
        "op",
        computed_from_inputs=True,
        fixes=("fill masked positions with the dtype's min (finite) instead of -inf",),
    ),
    _cause(
        "op.nan_write",
        "code wrote NaN/Inf into a tensor explicitly (index_put_/fill_/copy_), e.g. a missing-value marker",
        "op",
        fixes=("mark missing values with a mask instead of NaN, or reduce with torch.nanmean / nansum",),
    ),
    _cause(
        "op.trig_domain",
        "acos/asin of a value outside [-1, 1] (a cosine rounded past 1)",
        "op",
        computed_from_inputs=True,
        fixes=("clamp the argument to [-1 + eps, 1 - eps] before acos/asin",),
    ),
    _cause(
        "compile.numerics",
        "the compiled step is non-finite where the same step run eagerly is finite: the compiler's numerics",
        "fallback",
        computed_from_inputs=True,
        fixes=("compile with backend='aot_eager' (no inductor code generation): does the run stay finite?",),
    ),
    _cause(
        "step.not_reproduced",
        "the step went non-finite but its replay is finite: nondeterminism, hardware, or a borderline value",
        "fallback",
        history_overrules=True,
        fixes=("rerun the saved bundle with nanguard replay; set deterministic algorithms to compare",),
    ),
    _cause(
        "hardware.faulty_device",
        "one device computes the step non-finite (or different) where a peer replica computes the same "
        "step finite: the device is faulty",
        "fallback",
        repeatable=True,
        fixes=("drain the named host and device and run its diagnostics (ECC errors, DCGM), then resume",),
    ),
    _cause(
        "op.uninitialized_read",
        "a value read from memory no op wrote (torch.empty, new_empty, empty_like left partly unwritten): "
        "whatever the allocator left there, NaN on a reused GPU block, so it comes and goes",
        "op",
        fixes=("allocate with zeros (torch.zeros, new_zeros, zeros_like) where not every element is written",),
    ),
]

TABLE: Mapping[str, Cause] = MappingProxyType({c.id: c for c in _ROWS})
"""Every cause id, in the order of ``ng.CAUSES``."""


def row_of(cause: str) -> Cause:
    """The table's record of ``cause``; a ValueError names the accepted ids.

    Example:
        >>> row_of("optimizer.divergence").remedy
        'rollback_lower_lr'
    """
    try:
        return TABLE[cause]
    except KeyError:
        raise ValueError(f"cause must be one of {sorted(TABLE)}, got {cause!r}") from None
