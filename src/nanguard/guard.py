"""``Guard``: check every step for NaN/Inf at near-zero cost, diagnose a trip, recover.

Per step the guard reduces the loss and all gradients to one small device tensor (total
grad norm, loss, loss scale, and the previous update's parameter flag) with foreach
kernels, and reads it back once. Under torch.distributed the same tensor carries one flag
per rank through a single all-reduce, so every rank takes the same decision.

Which path steps the optimizer:

- **host path** (default): the guard reads the health tensor, then calls
  ``optimizer.step()`` only for a finite step.
- **device path**: with a fused optimizer (``fused=True`` Adam/AdamW/SGD, the ones that
  accept GradScaler's ``found_inf``), the guard hands the flag to the optimizer, which
  skips the update on the device; the host read then overlaps with the update.

A parameter check after the update is folded into the next step's read, so it adds no
host sync; it finds finite gradients turned into non-finite parameters
(``optimizer.nonfinite_update``).
"""

from __future__ import annotations

import copy
import logging
import math
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanguard import dist
from nanguard.diagnose import diagnose
from nanguard.errors import NonFiniteError
from nanguard.events import EventLog, NullEventLog
from nanguard.findings import Diagnosis
from nanguard.rng import get_rng_state, set_rng_state
from nanguard.spikes import Spike, SpikeDetector
from nanguard.stats import grad_health, local
from nanguard.tracer import trace, weight_scale
from nanguard.tracer.module_stats import module_stats

__all__ = ["POLICIES", "BufferBackup", "Guard", "GuardConfig"]

log = logging.getLogger("nanguard")

POLICIES = ("skip", "rollback", "raise")


