"""Remedies: the fix a diagnosed cause calls for (``policy="auto"``), and the escalation of
faults a skip cannot repair (every policy).

Under ``policy="auto"`` each trip gets one remedy, chosen by its cause:

- ``data.*``: skip, and quarantine the dataset ids of the rows that held the bad values;
- ``precision.overflow`` in a float32 module run under autocast: run that module's forward in
  float32 from now on ("upcast"), then skip; a second overflow in the same module raises;
- ``optimizer.divergence``: roll back, multiply every group's LR by ``lr_factor``; without
  a snapshot, reset the optimizer's moments and lower the LR ("lower_lr");
- ``parameters.nonfinite`` / ``optimizer.nonfinite_update``: roll back;
- ``precision.loss_scale``: reset the GradScaler's scale once, then raise;
- anything else: skip.

Each cause has a budget (``remedy_budget``); past it the run stops with ``NonFiniteError``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from nanguard import dist, sampler
from nanguard.findings import Diagnosis
from nanguard.guard.config import GuardConfig
from nanguard.guard.recorder import NullRecorder
from nanguard.guard.recovery import Recovery
from nanguard.tracer.headroom import HeadroomCheck
from nanguard.tree import leaves_with_path, path_str

__all__ = ["ACTIONS", "UNSKIPPABLE", "Remedies", "bad_rows"]

log = logging.getLogger("nanguard")

ACTIONS = ("skip", "quarantine", "upcast", "rollback", "lower_lr", "raise")
UNSKIPPABLE = ("parameters.nonfinite", "optimizer.nonfinite_update")
"""Causes whose damage is already in the parameters: a skipped step leaves it there."""
BUDGETED = ("precision.overflow", "optimizer.divergence", *UNSKIPPABLE)
"""Causes whose remedy changes the run (upcast, rollback, LR): each gets ``remedy_budget`` of them."""
SANE_SCALE = 2.0**16  # GradScaler's own default initial scale


class Remedies:
    """Chooses and applies remedies; ``entries`` is ``guard.remedies``.

    Example:
        >>> remedies = Remedies(model, optimizer, GuardConfig(policy="auto"), NullRecorder(), run_dir="runs/exp1")
        >>> remedies.begin_step(sample_ids=[40, 41, 42, 43])
        >>> remedies.choose(diag, recovery, step=7, batch=batch)
        ('skip', None)
        >>> remedies.entries[-1]["action"]
        'quarantine'
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: GuardConfig,
        recorder: NullRecorder,
        run_dir: Any = None,
        scheduler: Callable[[], Any] = lambda: None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.config = config
        self.emit = recorder.remedy
        self.headroom = HeadroomCheck(dist.unwrap(model), every=config.headroom_every, emit=recorder.headroom)
        self.run_dir = run_dir
        self.scheduler = scheduler
        self.entries: list[dict[str, Any]] = []
        self.upcast: list[str] = []
        self.lr_factor = 1.0
        self.used: dict[str, int] = {}
        self.sample_ids: list[int] | None = None
        self.previous_ids: list[int] | None = None
        self._lower_after_rollback = False

    # -- per step ----------------------------------------------------------------------
    def begin_step(self, sample_ids: Any) -> None:
        """Remember this batch's dataset ids (and the previous batch's)."""
        if sample_ids is not None and not isinstance(sample_ids, (torch.Tensor, list, tuple)):
            raise ValueError(f"sample_ids must be a 1-D tensor or a list of ints, got {type(sample_ids).__name__}")
        ids = sample_ids.reshape(-1).tolist() if isinstance(sample_ids, torch.Tensor) else sample_ids
        self.previous_ids, self.sample_ids = self.sample_ids, [int(i) for i in ids] if ids is not None else None

    def choose(self, diag: Diagnosis, recovery: Recovery, *, step: int, batch: Any) -> tuple[str, str | None]:
        """The guard's action for a trip ("skip", "rollback" or "raise") and, for "raise", the message."""
        action, has_snapshot = recovery.policy_for(diag), recovery.snapshot is not None
        if diag.phase == "data" and batch is not None:
            rows = bad_rows(diag, batch, len(self.sample_ids) if self.sample_ids else None)
            if rows is not None:
                diag.evidence["rows"] = rows
        if self.config.policy == "auto":
            return self._auto(diag, step, has_snapshot)
        if diag.cause in UNSKIPPABLE and self.config.policy == "skip":
            reason = (
                f"skipping cannot help: {diag.cause} means the parameters already hold the damage, so every "
                "later step would trip again; policy='rollback' or policy='auto' restores the last good snapshot"
            )
            self._record(step, diag.cause, "raise", None, reason)
            return "raise", f"{diag}\n{reason}"
        return action, None

    def after_rollback(self, step: int, take_snapshot: Callable[[], None]) -> None:
        """After a divergence rollback: lower the LR, and snapshot again so a later rollback
        restores the lowered LR, not the one that diverged."""
        if not self._lower_after_rollback:
            return
        self._lower_after_rollback = False
        self._lower_lr()
        take_snapshot()

    def rescue_scaler(self, step: int, diag: Diagnosis, scaler: Any, recovery: Recovery) -> bool:
        """``precision.loss_scale`` under auto: reset the scale once; False when the run must stop."""
        if self.config.policy != "auto":
            return False
        if self.used.get(diag.cause, 0) >= 1:
            self._record(step, diag.cause, "raise", None, "the loss scale collapsed again after a reset")
            return False
        self.used[diag.cause] = 1
        scaler.update(SANE_SCALE)
        recovery.overflow_streak = 0
        self._record(
            step, diag.cause, "skip", None, f"GradScaler scale reset to {SANE_SCALE:g}; raises if it collapses again"
        )
        return True

    # -- the remedies ------------------------------------------------------------------
    def _auto(self, diag: Diagnosis, step: int, has_snapshot: bool) -> tuple[str, str | None]:
        cause = diag.cause
        # Quarantines and plain skips are bounded by the dataset and max_consecutive_skips.
        used = self.used[cause] = self.used.get(cause, 0) + (cause in BUDGETED)
        if used > self.config.remedy_budget:
            reason = f"remedy_budget={self.config.remedy_budget} for {cause} is spent: the remedies did not hold"
            self._record(step, cause, "raise", None, reason)
            return "raise", f"{diag}\n{reason}"
        if cause.startswith("data."):
            self._quarantine(step, diag)
            return "skip", None
        if cause == "precision.overflow":
            return self._upcast(step, diag)
        if cause == "optimizer.divergence":
            if has_snapshot:
                self._lower_after_rollback = self.config.lr_factor < 1
                self._record(step, cause, "rollback", None, f"roll back, then LR x{self.config.lr_factor:g}")
                return "rollback", None
            reset = self._reset_moments()
            self._lower_lr()
            self._record(
                step,
                cause,
                "lower_lr",
                None,
                f"no snapshot: LR x{self.config.lr_factor:g}, optimizer state of {reset} parameters reset",
            )
            return "skip", None
        if cause in UNSKIPPABLE:
            if has_snapshot:
                self._record(step, cause, "rollback", None, "the parameters hold the damage: restore the last snapshot")
                return "rollback", None
            reason = f"{cause} cannot be skipped and there is no snapshot to roll back to"
            self._record(step, cause, "raise", None, reason)
            return "raise", f"{diag}\n{reason}"
        self._record(step, cause, "skip", None, "no specific remedy for this cause")
        return "skip", None

    def _quarantine(self, step: int, diag: Diagnosis) -> None:
        rows = diag.evidence.get("rows")
        scope, ids = self.config.quarantine, self.sample_ids
        chosen: list[int] = []
        if ids is not None and scope != "off":
            if rows is not None:
                chosen = [ids[r] for r in rows if r < len(ids)]
            elif scope in ("batch", "previous"):
                chosen = list(ids)
            if scope == "previous" and self.previous_ids:
                chosen += self.previous_ids
        if not chosen or self.run_dir is None:
            why = "no sample_ids given" if ids is None else f"quarantine={scope!r} and the bad rows cannot be told"
            self._record(step, diag.cause, "skip", None, why if self.run_dir else "no run_dir to keep a quarantine in")
            return
        try:
            sampler.add_quarantined(self.run_dir, chosen, step=step, cause=diag.cause)
        except OSError as err:  # a full disk must not kill the run
            log.warning("nanguard: could not write the quarantine file: %r", err)
        self._record(
            step,
            diag.cause,
            "quarantine",
            sorted(set(chosen)),
            f"rows {rows} of the batch hold the bad values" if rows is not None else f"quarantine={scope!r}",
        )

    def _upcast(self, step: int, diag: Diagnosis) -> tuple[str, str | None]:
        name = diag.module
        module = _submodule(self.model, name)
        if name in self.upcast:
            reason = f"module '{name}' overflowed again though it already runs in float32"
            self._record(step, diag.cause, "raise", name, reason)
            return "raise", f"{diag}\n{reason}"
        if module is None or not self.config.upcast or not _float32_weights(module):
            why = "upcast=False" if not self.config.upcast else "the module's weights are not float32 (no autocast)"
            self._record(step, diag.cause, "skip", name, why if module is not None else "no module to upcast")
            return "skip", None
        upcast_module(module)
        assert name is not None
        self.upcast.append(name)
        self._record(step, diag.cause, "upcast", name, "autocast off and inputs cast to float32 in this module")
        return "skip", None

    def _lower_lr(self) -> None:
        factor = self.config.lr_factor
        self.lr_factor *= factor
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * factor
            if "initial_lr" in group:
                group["initial_lr"] = group["initial_lr"] * factor
        scheduler = self.scheduler()
        if scheduler is not None and hasattr(scheduler, "base_lrs"):
            # Schedulers recompute the LR from base_lrs: scale them too, or the next
            # scheduler.step() undoes the remedy.
            scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]

    def _reset_moments(self) -> int:
        # The moments of a diverging run stay contaminated long after the spike: start them again.
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p in self.optimizer.state]
        for p in params:
            self.optimizer.state.pop(p)
        return len(params)

    def _record(self, step: int, cause: str, action: str, target: Any, reason: str) -> None:
        entry = {"step": step, "cause": cause, "action": action, "target": target, "reason": reason}
        self.entries.append(entry)
        self.emit(**entry)
        log.warning(
            "nanguard: step %d: remedy for %s: %s%s (%s)",
            step,
            cause,
            action,
            f" {target}" if target is not None else "",
            reason,
        )

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "upcast": list(self.upcast),
            "lr_factor": self.lr_factor,
            "used": dict(self.used),
            "entries": list(self.entries),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the upcast modules (their forwards run in float32 again) and the counters.
        The lowered LR itself lives in the optimizer's state_dict."""
        self.lr_factor = float(state.get("lr_factor", 1.0))
        self.used = {str(k): int(v) for k, v in dict(state.get("used", {})).items()}
        self.entries = [dict(e) for e in state.get("entries", [])]
        for name in state.get("upcast", []):
            module = _submodule(self.model, name)
            if module is not None and name not in self.upcast:
                upcast_module(module)
                self.upcast.append(name)


