"""A disabled guard (``NANGUARD_DISABLE=1``): the step the loop would run without nanguard.

No check, no files: the closure, the GradScaler's unscale, the clip (``clip_grad_norm``), the
gradient norm the loop reads (``Guard.last_grad_norm``), and the optimizer's step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nanguard.guard.apply import Apply
from nanguard.guard.attempt import unscale
from nanguard.guard.health import loop_grad_norm
from nanguard.guard.progress import Progress
from nanguard.guard.wrapped import scaler_step

__all__ = ["Disabled"]


class Disabled:
    """The step and check of a disabled guard.

    Example:
        >>> Disabled(optimizer, None, Progress(), apply).step(closure)   # the closure's loss
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: Any, progress: Progress, apply: Apply) -> None:
        self.optimizer, self.scaler, self.progress, self.apply = optimizer, scaler, progress, apply

    def step(self, closure: Callable[[], Any]) -> Any:
        """What the loop would do without nanguard: run ``closure``, then step the optimizer."""
        self.progress.step += 1
        self.progress.action = "step"
        loss = closure()
        self.check()
        if self.scaler is not None:
            scaler_step(self.optimizer, self.scaler)
        else:
            self.optimizer.step()
        return loss

    def check(self) -> None:
        """The guard's share of the step, as the loop would write it without nanguard: the scaler's
        unscale, the clip (``clip_grad_norm``) and the gradient norm the loop reads."""
        unscale(self.scaler, self.optimizer)
        self.progress.grad_norm = loop_grad_norm(self.apply.clip_params(), self.apply.config.clip_grad_norm)
