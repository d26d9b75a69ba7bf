"""``GuardConfig``: every setting of a ``Guard``, each declared once, as a field: its type, its
default, its one-line doc and its check (``option``). ``Guard``'s signature (``guard_signature``),
the options' lines in ``help(ng.Guard)`` (``OPTIONS_DOC``) and the validation all follow from it."""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from nanguard.environ import POLICIES

__all__ = ["OPTIONS_DOC", "POLICIES", "SYNC_MODES", "GuardConfig", "option", "with_options"]

QUARANTINE_SCOPES = ("rows", "batch", "previous", "off")
SYNC_MODES = ("auto", "immediate", "deferred")


Check = Callable[[str, Any], None]
"""An option's check: raises ``ValueError`` naming the option and the accepted values."""


def option(default: Any, doc: str, check: Check | None = None) -> Any:
    """One ``Guard`` option, declared once: its default, its one-line doc (``help(ng.Guard)``) and its
    check; the field's type is the signature's annotation (``Guard.__signature__``)."""
    return field(default=default, metadata={"doc": doc, "check": check or _any})


def _any(name: str, value: Any) -> None:
    return None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_at_least(low: int) -> Check:
    def check(name: str, value: Any) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")

    return check


def _positive(name: str, value: Any) -> None:
    if not _number(value) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")


def _positive_or_none(name: str, value: Any) -> None:
    if value is not None and (not _number(value) or not value > 0):
        raise ValueError(f"{name} must be None or a number > 0, got {value!r}")


def _fraction(name: str, value: Any) -> None:
    if not _number(value) or not 0 < value <= 1:
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")


def _one_of(accepted: tuple[str, ...]) -> Check:
    def check(name: str, value: Any) -> None:
        if value not in accepted:
            raise ValueError(f"{name} must be one of {accepted}, got {value!r}")

    return check


def _byte_limit(name: str, value: Any) -> None:
    if not isinstance(value, (bool, int)) or value < 0:
        raise ValueError(f"{name} must be True, False or a byte limit (an int >= 0), got {value!r}")


