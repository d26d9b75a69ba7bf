"""Optimizer wrappers that carry their own GradScaler (Hugging Face Accelerate's
``AcceleratedOptimizer``): the guard uses that scaler, unscales the wrapped optimizer's
gradients once, and steps through the wrapper, which steps and updates the scaler itself.

Nothing here imports accelerate: a wrapper is recognized by its ``optimizer`` and ``scaler``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["guard_scaler", "scaled_optimizer", "scaler_step"]


def _carries_scaler(optimizer: Any) -> bool:
    return isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer) and (
        getattr(optimizer, "scaler", None) is not None
    )


def guard_scaler(optimizer: torch.optim.Optimizer, scaler: Any) -> Any:
    """The GradScaler the guard works with: ``scaler=``, else the one the optimizer wrapper carries.

    Example:
        >>> model, optimizer = accelerator.prepare(model, optimizer)  # mixed_precision="fp16"
        >>> guard_scaler(optimizer, None) is accelerator.scaler
        True
    """
    if not _carries_scaler(optimizer):
        return scaler
    if scaler is not None and scaler is not optimizer.scaler:  # type: ignore[attr-defined]
        raise ValueError(
            "scaler must be None or the GradScaler the optimizer already carries (accelerator.scaler): "
            "two scalers would unscale the gradients twice"
        )
    return optimizer.scaler  # type: ignore[attr-defined]


def scaled_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose gradients the scaler unscales: the wrapped one, where a wrapper steps the scaler."""
    return optimizer.optimizer if _carries_scaler(optimizer) else optimizer  # type: ignore[attr-defined]


def scaler_step(optimizer: torch.optim.Optimizer, scaler: Any) -> None:
    """``scaler.step(optimizer)`` and ``scaler.update()``; a wrapper that carries the scaler does
    both in its own ``step()`` (and records whether the scaler skipped the update)."""
    if _carries_scaler(optimizer):
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
