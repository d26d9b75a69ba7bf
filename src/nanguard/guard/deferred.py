"""The deferred path (``GuardConfig.sync``): a step's health is read one call late.

With a fused optimizer (``found_inf``) on CUDA, the optimizer skips a bad update on the device,
so the host need not wait for the step's flags: they travel to the host behind the update
(``HostCopy``) and the step is decided with the next call, as the immediate path would have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nanguard.guard.attempt import Attempt
from nanguard.guard.config import GuardConfig
from nanguard.guard.health import HostCopy

__all__ = ["Waiting", "deferred_mode"]


@dataclass(frozen=True)
class Waiting:
    """A deferred step whose flags are on their way to the host, and the attempt its replay needs."""

    attempt: Attempt
    copy: HostCopy


def deferred_mode(
    config: GuardConfig, optimizer: torch.optim.Optimizer, scaler: Any, fused: bool, cuda: list[int]
) -> bool:
    """Whether ``step`` reads each step's health one step late (``GuardConfig.sync``)."""
    fits = fused and scaler is None and config.clip_grad_norm is None and not config.skip_spikes
    if config.sync == "deferred" and not fits:
        raise ValueError(
            "sync='deferred' needs an optimizer that takes found_inf (fused=True Adam, AdamW or SGD), no "
            f"GradScaler, clip_grad_norm=None and skip_spikes=False; got {type(optimizer).__name__} "
            f"(fused={fused}), scaler={scaler is not None}, clip_grad_norm={config.clip_grad_norm}, "
            f"skip_spikes={config.skip_spikes}; use sync='immediate' or 'auto'"
        )
    return config.sync == "deferred" or (config.sync == "auto" and fits and bool(cuda))
