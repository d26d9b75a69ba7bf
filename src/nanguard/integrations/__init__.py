"""Training-framework adapters: thin callbacks around ``ng.Guard``'s closure-free ``check``.

- ``nanguard.integrations.lightning.NanGuard``: a PyTorch Lightning callback
  (``pip install nanguard[lightning]``).
- ``nanguard.integrations.hf.NanGuardCallback``: a Hugging Face ``Trainer`` callback
  (``pip install nanguard[hf]``).
- ``nanguard.integrations.fabric.FabricGuard``: watches a hand-written Lightning Fabric loop
  (``pip install nanguard[lightning]``).
- ``nanguard.integrations.loop.LoopGuard``: watches a hand-written loop (nanoGPT, llm.c); no extra.
- ``nanguard.integrations.megatron.MegatronGuard``: Megatron-core's own loop, its optimizer's ``step()``
  checked (``pip install nanguard[engines]``).

All of them use ``nanguard.integrations.capture`` to record, check and replay a step.

Importing this package imports no framework; each adapter module imports its own and
raises an ImportError naming the extra when it is missing.

Example:
    >>> from nanguard.integrations.lightning import NanGuard
    >>> trainer = lightning.Trainer(callbacks=[NanGuard(policy="skip", run_dir="runs/exp1")])
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import fields
from types import ModuleType
from typing import Any

import torch
from torch import nn

from nanguard.backup import BufferBackup
from nanguard.findings import Diagnosis
from nanguard.guard import Guard, GuardConfig

__all__: list[str] = []


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module``, or raise an ImportError that says which extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"this nanguard integration needs {what}, which is not installed: pip install nanguard[{extra}]"
        ) from err


def guard_options(policy: str, options: dict[str, Any]) -> None:
    """Validate Guard options when the callback is built, not when training starts.

    Every entry point takes ``ng.Guard``'s options the same way: its keyword arguments
    (``on_event=``, ``inject=``, ``comm_hook=``, ...) and every ``GuardConfig`` field.
    """
    named = {n for n, p in inspect.signature(Guard).parameters.items() if p.kind is p.KEYWORD_ONLY}
    config = {k: v for k, v in options.items() if k not in named}
    known = named | {f.name for f in fields(GuardConfig)} - {"policy"}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"unknown Guard option(s) {unknown}; accepted: {sorted(known)}")
    GuardConfig.from_options(policy, config)
    on_event = options.get("on_event")
    if on_event is not None and not callable(on_event):
        raise ValueError(f"on_event must be None or a callable taking an event dict, got {type(on_event).__name__}")


class GuardedCallback:
    """What both framework callbacks expose about the guard they run (None until training starts)."""

    guard: Guard | None = None

    @property
    def skipped(self) -> int:
        return self.guard.skipped if self.guard is not None else 0

    @property
    def last_diagnosis(self) -> Diagnosis | None:
        return self.guard.last_diagnosis if self.guard is not None else None


def drop_grads(optimizer: torch.optim.Optimizer) -> None:
    """Make the coming ``optimizer.step()`` a no-op: torch optimizers skip params whose grad is None."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def running_stats(model: nn.Module) -> BufferBackup:
    """A backup of normalization running statistics.

    By the time the check runs, the bad forward has already updated BatchNorm-style running
    stats; a NaN batch would otherwise poison them for good.
    """
    return BufferBackup(
        [b for m in model.modules() if getattr(m, "track_running_stats", False) for b in m.buffers(recurse=False)]
    )
