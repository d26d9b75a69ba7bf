"""The attempt: one run of the step's forward and backward, and the record of it.

An ``Attempt`` holds what the rest of the step needs to measure, replay, record and undo it:
the step index, the batch, the RNG state from before the forward, the closure to replay,
the index error a CPU forward raised, and whether the guard took a buffer backup before the
forward (``step()`` does; ``check()`` comes after the loop's own backward, so it does not).
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nanguard import compat, dist
from nanguard.dist import CommWatch
from nanguard.errors import NonFiniteError
from nanguard.guard.health import HealthCheck
from nanguard.guard.recovery import Recovery
from nanguard.guard.wrapped import scaled_optimizer
from nanguard.tracer import error_origin
from nanguard.tracer.headroom import HeadroomCheck

__all__ = ["Attempt", "Rng", "Runner", "check_args", "loss_value", "scaler_aside", "unscale"]

log = logging.getLogger("nanguard")

Rng = Mapping[str, torch.Tensor]


@dataclass(slots=True)
class Attempt:
    """One attempt at a step, from before its forward to its recorded outcome.

    Example:
        >>> attempt = Attempt(step=7, call=7, batch=batch, rng=get_rng_state(), replay=closure, owns_buffers=True)
    """

    step: int
    """The index the step is checked as (``Guard.step_count`` before it)."""
    call: int
    """The step index the ranks agree on (this rank's ``Guard.step``/``check`` calls before it)."""
    batch: Any
    rng: Rng | None
    """The RNG state from before the forward: the replay draws the same numbers."""
    replay: Callable[[], Any] | None
    """Re-runs the forward and backward: the step's closure, or ``check()``'s ``replay``."""
    owns_buffers: bool
    """The guard backed up the buffers before the forward (``step()``), so an undo restores them and the RNG."""
    loss: Any = None
    """What the closure returned (``step()`` returns it)."""
    value: Any = None
    """The loss as the health check reads it."""
    closure_error: BaseException | None = None
    """The out-of-range index error a CPU forward raised; the replay decides whether it was the data's."""
    unscaled: bool = False
    """The scaler's ``unscale_`` ran for this step (an undo closes it)."""
    loop_norm: Any = None
    """The gradients' norm the loop's own clip computed before scaling them (``check(grad_norm=)``):
    the step's recorded grad norm, where the norm of the clipped gradients would stay at the clip."""


class Runner:
    """Runs an attempt's forward and backward, and undoes it when it raises.

    Example:
        >>> Runner(model, optimizer, None, health, headroom, recovery, locate=True).run(attempt)
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: Any,
        health: HealthCheck,
        headroom: HeadroomCheck,
        recovery: Recovery,
        *,
        locate: bool,
        device: torch.device | None,
    ) -> None:
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.health, self.headroom, self.recovery = health, headroom, recovery
        self.locate = locate
        self.device = device

    def run(self, attempt: Attempt) -> None:
        """The closure, then the scaler's unscale: ``attempt.loss``, ``.value`` and ``.closure_error``."""
        closure, health = attempt.replay, self.health
        assert closure is not None
        if type(health.comm) is not CommWatch:  # (the plain watch keeps nothing between steps)
            health.comm.reset()
        try:
            if health.rides or self.headroom.due(attempt.step) or not torch.is_grad_enabled():
                with torch.enable_grad(), health.riding(attempt.call), self.headroom.watch(attempt.step):
                    loss = attempt.loss = closure()
            else:  # the common step, without three context managers around the closure
                if health.unchecked:
                    health.check_loaded()
                loss = attempt.loss = closure()
            # A plain one-element tensor is the loss as the check reads it: ``loss_value``'s common case.
            one = type(loss) is torch.Tensor and loss.numel() == 1
            attempt.value = loss if one else loss_value(loss, "the closure's return value", allow_none=False)
        except (IndexError, RuntimeError) as err:
            if not _index_error(err):
                raise
            if dist.is_distributed():
                # The other ranks are already in the gradient all-reduce: joining them is
                # impossible, so fail loudly rather than hang. check_batch=True catches it first.
                log.error(
                    "nanguard: the forward raised on rank %d; use Guard(check_batch=True) under "
                    "torch.distributed to catch out-of-range ids before the forward",
                    dist.rank(),
                )
                raise
            # An out-of-range id raises on CPU. This rank still joins the agreement, flagged
            # by a NaN loss, and its replay turns the error into a data diagnosis.
            dist.zero_grad(self.model)
            attempt.loss = attempt.value = torch.full((), math.nan, device=self.device)
            attempt.closure_error = err
        if self.scaler is not None:
            unscale(self.scaler, self.optimizer)
        attempt.unscaled = True

    def update_on_device(self, found_inf: torch.Tensor) -> None:
        """The device path's update: the fused optimizer steps now, skipping it on the device where
        ``found_inf`` (agreed across ranks) says any rank's step is bad."""
        compat.step_with_found_inf(self.optimizer, found_inf)

    def undo(self, attempt: Attempt, err: BaseException, *, name_origin: bool) -> None:
        """An error in the closure or a replay (even ``KeyboardInterrupt``) leaves no trace of the
        step; the policy's own ``NonFiniteError`` comes after the state was restored.

        With ``name_origin``, a closure that raised after making NaN/Inf (a distribution's
        validate_args, multinomial) still raises, unchanged but for one note naming the origin,
        found by a replay after the undo. Single process only: a replay on the one rank that
        raised could wait on the others.
        """
        if isinstance(err, NonFiniteError):
            return
        assert attempt.rng is not None
        self.recovery.undo(attempt.rng, unscaled=attempt.unscaled)
        closure = attempt.replay
        if not name_origin or not isinstance(err, Exception) or closure is None:
            return
        if self.locate and not dist.is_distributed():
            note = error_origin(closure, err, model=dist.unwrap(self.model))
            self.recovery.undo(attempt.rng, unscaled=False)  # the replay ran the closure again
            if note is not None and hasattr(err, "add_note"):  # Python 3.11+: 3.10 keeps the error as it was
                err.add_note(note)


def check_args(loss: Any, replay: Any, rng: Any, grad_norm: Any = None) -> Any:
    """``check()``'s arguments; returns the loss as the health check reads it."""
    if grad_norm is not None and not (
        (isinstance(grad_norm, torch.Tensor) and grad_norm.numel() == 1)
        or (isinstance(grad_norm, numbers.Real) and not isinstance(grad_norm, bool))
    ):
        raise ValueError(
            "grad_norm must be None or the norm clip_grad_norm_ returned (a one-element tensor or a number), "
            f"got {type(grad_norm).__name__}"
        )
    if replay is not None and not callable(replay):
        raise ValueError(f"replay must be callable or None, got {type(replay).__name__}")
    if rng is not None and not isinstance(rng, Mapping):
        raise ValueError(f"rng must be a dict from nanguard.rng.get_rng_state() or None, got {type(rng).__name__}")
    return loss_value(loss, "loss", allow_none=True)


def loss_value(loss: Any, name: str, *, allow_none: bool) -> Any:
    """The loss as the health check reads it: a number or a one-element tensor. A larger
    tensor reads as its mean, or, when any element is NaN/Inf, as a non-finite value."""
    if loss is None and allow_none:
        return None
    if isinstance(loss, torch.Tensor):
        n = loss.numel()
        if n == 0:
            raise ValueError(f"{name} is an empty tensor; it must hold the loss")
        if n == 1:
            return loss
        x = loss.detach().float()
        return torch.where(torch.isfinite(x).all(), x.mean(), x.sum())  # any NaN/Inf makes the sum non-finite
    if isinstance(loss, numbers.Real) and not isinstance(loss, bool):
        return loss
    raise TypeError(f"{name} must be the loss (a tensor or a number), got {type(loss).__name__}")


def unscale(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Unscale the gradients once: a loop that unscaled already (to clip) is not an error."""
    optimizer = scaled_optimizer(optimizer)  # where the scaler keeps its per-optimizer state
    if scaler is not None and not compat.scaler_unscaled(scaler, optimizer):
        scaler.unscale_(optimizer)


def scaler_aside(scaler: Any, replay: Callable[[], Any] | None) -> Callable[[], Any] | None:
    """The replay re-runs a closure that may unscale itself (to clip): this step's unscale_ is still open."""
    if scaler is None or replay is None:
        return replay

    def run() -> Any:
        with compat.scaler_steps_aside(scaler):
            return replay()

    return run


def _index_error(err: BaseException) -> bool:
    """An error an out-of-range index raises on CPU (CUDA asserts on the device instead)."""
    if isinstance(err, IndexError):
        return True
    text = str(err).lower()
    return "out of bounds" in text or "out of range" in text
