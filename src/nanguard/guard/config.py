"""``GuardConfig``: every setting of a ``Guard``, validated when it is built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from nanguard.environ import POLICIES

__all__ = ["OPTIONS_DOC", "POLICIES", "SYNC_MODES", "GuardConfig"]

QUARANTINE_SCOPES = ("rows", "batch", "previous", "off")
SYNC_MODES = ("auto", "immediate", "deferred")


@dataclass(kw_only=True)
class GuardConfig:
    """Settings of a ``Guard``; every field is validated.

    Example:
        >>> GuardConfig(policy="rollback", snapshot_every=100, rollback_skip_batches=2)
    """

    policy: str = "skip"
    """What a trip does: "skip" the update, "rollback" to the last snapshot, "raise", or "auto":
    the remedy the diagnosed cause calls for (``nanguard.guard.remedies``)."""
    max_consecutive_skips: int = 10
    """Raise NonFiniteError after this many skipped (or rolled-back) steps in a row."""
    snapshot_every: int = 50
    """Keep a CPU snapshot of model and optimizer every N good steps (rollback policy)."""
    snapshots: int = 3
    """How many snapshots to keep, at doubling ages (``snapshot_every``, up to 2x, 4x... apart), so a
    rollback can land before a growth that began before the newest one; fewer when the host's
    available memory would not hold a quarter more (each costs model + optimizer state in CPU memory)."""
    rollback_skip_batches: int = 1
    """After a rollback, the next K calls to ``step`` drop their batch without running it."""
    param_check_every: int = 1
    """Check parameters for NaN/Inf after every N-th update (0 turns the check off)."""
    spike_window: int = 50
    spike_warmup: int = 10
    spike_threshold: float = 6.0
    """Robust z-score (median/MAD) above which a loss or grad-norm value is a spike."""
    skip_spikes: bool = False
    """Skip the update on a spike (OLMo-core's skip-step), instead of only warning."""
    divergence_factor: float = 10.0
    divergence_window: int = 5
    """A trip after the grad norm or loss grew this factor within this many steps is divergence; a
    finite step whose loss and grad norm both grew this factor, on the second spike in a row of the
    warm detectors, trips as divergence itself, before its clip and update (so does a grad norm past 1.8e19, whose
    float32 square overflows)."""
    loss_scale_floor: float = 2.0**-8
    """A GradScaler scale below this is a collapse (precision.loss_scale)."""
    max_overflow_streak: int = 20
    """GradScaler overflow on this many steps in a row is a collapse too."""
    fingerprint_every: int = 100
    """Under torch.distributed, compare a parameter fingerprint across ranks every N updates (0 = off)."""
    log_every: int = 1
    """Write a compact step event every N steps (trips and skips are always written)."""
    locate: bool = True
    """Replay a tripped step under the op tracer to find the origin."""
    prove: bool = True
    """Under DDP, on a trip one rank's device may have made, re-compute that rank's step on a peer rank
    (its batch and RNG state): reproduced everywhere is a software or data fault, only on that device a
    faulty device (``hardware.faulty_device``), nowhere a transient one (``guard/proof.py``)."""
    module_stats: bool = True
    """On a trip, replay once more to record each module's activation absmax and grad norm."""
    check_batch: bool = False
    """Run ng.check_batch on the batch passed to ``step`` before the forward."""
    history: int = 64
    """How many recent (step, loss, grad norm) records to keep for the history rules."""
    max_bundle_bytes: int = 64 * 2**20
    """Batches larger than this are stored in a bundle as shapes only."""
    bundle_weights: bool | int = False
    """Store the model's parameters and buffers in each trip's bundle (``weights.safetensors``), so
    ``nanguard replay`` reproduces a fault in the weights: True up to 1 GiB, an int N up to N bytes.
    A larger model's bundle says they were left out. Under FSDP2 each rank stores its own shards."""
    # -- remedies (policy="auto") and early warning
    remedy_budget: int = 3
    """policy="auto": how many remedies one cause may get before the run stops (raise)."""
    lr_factor: float = 0.5
    """policy="auto": optimizer.divergence multiplies every group's LR by this (1.0 keeps the LR)."""
    upcast: bool = True
    """policy="auto": run a module whose float16/bfloat16 op overflowed in float32 from then on."""
    quarantine: str = "rows"
    """policy="auto", data causes with ``sample_ids``: quarantine the bad "rows", the whole "batch"
    when the rows cannot be told, that and the "previous" batch, or "off"."""
    headroom_every: int = 100
    """Every N steps, measure how close float16/bfloat16 op outputs per module come to overflow, on a
    replay of the step (never the step that updates the weights); 0 = off."""
    sync: str = "auto"
    """When ``step`` reads a step's health: "immediate" (within the step, before its update), or
    "deferred": step N's flags go to the host in a non-blocking copy and are read at the start of
    step N+1, while step N's update runs on the device, which skips a bad update itself (the
    optimizer's ``found_inf``). So deferred adds no host sync inside a step; it needs an optimizer
    that takes ``found_inf`` (fused Adam/AdamW/SGD), no GradScaler, no ``clip_grad_norm`` and
    ``skip_spikes=False``, and a bad step's verdict (diagnosis, skip, rollback or raise) comes
    with the next call to ``step`` (or ``close``/``state_dict``). "auto": deferred on CUDA where
    it applies, immediate elsewhere. ``check()`` always reads immediately."""
    hardware_warn_after: int = 2
    """Warn, naming the host and device, once this many trips flagged on one device did not reproduce on
    replay (counted in ``run_dir/hardware.jsonl`` across restarts; 0 = never)."""
    clip_grad_norm: float | None = None
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
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        positive = (
            "max_consecutive_skips",
            "snapshot_every",
            "snapshots",
            "spike_window",
            "spike_warmup",
            "divergence_window",
            "max_overflow_streak",
            "log_every",
            "history",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in (
            "rollback_skip_batches",
            "param_check_every",
            "fingerprint_every",
            "max_bundle_bytes",
            "remedy_budget",
            "headroom_every",
            "hardware_warn_after",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        for name in ("spike_threshold", "divergence_factor", "loss_scale_floor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        factor = self.lr_factor
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1:
            raise ValueError(f"lr_factor must be a number in (0, 1], got {self.lr_factor!r}")
        if self.sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {SYNC_MODES}, got {self.sync!r}")
        if self.quarantine not in QUARANTINE_SCOPES:
            raise ValueError(f"quarantine must be one of {QUARANTINE_SCOPES}, got {self.quarantine!r}")
        weights = self.bundle_weights
        if not isinstance(weights, (bool, int)) or weights < 0:
            raise ValueError(f"bundle_weights must be True, False or a byte limit (an int >= 0), got {weights!r}")
        clip = self.clip_grad_norm
        if clip is not None and (not isinstance(clip, (int, float)) or isinstance(clip, bool) or not clip > 0):
            raise ValueError(f"clip_grad_norm must be None or a number > 0, got {clip!r}")
        if self.spike_warmup > self.spike_window:
            raise ValueError(f"spike_warmup must be <= spike_window ({self.spike_window}), got {self.spike_warmup}")


OPTIONS_DOC = """    Options (keyword only; each is also a ``GuardConfig`` field, documented there in full):
        policy: what a trip does: "skip" the update, "rollback" to the last snapshot, "raise", or "auto" (the
            remedy the diagnosed cause calls for). ``NANGUARD_POLICY`` overrides it.
        max_consecutive_skips: raise ``NonFiniteError`` after this many skips or rollbacks in a row.
        snapshot_every: take a CPU snapshot of model and optimizer every N good steps (rollback and auto).
        snapshots: how many snapshots to keep, at doubling ages.
        rollback_skip_batches: after a rollback, drop the batches of the next K calls to ``step``.
        param_check_every: check the parameters for NaN/Inf after every N-th update (0: off).
        spike_window, spike_warmup: the spike detectors' window and the steps before they judge.
        spike_threshold: the robust z-score (median/MAD) above which a loss or grad norm is a spike.
        skip_spikes: skip the update on a spike, instead of only warning.
        divergence_factor, divergence_window: growth by this factor within this many steps is divergence.
        loss_scale_floor: a GradScaler scale below this is a collapse (``precision.loss_scale``).
        max_overflow_streak: GradScaler overflows on this many steps in a row are a collapse too.
        fingerprint_every: compare a parameter fingerprint across ranks every N updates (0: off).
        log_every: write a step event every N steps (trips and skips are always written).
        locate: replay a tripped step under the op tracer to find the origin.
        prove: under DDP, re-compute a suspect rank's step on a peer rank to tell a faulty device.
        module_stats: on a trip, replay once more for each module's activation absmax and grad norm.
        check_batch: run ``ng.check_batch`` on ``batch=`` before the forward.
        history: how many recent (step, loss, grad norm) records the history rules keep.
        max_bundle_bytes: a batch larger than this goes into a bundle as shapes only.
        bundle_weights: store the weights in each trip's bundle (True: up to 1 GiB; an int: up to N bytes).
        remedy_budget: under "auto", how many remedies one cause may get before the run stops.
        lr_factor: under "auto", ``optimizer.divergence`` multiplies every group's LR by this.
        upcast: under "auto", run a module whose float16/bfloat16 op overflowed in float32 from then on.
        quarantine: under "auto", which rows a data cause quarantines: "rows", "batch", "previous" or "off".
        headroom_every: every N steps, measure how close float16/bfloat16 op outputs come to overflow (0: off).
        sync: when ``step`` reads a step's health: "immediate", "deferred" (the next call), or "auto".
        hardware_warn_after: warn naming the device once this many of its trips did not reproduce (0: never).
        clip_grad_norm: clip the gradients' global norm to this after the check, as ``clip_grad_norm_`` would.
    An unknown option is a ValueError naming the accepted ones.
"""
"""The end of ``Guard``'s docstring, each option in one line (``help(ng.Guard)``); the fields hold them in full."""
