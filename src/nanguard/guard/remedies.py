"""Remedies: carry out and record the fix a diagnosed cause calls for. The choice is the
policy's (``nanguard.guard.policy``, from the cause table's ``remedy`` column).

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
from dataclasses import replace
from typing import Any, get_args

import torch
from torch import nn

from nanguard import dist, sampler
from nanguard.evidence import Evidence
from nanguard.findings import Diagnosis
from nanguard.guard.config import GuardConfig
from nanguard.guard.policy import SANE_SCALE, Remedy, RemedyKind
from nanguard.guard.recorder import NullRecorder
from nanguard.tracer.headroom import HeadroomCheck
from nanguard.tree import leaves_with_path, path_str

__all__ = ["ACTIONS", "Remedies", "bad_rows", "upcast_module", "with_bad_rows"]

log = logging.getLogger("nanguard")

ACTIONS = get_args(RemedyKind)


class Remedies:
    """Applies and records the remedies the policy (``nanguard.guard.policy``) chose; ``entries``
    is ``guard.remedies``. It owns what the remedies changed: the modules now run in float32,
    the LR factor, the batch ids a quarantine takes.

    Example:
        >>> remedies = Remedies(model, optimizer, GuardConfig(policy="auto"), NullRecorder(), run_dir="runs/exp1")
        >>> remedies.begin_step(sample_ids=[40, 41, 42, 43])
        >>> remedies.apply(Remedy("quarantine"), diag, step=7)
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
        scheduler: Any = None,
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
        self.sample_ids: list[int] | None = None
        self.previous_ids: list[int] | None = None

    # -- per step ----------------------------------------------------------------------
    def begin_step(self, sample_ids: Any) -> None:
        """Remember this batch's dataset ids (and the previous batch's)."""
        if sample_ids is None and self.sample_ids is None:
            self.previous_ids = None
            return
        if sample_ids is not None and not isinstance(sample_ids, (torch.Tensor, list, tuple)):
            raise ValueError(f"sample_ids must be a 1-D tensor or a list of ints, got {type(sample_ids).__name__}")
        ids = sample_ids.reshape(-1).tolist() if isinstance(sample_ids, torch.Tensor) else sample_ids
        self.previous_ids, self.sample_ids = self.sample_ids, [int(i) for i in ids] if ids is not None else None

    def rows(self) -> int | None:
        """How many rows this step's batch has, when its sample ids tell."""
        return len(self.sample_ids) if self.sample_ids else None

    def can_upcast(self, name: str | None) -> str | None:
        """None when module ``name`` can run in float32 from now on, else why not."""
        module = _submodule(self.model, name)
        if module is None:
            return "no module to upcast"
        if not self.config.upcast:
            return "upcast=False"
        if not _float32_weights(module):
            return "the module's weights are not float32 (no autocast)"
        return None

    # -- the remedies ------------------------------------------------------------------
    def apply(self, remedy: Remedy, diag: Diagnosis, step: int) -> None:
        """Carry out ``remedy`` for ``diag`` and record it."""
        if remedy.action == "quarantine":
            self._quarantine(step, diag)
        elif remedy.action == "upcast":
            self._upcast(step, diag, remedy)
        elif remedy.action == "lower_lr":
            reset = self._reset_moments()
            self.lower_lr()
            why = f"no snapshot: LR x{self.config.lr_factor:g}, optimizer state of {reset} parameters reset"
            self.record(step, diag.cause, "lower_lr", None, why)
        else:
            self.record(step, diag.cause, remedy.action, remedy.target, remedy.reason)

    def reset_scale(self, scaler: Any) -> None:
        """A collapsed GradScaler scale back to its default."""
        scaler.update(SANE_SCALE)

    def _quarantine(self, step: int, diag: Diagnosis) -> None:
        rows = Evidence.of(diag.evidence).rows
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
            self.record(step, diag.cause, "skip", None, why if self.run_dir else "no run_dir to keep a quarantine in")
            return
        try:
            sampler.add_quarantined(self.run_dir, chosen, step=step, cause=diag.cause)
        except OSError as err:  # a full disk must not kill the run
            log.warning("nanguard: could not write the quarantine file: %r", err)
        self.record(
            step,
            diag.cause,
            "quarantine",
            sorted(set(chosen)),
            f"rows {rows} of the batch hold the bad values" if rows is not None else f"quarantine={scope!r}",
        )

    def _upcast(self, step: int, diag: Diagnosis, remedy: Remedy) -> None:
        name = remedy.target
        module = _submodule(self.model, name)
        assert module is not None and name is not None  # the policy asked can_upcast first
        upcast_module(module)
        self.upcast.append(name)
        self.record(step, diag.cause, "upcast", name, remedy.reason)

    def lower_lr(self) -> None:
        """Every group's LR (and the scheduler's ``base_lrs``) times ``lr_factor``."""
        factor = self.config.lr_factor
        self.lr_factor *= factor
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * factor
            if "initial_lr" in group:
                group["initial_lr"] = group["initial_lr"] * factor
        # A wrapper (accelerate's AcceleratedScheduler) holds the scheduler that owns base_lrs.
        scheduler = getattr(self.scheduler, "scheduler", self.scheduler)
        base_lrs = getattr(scheduler, "base_lrs", None)
        if isinstance(base_lrs, list):
            # Schedulers recompute the LR from base_lrs: scale them too, or the next
            # scheduler.step() undoes the remedy.
            scheduler.base_lrs = [lr * factor for lr in base_lrs]

    def _reset_moments(self) -> int:
        # The moments of a diverging run stay contaminated long after the spike: start them again.
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p in self.optimizer.state]
        for p in params:
            self.optimizer.state.pop(p)
        return len(params)

    def record(self, step: int, cause: str, action: str, target: Any, reason: str) -> None:
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
        return {"upcast": list(self.upcast), "lr_factor": self.lr_factor, "entries": list(self.entries)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the upcast modules (their forwards run in float32 again) and the counters.
        The lowered LR itself lives in the optimizer's state_dict."""
        self.lr_factor = float(state.get("lr_factor", 1.0))
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

    module.forward = forward


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


def with_bad_rows(diag: Diagnosis, batch: Any, n_rows: int | None) -> Diagnosis:
    """``diag`` with ``evidence["rows"]``: the batch rows holding the bad values, when a data
    diagnosis can tell them (``bad_rows``); else ``diag`` itself."""
    if diag.phase != "data" or batch is None:
        return diag
    rows = bad_rows(diag, batch, n_rows)
    if rows is None:
        return diag
    return replace(diag, evidence=replace(Evidence.of(diag.evidence), rows=rows).to_dict())


def bad_rows(diag: Diagnosis, batch: Any, n_rows: int | None) -> list[int] | None:
    """Row indices (dim 0) of ``batch`` holding the values a data diagnosis names: non-finite
    floats, or ids outside the indexed range; None when the rows cannot be told.

    Example:
        >>> bad_rows(diag, {"x": torch.tensor([[1.0], [float("nan")]])}, n_rows=2)
        [1]
    """
    origin = Evidence.of(diag.evidence).origin_or_empty
    paths = _data_paths(diag.cause, origin)
    if paths is None:
        return None
    rows_of, size = _ROWS[diag.cause], origin.indexed_size
    bad: torch.Tensor | None = None
    for leaf in _row_leaves(batch, n_rows, paths):
        rows = rows_of(leaf, leaf.detach().reshape(leaf.shape[0], -1), size)
        if rows is not None:
            bad = rows if bad is None or bad.shape != rows.shape else bad | rows
    if bad is None or not bool(bad.any()):
        return None
    return bad.nonzero().flatten().tolist()


def _data_paths(cause: str, origin: Any) -> set[str | None] | None:
    """The batch paths a data diagnosis names (None in the set: any path); None when it names no rows."""
    if cause == "data.nonfinite":
        return {origin.path}
    if cause == "data.index_out_of_range" and origin.indexed_size is not None:
        return {i.get("path") for i in origin.index_inputs}
    return None


def _row_leaves(batch: Any, n_rows: int | None, paths: set[str | None]) -> Iterator[torch.Tensor]:
    """The batch's tensors with rows (``n_rows`` of them, when known) at one of ``paths``."""
    for key_path, leaf in leaves_with_path(batch):
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or (n_rows is not None and leaf.shape[0] != n_rows):
            continue
        if None in paths or path_str("batch", key_path) in paths:
            yield leaf


def _nonfinite_rows(leaf: torch.Tensor, flat: torch.Tensor, size: int | None) -> torch.Tensor | None:
    return ~torch.isfinite(flat).all(dim=1) if leaf.is_floating_point() else None


def _out_of_range_rows(leaf: torch.Tensor, flat: torch.Tensor, size: int | None) -> torch.Tensor | None:
    if leaf.is_floating_point() or leaf.dtype == torch.bool or size is None:
        return None
    return ((flat < 0) | (flat >= size)).any(dim=1)


_ROWS: dict[str, Callable[[torch.Tensor, torch.Tensor, int | None], torch.Tensor | None]] = {
    "data.nonfinite": _nonfinite_rows,
    "data.index_out_of_range": _out_of_range_rows,
}
"""The rows of one batch tensor each data cause names, by cause (None: none in that tensor)."""