def upcast_module(module: nn.Module) -> None:
    """Run ``module``'s forward in float32 from now on: autocast off inside, float inputs cast up.

    Example:
        >>> upcast_module(model.blocks[0].attn)
    """
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with _autocast_off(args, kwargs):
            return inner(*_to_float32(args), **_to_float32(kwargs))

    module.forward = forward  # type: ignore[method-assign]


@contextlib.contextmanager
def _autocast_off(args: Any, kwargs: Any) -> Iterator[None]:
    devices = {t.device.type for _, t in leaves_with_path((args, kwargs)) if isinstance(t, torch.Tensor)} or {"cpu"}
    with contextlib.ExitStack() as stack:
        for device in devices:
            stack.enter_context(torch.autocast(device_type=device, enabled=False))
        yield


def _to_float32(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.is_floating_point() and obj.dtype != torch.float64 else obj
    if isinstance(obj, dict):
        return {k: _to_float32(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_float32(v) for v in obj) if not hasattr(obj, "_fields") else obj
    return obj


def _submodule(model: nn.Module, name: str | None) -> nn.Module | None:
    if name is None:
        return None
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _float32_weights(module: nn.Module) -> bool:
    return all(p.dtype == torch.float32 for p in module.parameters())


def bad_rows(diag: Diagnosis, batch: Any, n_rows: int | None) -> list[int] | None:
    """Row indices (dim 0) of ``batch`` holding the values a data diagnosis names: non-finite
    floats, or ids outside the indexed range; None when the rows cannot be told.

    Example:
        >>> bad_rows(diag, {"x": torch.tensor([[1.0], [float("nan")]])}, n_rows=2)
        [1]
    """
    origin = diag.evidence.get("origin") or {}
    if diag.cause == "data.nonfinite":
        paths = {origin.get("path")}
    elif diag.cause == "data.index_out_of_range" and isinstance(origin.get("indexed_size"), int):
        paths = {i.get("path") for i in origin.get("index_inputs") or []}
    else:
        return None
    size = origin.get("indexed_size")
    bad: torch.Tensor | None = None
    for key_path, leaf in leaves_with_path(batch):
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or (n_rows is not None and leaf.shape[0] != n_rows):
            continue
        if None not in paths and path_str("batch", key_path) not in paths:
            continue
        flat = leaf.detach().reshape(leaf.shape[0], -1)
        if diag.cause == "data.nonfinite" and leaf.is_floating_point():
            rows = ~torch.isfinite(flat).all(dim=1)
        elif diag.cause == "data.index_out_of_range" and not leaf.is_floating_point() and leaf.dtype != torch.bool:
            rows = ((flat < 0) | (flat >= size)).any(dim=1)
        else:
            continue
        bad = rows if bad is None or bad.shape != rows.shape else bad | rows
    if bad is None or not bool(bad.any()):
        return None
    return bad.nonzero().flatten().tolist()