@dataclass(kw_only=True)
class GuardConfig:
    """Settings of a ``Guard``; every field is validated.

    Example:
        >>> GuardConfig(policy="rollback", snapshot_every=100, rollback_skip_batches=2)
    """

    policy: str = option(
        "skip",
        'what a trip does: "skip" the update, "rollback" to the last snapshot, "raise", or "auto" (the remedy the'
        " diagnosed cause calls for). ``NANGUARD_POLICY`` overrides it.",
        _one_of(POLICIES),
    )
    """What a trip does: "skip" the update, "rollback" to the last snapshot, "raise", or "auto":
    the remedy the diagnosed cause calls for (``nanguard.guard.remedies``)."""
    max_consecutive_skips: int = option(
        10,
        "raise ``NonFiniteError`` after this many skips or rollbacks in a row.",
        _int_at_least(1),
    )
    snapshot_every: int = option(
        50,
        "take a CPU snapshot of model and optimizer every N good steps (rollback and auto).",
        _int_at_least(1),
    )
    snapshots: int = option(3, "how many snapshots to keep, at doubling ages.", _int_at_least(1))
    """How many snapshots to keep, at doubling ages (``snapshot_every``, up to 2x, 4x... apart), so a
    rollback can land before a growth that began before the newest one; fewer when the host's
    available memory would not hold a quarter more (each costs model + optimizer state in CPU memory)."""
    rollback_skip_batches: int = option(
        1,
        "after a rollback, drop the batches of the next K calls to ``step``.",
        _int_at_least(0),
    )
    param_check_every: int = option(
        1,
        "check the parameters for NaN/Inf after every N-th update (0: off).",
        _int_at_least(0),
    )
    spike_window: int = option(
        50,
        "the spike detectors' window: how many recent steps a value is judged against.",
        _int_at_least(1),
    )
    spike_warmup: int = option(10, "how many steps the spike detectors see before they judge.", _int_at_least(1))
    spike_threshold: float = option(
        6.0,
        "the robust z-score (median/MAD) above which a loss or grad norm is a spike.",
        _positive,
    )
    skip_spikes: bool = option(False, "skip the update on a spike, instead of only warning.")
    """Skip the update on a loss or grad-norm spike. The skip acts on the loss averaged over ranks, so under
    DDP on 3 or more ranks, and under FSDP2/TP whose closure clips, it keeps the guard's one small
    all-reduce a step that a healthy step otherwise does without (docs/distributed.md)."""
    divergence_factor: float = option(
        10.0,
        "growth by this factor within ``divergence_window`` steps is divergence.",
        _positive,
    )
    divergence_window: int = option(5, "the steps ``divergence_factor``'s growth is measured over.", _int_at_least(1))
    """A trip after the grad norm or loss grew this factor within this many steps is divergence; a
    finite step whose loss and grad norm both grew this factor, on the second spike in a row of the
    warm detectors, trips as divergence itself, before its clip and update (so does a grad norm past 1.8e19, whose
    float32 square overflows)."""
    loss_scale_floor: float = option(
        2.0**-8,
        "a GradScaler scale below this is a collapse (``precision.loss_scale``).",
        _positive,
    )
    max_overflow_streak: int = option(
        20,
        "GradScaler overflows on this many steps in a row are a collapse too.",
        _int_at_least(1),
    )
    fingerprint_every: int = option(
        100,
        "compare a parameter fingerprint across ranks every N updates (0: off).",
        _int_at_least(0),
    )
    log_every: int = option(
        1,
        "write a step event every N steps (trips and skips are always written).",
        _int_at_least(1),
    )
    locate: bool = option(True, "replay a tripped step under the op tracer to find the origin.")
    prove: bool = option(True, "under DDP, re-compute a suspect rank's step on a peer rank to tell a faulty device.")
    """Under DDP, on a trip one rank's device may have made, re-compute that rank's step on a peer rank
    (its batch and RNG state): reproduced everywhere is a software or data fault, only on that device a
    faulty device (``hardware.faulty_device``), nowhere a transient one (``guard/proof.py``)."""
    module_stats: bool = option(True, "on a trip, replay once more for each module's activation absmax and grad norm.")
    check_batch: bool = option(False, "run ``ng.check_batch`` on ``batch=`` before the forward.")
    history: int = option(
        64,
        "how many recent (step, loss, grad norm) records the history rules keep.",
        _int_at_least(1),
    )
    max_bundle_bytes: int = option(
        64 * 2**20,
        "a batch larger than this goes into a bundle as shapes only.",
        _int_at_least(0),
    )
    bundle_weights: bool | int = option(
        False,
        "store the weights in each trip's bundle (True: up to 1 GiB; an int: up to N bytes).",
        _byte_limit,
    )
    """Store the model's parameters and buffers in each trip's bundle (``weights.safetensors``), so
    ``nanguard replay`` reproduces a fault in the weights: True up to 1 GiB, an int N up to N bytes.
    A larger model's bundle says they were left out. Under FSDP2 each rank stores its own shards."""
    # -- remedies (policy="auto") and early warning
    remedy_budget: int = option(
        3,
        'under "auto", how many remedies one cause may get before the run stops.',
        _int_at_least(0),
    )
    lr_factor: float = option(
        0.5,
        'under "auto", ``optimizer.divergence`` multiplies every group\'s LR by this.',
        _fraction,
    )
    upcast: bool = option(
        True,
        'under "auto", run a module whose float16/bfloat16 op overflowed in float32 from then on.',
    )
    quarantine: str = option(
        "rows",
        'under "auto", which rows a data cause quarantines: "rows", "batch", "previous" or "off".',
        _one_of(QUARANTINE_SCOPES),
    )
    """policy="auto", data causes with ``sample_ids``: quarantine the bad "rows", the whole "batch"
    when the rows cannot be told, that and the "previous" batch, or "off"."""
    headroom_every: int = option(
        100,
        "every N steps, measure how close float16/bfloat16 op outputs come to overflow (0: off).",
        _int_at_least(0),
    )
    """Every N steps, measure how close float16/bfloat16 op outputs per module come to overflow, on a
    replay of the step (never the step that updates the weights); 0 = off."""
    precursor_every: int = option(
        20,
        "every N steps, sample the per-layer precursors of a blow-up and warn ahead of one (0: off).",
        _int_at_least(0),
    )
    """Every N steps, sample the per-layer precursors (the largest attention logit, log Z of the output
    logits, router logits, update-to-weight ratio, Adam's update per unit of LR, each layer's output RMS)
    as the step runs, read without a sync of their own; a steady growth toward a blow-up is a ``warning``
    event naming the layer, the signal, its growth, the steps left and the fix (docs/early-warning.md)."""
    precursor_lower_lr: bool = option(
        False,
        'under "auto", a precursor warning lowers the LR by ``lr_factor`` (once; off unless asked for).',
    )
    sync: str = option(
        "auto",
        'when ``step`` reads a step\'s health: "immediate", "deferred" (the next call), or "auto".',
        _one_of(SYNC_MODES),
    )
    """When ``step`` reads a step's health: "immediate" (within the step, before its update), or
    "deferred": step N's flags go to the host in a non-blocking copy and are read at the start of
    step N+1, while step N's update runs on the device, which skips a bad update itself (the
    optimizer's ``found_inf``). So deferred adds no host sync inside a step; it needs an optimizer
    that takes ``found_inf`` (fused Adam/AdamW/SGD), no GradScaler, no ``clip_grad_norm`` and
    ``skip_spikes=False``, and a bad step's verdict (diagnosis, skip, rollback or raise) comes
    with the next call to ``step`` (or ``close``/``state_dict``). "auto": deferred on CUDA where
    it applies, immediate elsewhere. ``check()`` always reads immediately."""
    hardware_warn_after: int = option(
        2,
        "warn naming the device once this many of its trips did not reproduce (0: never).",
        _int_at_least(0),
    )
    """Warn, naming the host and device, once this many trips flagged on one device did not reproduce on
    replay (counted in ``run_dir/hardware.jsonl`` across restarts; 0 = never)."""
    clip_grad_norm: float | None = option(
        None,
        "clip the gradients' global norm to this after the check, as ``clip_grad_norm_`` would.",
        _positive_or_none,
    )
    """Clip the gradients' global norm to this after the guard's unscale and check, before the
    optimizer step, as ``clip_grad_norm_(model.parameters())`` would (its tensors, in its order);
    the history keeps the norm before clipping, so divergence still shows."""

    @classmethod
    def from_options(cls, policy: str, options: Mapping[str, Any]) -> GuardConfig:
        """Build from ``Guard(..., **options)``; an unknown option is a ValueError naming it."""
        known = {f.name for f in fields(cls)} - {"policy"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown Guard option(s) {unknown}; accepted: {sorted(known)}")
        return cls(policy=policy, **options)

    def __post_init__(self) -> None:
        for f in fields(self):
            f.metadata["check"](f.name, getattr(self, f.name))
        if self.spike_warmup > self.spike_window:
            raise ValueError(f"spike_warmup must be <= spike_window ({self.spike_window}), got {self.spike_warmup}")


def _options_doc() -> str:
    """The end of ``Guard``'s docstring (``help(ng.Guard)``): each option in one line, from its field."""
    lines = ["    Options (keyword only; each is also a ``GuardConfig`` field, documented there in full):"]
    for f in fields(GuardConfig):
        lines += textwrap.wrap(
            f"{f.name}: {f.metadata['doc']}", 116, initial_indent=" " * 8, subsequent_indent=" " * 12
        )
    return "\n".join([*lines, "    An unknown option is a ValueError naming the accepted ones.", ""])


def with_options(init: Callable[..., None]) -> inspect.Signature:
    """``init``'s signature (``Guard.__init__``, which takes the options as ``**options``) with each option
    a keyword of its own, typed and with its default, as ``help(ng.Guard)`` shows it."""
    params = list(inspect.signature(init).parameters.values())
    rest = params.pop() if params[-1].kind is inspect.Parameter.VAR_KEYWORD else None
    params += [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in fields(GuardConfig)
        if f.name not in {p.name for p in params}
    ]
    return inspect.signature(init).replace(parameters=[*params, *([rest] if rest is not None else [])])


OPTIONS_DOC = _options_doc()
"""The end of ``Guard``'s docstring, each option in one line (``help(ng.Guard)``); the fields hold them in full."""
