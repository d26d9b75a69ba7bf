"""Gradient accumulation as one guarded step (``Guard.step_accumulated``): every micro-batch
in the closure, so the check sees their summed loss and a trip's replay re-runs all of them.

Checking only the last micro-batch's loss misses a forward overflow in an earlier one under
a GradScaler: its inf gradients look like an ordinary scaler overflow, skipped without a
diagnosis. Under DDP (or anything with ``no_sync()``) the micro-batches before the last run
inside ``no_sync()``, so gradients are all-reduced once, on the last backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["accumulation_closure", "micro_batch_list"]


def accumulation_closure(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    micro_batches: list[Any],
    loss_fn: Callable[[Any], Any],
    *,
    mean: bool,
) -> Callable[[], torch.Tensor]:
    """The closure of one accumulated step: zero the gradients, then forward (``loss_fn``) and
    backward each micro-batch, the loss divided by their number when ``mean``; returns the
    summed (divided) losses, detached, as float32.

    Example:
        >>> closure = accumulation_closure(model, optimizer, None, [b0, b1], lambda b: model(b).mean(), mean=True)
        >>> total = closure()  # (loss(b0) + loss(b1)) / 2, with both gradients accumulated
    """
    n = len(micro_batches)

    def closure() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        total: torch.Tensor | None = None
        for i, batch in enumerate(micro_batches):
            with _no_sync(model) if i < n - 1 else contextlib.nullcontext():
                loss = loss_fn(batch)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise TypeError(
                        f"loss_fn must return the micro-batch's loss as a one-element tensor, got {type(loss).__name__}"
                    )
                part = loss / n if mean else loss
                (scaler.scale(part) if scaler is not None else part).backward()
            value = part.detach().float().reshape(())
            total = value if total is None else total + value
        assert total is not None  # micro_batches is never empty
        return total

    return closure


def micro_batch_list(micro_batches: Iterable[Any], loss_fn: Any, mean: Any) -> list[Any]:
    """``Guard.step_accumulated``'s arguments, checked; returns the micro-batches as a list."""
    if not isinstance(mean, bool):
        raise ValueError(f"mean must be True (divide each loss by the number of micro-batches) or False, got {mean!r}")
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable (a micro-batch -> its loss), got {type(loss_fn).__name__}")
    if isinstance(micro_batches, (torch.Tensor, dict, str, bytes)) or not isinstance(micro_batches, Iterable):
        raise ValueError(
            f"micro_batches must be a list (or other iterable) of micro-batches, got {type(micro_batches).__name__}"
        )
    batches = list(micro_batches)
    if not batches:
        raise ValueError("micro_batches must hold at least one micro-batch, got none")
    return batches


def _no_sync(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    no_sync = getattr(model, "no_sync", None)
    return no_sync() if callable(no_sync) else contextlib.nullcontext()