@dataclass(kw_only=True)
class GuardConfig:
    """Settings of a ``Guard``; every field is validated.

    Example:
        >>> GuardConfig(policy="rollback", snapshot_every=100, rollback_skip_batches=2)
    """

    policy: str = "skip"
    """What a trip does: "skip" the update, "rollback" to the last snapshot, or "raise"."""
    max_consecutive_skips: int = 10
    """Raise NonFiniteError after this many skipped (or rolled-back) steps in a row."""
    snapshot_every: int = 50
    """Keep a CPU snapshot of model and optimizer every N good steps (rollback policy)."""
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
    """A trip after the grad norm or loss grew this factor within this many steps is divergence."""
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
    module_stats: bool = True
    """On a trip, replay once more to record each module's activation absmax and grad norm."""
    check_batch: bool = False
    """Run ng.check_batch on the batch passed to ``step`` before the forward."""
    history: int = 64
    """How many recent (step, loss, grad norm) records to keep for the history rules."""
    max_bundle_bytes: int = 64 * 2**20
    """Batches larger than this are stored in a bundle as shapes only."""

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
        positive = ("max_consecutive_skips", "snapshot_every", "spike_window", "spike_warmup",
                    "divergence_window", "max_overflow_streak", "log_every", "history")  # fmt: skip
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("rollback_skip_batches", "param_check_every", "fingerprint_every", "max_bundle_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        for name in ("spike_threshold", "divergence_factor", "loss_scale_floor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if self.spike_warmup > self.spike_window:
            raise ValueError(f"spike_warmup must be <= spike_window ({self.spike_window}), got {self.spike_warmup}")


class Guard:
    """Guards each optimizer step: detect, diagnose, and skip, roll back or raise.

    ``closure`` follows the ``torch.optim`` convention: it zeroes the gradients, runs
    forward and backward, and returns the loss. With a ``torch.amp.GradScaler`` pass it
    as ``scaler=`` and call ``scaler.scale(loss).backward()`` in the closure; the guard
    unscales, steps and updates the scaler.

    Example:
        >>> guard = ng.Guard(model, optimizer, policy="skip", run_dir="runs/exp1")
        >>> for batch in loader:
        ...     def closure():
        ...         optimizer.zero_grad()
        ...         loss = model(**batch).loss
        ...         loss.backward()
        ...         return loss
        ...     loss = guard.step(closure, batch=batch)   # None when the step was skipped
        >>> guard.skipped, guard.last_diagnosis

    After a rollback, the next ``rollback_skip_batches`` calls to ``step`` drop their batch
    without running the closure and return None; ``guard.last_action`` is then
    ``"drop_batch"``, so the loop knows which batches were skipped.

    Pass ``batch=`` to ``step``: a trip's replay names the input that held the bad values
    (``batch['pixel_values']``), a repro bundle stores it, and ``check_batch=True`` audits
    it before the forward. Under DDP the guard wraps the model's comm hook to see each
    rank's own gradients before averaging; a custom hook goes in as ``comm_hook=(state,
    hook)``. Every other option is a ``GuardConfig`` field.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        policy: str = "skip",
        *,
        scaler: Any = None,
        run_dir: str | Path | None = None,
        comm_hook: tuple[Any, Callable[..., Any]] | None = None,
        **config: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.config = GuardConfig.from_options(policy, config)
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.rank = dist.rank()
        self.events = EventLog(self.run_dir, self.rank) if self.run_dir is not None else NullEventLog()

        self.step_count = 0
        self.skipped = 0
        self.rollbacks = 0
        self.overflows = 0
        self.spikes = 0
        self.consecutive_skips = 0
        self.overflow_streak = 0
        self.last_diagnosis: Diagnosis | None = None
        self.last_action: str | None = None
        self.history: deque[tuple[int, float, float]] = deque(maxlen=self.config.history)
        self.loss_spikes = SpikeDetector("loss", **self._spike_args())
        self.grad_spikes = SpikeDetector("grad_norm", **self._spike_args())
        self._recent_spike_step: int | None = None
        self._drop_batches = 0
        self._snapshot: dict[str, Any] | None = None
        self._good_steps = 0
        self._param_flag: torch.Tensor | None = None
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        self._buffers = BufferBackup(list(model.buffers()))
        # Only the GPUs this model lives on draw random numbers for its step.
        self._cuda_devices = sorted({p.device.index or 0 for p in self._params if p.device.type == "cuda"})
        self._comm = dist.watch_communication(model, comm_hook)
        self._fused = _supports_found_inf(optimizer)
        self._closure_error: BaseException | None = None
        self._sharded = any(local(p) is not p for p in self._params)  # FSDP2: each rank holds a shard
        # init.scale is about the weights the run started from, not weights grown by training.
        self._initial_scale = weight_scale(dist.unwrap(model))
        self._pending: tuple[int, float, float, float, float] | None = None
        self._module_stats: dict[str, Any] | None = None
        self._step_values: tuple[float | None, float | None, float | None] = (None, None, None)
        self.events.write("start", 0, config=asdict(self.config), world_size=dist.world_size(),
                          path="device" if self._fused else "host")  # fmt: skip
        if self.config.policy == "rollback":
            self._take_snapshot()

    def _spike_args(self) -> dict[str, Any]:
        c = self.config
        return {"window": c.spike_window, "warmup": c.spike_warmup, "threshold": c.spike_threshold}

    # -- the step ------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any], batch: Any = None) -> Any:
        """Run ``closure``, check it, then step the optimizer or recover.

        Returns the closure's loss, or None when the step was skipped or its batch dropped.
        """
        if not callable(closure):
            raise ValueError(f"closure must be callable, got {type(closure).__name__}")
        if self._drop_batch() or self._bad_batch(batch):
            return None
        rng = get_rng_state(self._cuda_devices)
        self._buffers.save()
        self._comm.reset()
        self._closure_error = None
        try:
            with torch.enable_grad():
                loss = closure()
        except (IndexError, RuntimeError) as err:
            if not _index_error(err):
                raise
            if dist.is_distributed():
                # The other ranks are already in the gradient all-reduce: joining them is
                # impossible, so fail loudly rather than hang. check_batch=True catches it first.
                log.error("nanguard: the forward raised on rank %d; use Guard(check_batch=True) under "
                          "torch.distributed to catch out-of-range ids before the forward", self.rank)  # fmt: skip
                raise
            # An out-of-range id raises on CPU. This rank still joins the agreement, flagged
            # by a NaN loss, and its replay turns the error into a data diagnosis.
            self._closure_error = err
            self.model.zero_grad(set_to_none=True)
            loss = torch.full((), math.nan, device=self._params[0].device if self._params else None)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        # A spike verdict comes after the host read, too late for the device path.
        device_step = self._fused and self.scaler is None and not self.config.skip_spikes
        if not self._check(loss, closure, batch, rng, device_step=device_step):
            return None
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif not device_step:
            self.optimizer.step()
        self.after_step()
        return loss

    def check(
        self,
        loss: Any,
        *,
        replay: Callable[[], Any] | None = None,
        batch: Any = None,
        rng: dict[str, torch.Tensor] | None = None,
    ) -> bool:
        """The closure-free form, for loops that own backward and ``optimizer.step()``.

        Call it after backward and before the optimizer step; step only when it returns
        True, then call ``after_step()``. ``replay`` re-runs the forward and backward (it
        is traced by ``ng.locate`` on a trip); ``rng`` is the RNG state captured before the
        forward (``nanguard.rng.get_rng_state()``), so the replay draws the same numbers.

        Example:
            >>> loss = model(batch).mean(); loss.backward()
            >>> if guard.check(loss, replay=lambda: rerun(batch), batch=batch):
            ...     optimizer.step()
            ...     guard.after_step()
        """
        if self._drop_batch() or self._bad_batch(batch):
            self._comm.reset()
            return False
        self._closure_error = None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        return self._check(loss, replay, batch, rng, device_step=False, restore_buffers=False)

    def _next_step(self) -> int:
        step = self.step_count
        self.step_count += 1
        self._step_values = (None, None, None)
        return step

    def _drop_batch(self) -> bool:
        if self._drop_batches <= 0:
            return False
        step = self._next_step()
        self._drop_batches -= 1
        self.last_action = "drop_batch"
        self.events.write("skip", step, reason="rollback: dropping the batch after a bad one")
        log.warning("nanguard: step %d: batch dropped after rollback", step)
        return True

    def _bad_batch(self, batch: Any) -> bool:
        """check_batch before the forward. Ranks agree first: under DDP one rank cannot skip
        its forward and backward while the others all-reduce gradients."""
        if not self.config.check_batch:
            return False
        diag = self._check_batch(batch, self.step_count) if batch is not None else None
        flagged = dist.agree_flag(diag is not None)
        if not flagged:
            return False
        step = self._next_step()
        diag = dist.gather_diagnosis(diag, flagged)
        assert diag is not None  # a flagged rank always contributes its diagnosis
        diag.step = step
        self._trip(diag, step, batch, None)
        return True

    def _check(
        self,
        loss: Any,
        replay: Callable[[], Any] | None,
        batch: Any,
        rng: dict[str, torch.Tensor] | None,
        *,
        device_step: bool,
        restore_buffers: bool = True,
    ) -> bool:
        """The decision of one step; ``restore_buffers`` is False when no backup was taken
        before the forward (``check()``: the caller owns its loop)."""
        step = self._next_step()
        grads = [p.grad for p in self._params if p.grad is not None]
        gn, lv, scale_t, code = self._health(loss, grads)
        # The one collective of the step: every rank's code, the mean loss, the global grad norm.
        world = dist.world_size()
        agreed = dist.agree(code, lv, gn * gn, sharded=self._sharded)
        if device_step:
            # Device path: the fused optimizer skips the update on the device when any rank is bad.
            self.optimizer.found_inf = (agreed[:world].amax() > 0).float()  # type: ignore[attr-defined]
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf  # type: ignore[attr-defined]
        extra = torch.stack([scale_t.float(), lv.float()]).to(agreed.device)
        values = torch.cat([agreed, extra]).tolist()  # the one host read of this step
        loss_value, grad_norm, scale, own_loss = values[world : world + 4]
        # Decisions and history use the agreed mean loss; events keep this rank's own curve.
        self._step_values = (own_loss, grad_norm, scale if self.scaler is not None else None)
        rank_codes = [int(c) for c in values[:world]]
        bad_ranks = [r for r, c in enumerate(rank_codes) if c & _LOCAL_BAD]
        synced_bad = any(c & _SYNCED_BAD for c in rank_codes)

        if any(c & _PARAMS_BAD for c in rank_codes):
            self._abandon(restore_buffers)
            ranks = [r for r, c in enumerate(rank_codes) if c & _PARAMS_BAD]
            self._trip(self._nonfinite_update(step - 1, ranks), step - 1, batch, rng)
            return False
        if self.scaler is not None and not math.isfinite(grad_norm) and not bad_ranks:
            self._overflow(step, loss_value, scale)
            return False
        if bad_ranks or synced_bad:
            if restore_buffers:
                self._buffers.restore()  # the replays start from the step's own state...
            diag = self._diagnose(replay, step, rng, loss_value, grad_norm, bad_ranks, batch)
            self._abandon(restore_buffers)  # ...and leave none of theirs behind
            self._trip(diag, step, batch, rng)
            return False
        spike = self._spikes(step, loss_value, grad_norm)
        if spike is not None and self.config.skip_spikes:
            self._abandon(restore_buffers)
            self._skip(step, f"{spike.metric} spike (z={spike.score:.1f})", loss_value, grad_norm, scale)
            return False
        self._pending = (step, loss_value, grad_norm, scale, own_loss)
        return True

    def _abandon(self, restore_buffers: bool) -> None:
        """Undo what the step's forward and backward left: buffers, gradients, the scaler's unscale."""
        if restore_buffers:
            self._buffers.restore()
        self.model.zero_grad(set_to_none=True)
        if self.scaler is not None:
            # unscale_ already ran for this step: update() closes it, or the next unscale_ raises.
            self.scaler.update()

    def after_step(self) -> None:
        """Record a finished optimizer update: history, step event, parameter check, snapshot."""
        if self._pending is None:
            return
        step, loss_value, grad_norm, scale, own_loss = self._pending
        self._pending = None
        self.overflow_streak = 0
        self._after_update(step)
        self.history.append((step, loss_value, grad_norm))
        self.consecutive_skips = 0
        self.last_action = "step"
        if step % self.config.log_every == 0:
            self.events.write("step", step, loss=own_loss, grad_norm=grad_norm, skipped=False,
                              scale=scale if self.scaler is not None else None)  # fmt: skip

    def _health(
        self, loss: Any, grads: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(grad_norm, loss, scale, code) as device scalars; no host read.

        ``code`` is this rank's flags: 1 = its own loss or (pre-communication) gradients are
        non-finite, 2 = the previous update left non-finite parameters, 4 = the gradients
        it holds now (after any all-reduce) are non-finite.
        """
        device = grads[0].device if grads else _device_of(loss)
        gn = grad_health(grads).to(device)
        if isinstance(loss, torch.Tensor):
            lv = loss.detach().float().reshape(-1)[0].to(device)
        else:
            lv = torch.tensor(float(loss) if loss is not None else 0.0, device=device)
        grads_bad = ~torch.isfinite(gn)
        local = ~torch.isfinite(lv)
        pre_comm = self._comm.local_flag(device)
        if pre_comm is not None:
            local = local | pre_comm  # this rank's own gradients, before DDP averaged them
        elif not dist.is_distributed():
            local = local | grads_bad
        if self.scaler is not None:
            # Overflowing gradients are the scaler's business; only a bad loss is a trip here.
            scale = self.scaler._scale.to(device).float().reshape(())
            local, grads_bad = ~torch.isfinite(lv), torch.zeros_like(grads_bad)
        else:
            scale = gn.new_ones(())
        code = local.to(torch.int32) + _SYNCED_BAD * grads_bad.to(torch.int32)
        if self._param_flag is not None:
            code = code + _PARAMS_BAD * self._param_flag.to(device).to(torch.int32)
            self._param_flag = None
        return gn, lv, scale, code

    def _after_update(self, step: int) -> None:
        every = self.config.param_check_every
        if every and step % every == 0:
            with torch.no_grad():
                self._param_flag = ~torch.isfinite(grad_health(self._params))
        self._good_steps += 1
        every = self.config.fingerprint_every
        if every and dist.is_distributed() and self._good_steps % every == 0:
            self._check_replicas(step)
        if self.config.policy == "rollback" and self._good_steps % self.config.snapshot_every == 0:
            self._take_snapshot()

    def _check_replicas(self, step: int) -> None:
        differ, first = dist.replica_mismatch(self.model)
        if not differ:
            return
        diag = Diagnosis(
            cause="distributed.replica_divergence",
            kind="nan",
            phase="parameters",
            module=first.rpartition(".")[0] if first else None,
            rank=differ[0],
            ranks=differ,
            step=step,
            evidence={
                "first_parameter": first,
                "ranks_differing_from_rank0": differ,
                "why": f"after step {step} the parameters of rank(s) {differ} differ from rank 0's, first at {first}",
            },
            fixes=[
                "a rank stepped while another skipped, or a parameter was changed on one rank only "
                "(a custom init, loading a checkpoint on rank 0 without a broadcast)",
                "parameters that DDP does not all-reduce (requires_grad=False, or unused with "
                "find_unused_parameters=False) drift when changed in place",
                "the guard re-broadcasts rank 0's parameters and buffers; optimizer state may still differ",
            ],
        )
        self.last_diagnosis = diag
        action = "raise" if self.config.policy == "raise" else "resync"
        self.events.write("trip", step, action=action, ranks=differ, diagnosis=diag.to_dict())
        log.warning("nanguard: step %d: %s -> %s", step, diag.summary(), action)
        if action == "raise":
            raise NonFiniteError(diag)
        dist.broadcast_state(self.model, src=0)

    # -- trips -------------------------------------------------------------------------
    def _diagnose(
        self,
        closure: Callable[[], Any] | None,
        step: int,
        rng: dict[str, torch.Tensor] | None,
        loss_value: float,
        grad_norm: float,
        bad_ranks: list[int],
        batch: Any = None,
    ) -> Diagnosis:
        diag = None
        located = self.config.locate and closure is not None
        if located:
            if rng is not None:
                set_rng_state(rng)
            try:
                diag = self._replay(closure, batch)
            except Exception as err:  # the guard's own failure must not kill training
                warnings.warn(f"nanguard: locate failed on step {step}: {err!r}", stacklevel=3)
                diag, located = None, False
            # Every rank replays or none does: the replays' DDP forwards may broadcast buffers.
            if self.config.module_stats:
                self._collect_module_stats(closure, rng, step)
        error, self._closure_error = self._closure_error, None
        if error is not None and (diag is None or not diag.cause.startswith("data.")):
            raise error  # not an id out of range: the user's own bug, theirs to see
        diag = dist.gather_diagnosis(diag, bad_ranks)
        if diag is None:
            diag = _transient(step, loss_value, grad_norm, bad_ranks, located=located)
        diag.step = step
        self._apply_history(diag, step)
        return diag

    def _collect_module_stats(self, closure: Callable[[], Any], rng: dict[str, torch.Tensor] | None, step: int) -> None:
        """Per-module activation absmax and grad norm of the tripped step, for the report.

        Every rank runs it, in step, since a DDP forward may broadcast buffers."""
        if rng is not None:
            set_rng_state(rng)
        try:
            model = dist.unwrap(self.model)
            self._module_stats = dist.replay_locally(self.model, lambda: module_stats(model, closure))
        except Exception as err:  # evidence for the report only: never worth killing training
            warnings.warn(f"nanguard: module stats failed on step {step}: {err!r}", stacklevel=3)

    def _replay(self, closure: Callable[[], Any], batch: Any) -> Diagnosis | None:
        """Re-run the step under the tracer with this rank's gradient sync off."""
        model = dist.unwrap(self.model)
        return dist.replay_locally(self.model, lambda: trace(closure, (), {}, model=model, inputs={"batch": batch}))

    def _apply_history(self, diag: Diagnosis, step: int) -> None:
        """Re-judge a located diagnosis with what only the guard knows: the run's history
        and the weight scale it started from."""
        if "origin" not in diag.evidence:
            return
        diag.evidence["initial_weight_scale"] = self._initial_scale
        history = self._history_evidence(step)
        if history:
            diag.evidence["history"] = history
        verdict = diagnose(diag.evidence)
        if verdict.cause != diag.cause:
            diag.evidence["op_cause"] = diag.cause
            diag.cause, diag.fixes = verdict.cause, verdict.fixes
            diag.evidence["why"] = verdict.why

    def _history_evidence(self, step: int) -> dict[str, Any]:
        recent = [h for h in self.history if h[0] >= step - self.config.divergence_window]
        if len(recent) < 2:
            return {}
        out: dict[str, Any] = {"window": len(recent), "lr": self.optimizer.param_groups[0].get("lr")}
        best = ("grad_norm", 1.0)
        for metric, idx in (("grad_norm", 2), ("loss", 1)):
            vals = [h[idx] for h in recent if math.isfinite(h[idx]) and h[idx] > 0]
            if len(vals) >= 2:
                growth = vals[-1] / min(vals[:-1])
                if growth > best[1]:
                    best = (metric, growth)
        out["metric"], out["growth"] = best
        spiked = self._recent_spike_step is not None and step - self._recent_spike_step <= self.config.divergence_window
        out["diverging"] = best[1] >= self.config.divergence_factor or spiked
        out["spike"] = spiked
        return out

    def _nonfinite_update(self, step: int, ranks: list[int]) -> Diagnosis:
        named = list(dist.unwrap(self.model).named_parameters())
        with torch.no_grad():
            finite = [bool(torch.isfinite(local(p)).all()) for _, p in named]  # on a trip only
        bad = [n for (n, _), ok in zip(named, finite, strict=True) if not ok]
        opt_state = {}
        for group in self.optimizer.param_groups:
            opt_state = {k: v for k, v in group.items() if isinstance(v, (int, float, bool))}
            break
        first = bad[0] if bad else None
        diag = Diagnosis(
            cause="optimizer.nonfinite_update",
            kind="nan",
            phase="optimizer",
            op=f"{type(self.optimizer).__name__}.step",
            module=first.rpartition(".")[0] if first else None,
            rank=ranks[0] if dist.is_distributed() and ranks else dist.rank_or_none(),
            ranks=ranks if dist.is_distributed() else [],
            step=step,
            evidence={
                "parameters": bad[:16],
                "nonfinite_parameters": len(bad),
                "optimizer": type(self.optimizer).__name__,
                "hyperparameters": opt_state,
                "why": f"gradients were finite, but after {type(self.optimizer).__name__}.step "
                f"{len(bad)} parameter tensor(s) hold NaN/Inf, first {first}",
            },
            fixes=_update_fixes(opt_state),
        )
        history = self._history_evidence(step + 1)
        if history.get("diverging"):
            diag.evidence["history"] = history
            diag.evidence["op_cause"] = diag.cause
            verdict = diagnose(diag.evidence)
            diag.cause, diag.fixes = verdict.cause, verdict.fixes
        return diag

    def _trip(
        self,
        diag: Diagnosis,
        step: int,
        batch: Any,
        rng: dict[str, torch.Tensor] | None,
    ) -> None:
        self.last_diagnosis = diag
        policy = self.config.policy
        update_done = diag.cause in ("optimizer.nonfinite_update",) or diag.phase == "optimizer"
        if update_done and policy == "skip":
            # The bad update already happened: only a snapshot can undo it.
            policy = "rollback" if self._snapshot is not None else "raise"
        action = policy
        stats, self._module_stats = self._module_stats, None
        extra = {"module_stats": stats} if stats else {}
        flagged = diag.evidence.get("flagged_ranks", [self.rank])
        self.events.write("trip", step, action=action, ranks=flagged, diagnosis=diag.to_dict(), **extra)
        self._write_bundle(diag, step, batch, rng)
        log.warning("nanguard: step %d: %s -> %s", step, diag.summary(), action)
        if policy == "raise":
            self.last_action = "raise"
            raise NonFiniteError(diag)
        if policy == "rollback":
            if self._snapshot is None:
                raise NonFiniteError(diag, f"{diag}\n(no snapshot to roll back to)")
            restored = self._restore_snapshot()
            self.rollbacks += 1
            self._drop_batches = self.config.rollback_skip_batches
            self.last_action = "rollback"
            self.events.write("rollback", step, restored_step=restored,
                              skip_batches=self._drop_batches, reason=diag.cause)  # fmt: skip
            self._count_in_a_row()
            return None
        self._skip(step, diag.cause, *self._step_values)
        return None

    def _skip(self, step: int, reason: str, loss: float | None, grad_norm: float | None, scale: float | None) -> None:
        self.skipped += 1
        self.last_action = "skip"
        self.events.write("skip", step, reason=reason)
        self.events.write("step", step, loss=loss, grad_norm=grad_norm, skipped=True, scale=scale)
        self._count_in_a_row()

    def _count_in_a_row(self) -> None:
        """Skips and rollbacks in a row without a good step: past the limit, stop the run."""
        self.consecutive_skips += 1
        if self.consecutive_skips >= self.config.max_consecutive_skips:
            diag = self.last_diagnosis
            raise NonFiniteError(
                diag,
                f"{self.consecutive_skips} steps skipped in a row (max_consecutive_skips="
                f"{self.config.max_consecutive_skips})" + (f"; last: {diag.summary()}" if diag else ""),
            )

    def _overflow(self, step: int, loss_value: float, scale: float) -> None:
        """A GradScaler overflow step: normal, counted, and skipped by the scaler itself."""
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.overflows += 1
        self.overflow_streak += 1
        self.last_action = "overflow"
        new_scale = float(self.scaler.get_scale())
        self.events.write("overflow", step, scale=scale, new_scale=new_scale, streak=self.overflow_streak)
        self.events.write("step", step, loss=loss_value, grad_norm=None, skipped=True, scale=scale)
        c = self.config
        if new_scale < c.loss_scale_floor or self.overflow_streak >= c.max_overflow_streak:
            diag = Diagnosis(
                cause="precision.loss_scale",
                kind="inf",
                phase="backward",
                rank=dist.rank_or_none(),
                step=step,
                evidence={
                    "scale": new_scale,
                    "floor": c.loss_scale_floor,
                    "overflow_streak": self.overflow_streak,
                    "overflows": self.overflows,
                    "why": f"the GradScaler scale fell to {new_scale:.3g} after {self.overflow_streak} "
                    f"overflowing steps in a row (floor {c.loss_scale_floor:g}): gradients overflow "
                    "float16 at any scale",
                },
                fixes=[
                    "switch float16 autocast to bfloat16, which needs no loss scaling",
                    "find the overflowing op: ng.locate(closure, model=model) on this step",
                    "lower the learning rate or clip gradients: overflow usually follows growth",
                ],
            )
            self.last_diagnosis = diag
            self.events.write("trip", step, action="raise", ranks=[self.rank], diagnosis=diag.to_dict())
            raise NonFiniteError(diag)

    def _spikes(self, step: int, loss_value: float, grad_norm: float) -> Spike | None:
        found = None
        for detector, value in ((self.loss_spikes, loss_value), (self.grad_spikes, grad_norm)):
            spike = detector.update(value)
            if spike is not None:
                found = found or spike
                self.spikes += 1
                self._recent_spike_step = step
                self.events.write("spike", step, metric=spike.metric, value=spike.value,
                                  median=spike.median, score=spike.score)  # fmt: skip
                log.warning("nanguard: step %d: %s spike %.4g (median %.4g, z=%.1f)",
                            step, spike.metric, spike.value, spike.median, spike.score)  # fmt: skip
        return found

    def _check_batch(self, batch: Any, step: int) -> Diagnosis | None:
        from nanguard.audit import check_batch

        findings = [f for f in check_batch(batch, model=self.model) if f.severity == "error"]
        if not findings:
            return None
        first = findings[0]
        return Diagnosis(
            cause=first.cause,
            kind="nan",
            phase="data",
            module=None,
            rank=dist.rank_or_none(),
            ranks=[self.rank] if dist.is_distributed() else [],
            step=step,
            evidence={
                "findings": [f.to_dict() for f in findings],
                "where": first.where,
                "why": f"check_batch before the forward: {first.message}",
            },
            fixes=[first.fix] if first.fix else [],
        )

    def _write_bundle(self, diag: Diagnosis, step: int, batch: Any, rng: dict[str, torch.Tensor] | None) -> None:
        if self.run_dir is None or batch is None:
            return
        from nanguard.bundle import save_bundle

        try:
            path = save_bundle(
                self.run_dir,
                step=step,
                rank=self.rank,
                batch=batch,
                rng_state=rng or get_rng_state(),
                meta={
                    "diagnosis": diag.to_dict(),
                    "loss_tail": [h[1] for h in self.history][-16:],
                    "grad_norm_tail": [h[2] for h in self.history][-16:],
                    "fingerprint": dist.fingerprint(self.model),
                },
                max_batch_bytes=self.config.max_bundle_bytes,
            )
            diag.evidence["bundle"] = str(path)
        except Exception as err:  # a failed bundle must not kill training
            warnings.warn(f"nanguard: could not write the bundle for step {step}: {err!r}", stacklevel=3)

    # -- snapshots and state -----------------------------------------------------------
    def _take_snapshot(self) -> None:
        self._snapshot = {
            "step": self.step_count,
            "model": {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()},
            "optimizer": _to_cpu(copy.deepcopy(self.optimizer.state_dict())),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def _restore_snapshot(self) -> int:
        snap = self._snapshot
        assert snap is not None
        self.model.load_state_dict(snap["model"])
        self.optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))
        if self.scaler is not None and snap["scaler"] is not None:
            self.scaler.load_state_dict(snap["scaler"])
        self.model.zero_grad(set_to_none=True)
        self._param_flag = None
        return int(snap["step"])

    def state_dict(self) -> dict[str, Any]:
        """Counters, history and detector windows, so a resumed run keeps them."""
        return {
            **{name: getattr(self, name) for name in _COUNTERS},
            "history": [list(h) for h in self.history],
            "loss_spikes": self.loss_spikes.state_dict(),
            "grad_spikes": self.grad_spikes.state_dict(),
            "last_diagnosis": self.last_diagnosis.to_dict() if self.last_diagnosis else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name in _COUNTERS:
            setattr(self, name, int(state.get(name, 0)))
        self.history.clear()
        self.history.extend((int(s), float(lv), float(g)) for s, lv, g in state.get("history", []))
        self.loss_spikes.load_state_dict(state.get("loss_spikes", {}))
        self.grad_spikes.load_state_dict(state.get("grad_spikes", {}))
        last = state.get("last_diagnosis")
        self.last_diagnosis = Diagnosis.from_dict(last) if last else None

    def close(self) -> None:
        self.events.write("end", self.step_count, skipped=self.skipped, rollbacks=self.rollbacks)
        self.events.close()


_LOCAL_BAD, _PARAMS_BAD, _SYNCED_BAD = 1, 2, 4
_COUNTERS = ("step_count", "skipped", "rollbacks", "overflows", "spikes", "consecutive_skips", "overflow_streak")


def _transient(step: int, loss_value: float, grad_norm: float, bad_ranks: list[int], located: bool) -> Diagnosis:
    # No rank reproduces it: the rank is unknown, but every rank reports the same.
    rank = bad_ranks[0] if bad_ranks else None
    return Diagnosis(
        cause="distributed.transient" if located else "unknown",
        kind="nan" if math.isnan(loss_value) or math.isnan(grad_norm) else "inf",
        phase="communication" if dist.is_distributed() else "backward",
        rank=rank,
        ranks=list(bad_ranks) if dist.is_distributed() else [],
        step=step,
        evidence={
            "loss": loss_value,
            "grad_norm": grad_norm,
            "flagged_ranks": bad_ranks,
            "why": "the step went non-finite, but replaying it from the same RNG state and "
            "parameters on every rank gives finite values"
            if located
            else "the step went non-finite (locate is off, so no replay was run)",
        },
        fixes=[
            "a fault that does not reproduce points at hardware (a flaky GPU, memory errors), "
            "the communication layer, or nondeterministic kernels",
            "if it repeats on the same rank or node, drain that node; run NCCL with "
            "TORCH_NCCL_NAN_CHECK=1 to catch a bad collective",
        ],
    )


def _update_fixes(hp: Mapping[str, Any]) -> list[str]:
    fixes = []
    eps = hp.get("eps")
    if isinstance(eps, (int, float)) and eps <= 1e-12:
        fixes.append(f"optimizer eps is {eps}; use 1e-8 (1e-6 or more with bf16/fp16 states): "
                     "a zero second moment divides 0 by 0")  # fmt: skip
    fixes += [
        "check the optimizer state for NaN/Inf (a resumed state from another run or dtype)",
        f"lower the learning rate (now {hp.get('lr')})" if "lr" in hp else "lower the learning rate",
    ]
    return fixes


def _index_error(err: BaseException) -> bool:
    """An error an out-of-range index raises on CPU (CUDA asserts on the device instead)."""
    if isinstance(err, IndexError):
        return True
    text = str(err).lower()
    return "out of bounds" in text or "out of range" in text


def _supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    fused = any(group.get("fused") for group in optimizer.param_groups)
    return bool(fused and getattr(optimizer, "_step_supports_amp_scaling", False))


def _device_of(loss: Any) -> torch.device:
    return loss.device if isinstance(loss, torch.Tensor) else torch.device("cpu")


class BufferBackup:
    """Copies of buffers (BatchNorm running stats), kept so a skipped step leaves them as they were.

    The copies are allocated once; ``save()`` refreshes them with one foreach copy per step.

    Example:
        >>> backup = BufferBackup(list(model.buffers()))
        >>> backup.save(); model(bad_batch); backup.restore()
    """

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers
        self.copies = [torch.empty_like(b) for b in buffers]
        self.saved = False

    def save(self) -> None:
        if self.buffers:
            with torch.no_grad():
                torch._foreach_copy_(self.copies, self.buffers)
        self.saved = True

    def restore(self) -> None:
        """Put the saved values back (nothing happens before the first ``save``)."""
        if self.buffers and self.saved:
            with torch.no_grad():
                torch._foreach_copy_(self.buffers, self.copies)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj
