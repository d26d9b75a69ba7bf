"""Training-framework adapters: thin callbacks around ``ng.Guard``'s closure-free ``check``.

- ``nanguard.integrations.lightning.NanGuard``: a PyTorch Lightning callback
  (``pip install nanguard[lightning]``).
- ``nanguard.integrations.hf.NanGuardCallback``: a Hugging Face ``Trainer`` callback
  (``pip install nanguard[hf]``).

Importing this package imports no framework; each adapter module imports its own and
raises an ImportError naming the extra when it is missing.

Example:
    >>> from nanguard.integrations.lightning import NanGuard
    >>> trainer = lightning.Trainer(callbacks=[NanGuard(policy="skip", run_dir="runs/exp1")])
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from nanguard import dist
from nanguard.findings import Diagnosis
from nanguard.guard import Guard, _transient
from nanguard.locate import locate
from nanguard.rng import set_rng_state

__all__: list[str] = []


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module``, or raise an ImportError that says which extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"nanguard.integrations.{extra} needs {what}, which is not installed: pip install nanguard[{extra}]"
        ) from err


def drop_grads(optimizer: torch.optim.Optimizer) -> None:
    """Skip the coming ``optimizer.step()``: torch optimizers leave params with no grad, and their state, alone."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


class BatchGuard(Guard):
    """A Guard whose replay names the batch to ``ng.locate``, so a NaN input reads as ``data.*``.

    ``Guard._diagnose`` traces the replay with no arguments, so locate cannot tell the batch
    from any other tensor and calls a NaN input ``parameters.nonfinite``. This subclass
    passes ``batch`` to locate as a named argument; it goes away once Guard does that itself.
    """

    _batch: Any = None

    def check(
        self,
        loss: Any,
        *,
        replay: Callable[[], Any] | None = None,
        batch: Any = None,
        rng: dict[str, torch.Tensor] | None = None,
    ) -> bool:
        self._batch = batch
        try:
            return super().check(loss, replay=replay, batch=batch, rng=rng)
        finally:
            self._batch = None

    def _diagnose(
        self,
        closure: Callable[[], Any] | None,
        step: int,
        rng: dict[str, torch.Tensor] | None,
        loss_value: float,
        grad_norm: float,
        bad_ranks: list[int],
    ) -> Diagnosis:
        batch = self._batch
        if closure is None or batch is None:
            return super()._diagnose(closure, step, rng, loss_value, grad_norm, bad_ranks)
        diag = None
        located = self.config.locate
        if located:
            if rng is not None:
                set_rng_state(rng)
            model = dist.unwrap(self.model)

            def run() -> Diagnosis | None:
                return locate(lambda batch: closure(), batch, model=model)

            try:
                diag = dist.replay_locally(self.model, run)
            except Exception as err:  # the guard's own failure must not kill training
                warnings.warn(f"nanguard: locate failed on step {step}: {err!r}", stacklevel=3)
        diag = dist.gather_diagnosis(diag, bad_ranks)
        if diag is None:
            diag = _transient(step, loss_value, grad_norm, bad_ranks, located=located)
        diag.step = step
        self._apply_history(diag, step)
        return diag
