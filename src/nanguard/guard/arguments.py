"""The ``Guard``'s arguments checked: a ValueError names the wrong one and what it accepts."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from nanguard.findings import Diagnosis
from nanguard.guard.config import GuardConfig
from nanguard.guard.history import History
from nanguard.guard.recovery import COUNTERS
from nanguard.guard.wrapped import guard_scaler

__all__ = ["check_parts", "check_state", "listener"]


def check_parts(model: Any, optimizer: Any, scaler: Any, scheduler: Any) -> Any:
    """The Guard's parts checked (a ValueError names the wrong one); returns the scaler to use."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if _is_deepspeed_engine(model):
        # The engine owns the step: ZeRO keeps the gradients in its own partitions (param.grad is None)
        # and only engine.step() updates the weights; a guard stepping the torch optimizer does neither.
        raise ValueError(
            "model is a DeepSpeed engine: guard it with nanguard.integrations.deepspeed.DeepSpeedGuard(engine, ...) "
            "(its step(closure) takes the same closure): it reads ZeRO's gradients, steps or skips through the engine"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    scaler = guard_scaler(optimizer, scaler)  # an Accelerate optimizer brings its own
    for obj, name, methods in [
        (scaler, "scaler", ("is_enabled", "unscale_", "step", "update", "get_scale", "state_dict")),
        (scheduler, "scheduler", ("step", "state_dict", "load_state_dict")),
    ]:
        if obj is not None and not all(callable(getattr(obj, m, None)) for m in methods):
            raise ValueError(f"{name} must be None or have the methods {', '.join(methods)}, got {type(obj).__name__}")
    return scaler


def _is_deepspeed_engine(model: nn.Module) -> bool:
    """``deepspeed.initialize``'s engine, told by its class without importing DeepSpeed."""
    return any(c.__name__ == "DeepSpeedEngine" and c.__module__.startswith("deepspeed.") for c in type(model).__mro__)


def check_state(state: Any, config: GuardConfig) -> None:
    """Check a ``Guard.state_dict()`` before any of it is applied: a ValueError names what is wrong."""
    if not isinstance(state, Mapping):
        raise ValueError(f"state must be a mapping from Guard.state_dict(), got {type(state).__name__}")
    for name in ("step_count", *COUNTERS):
        value = state.get(name, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"state[{name!r}] must be an int >= 0, got {value!r}")
    try:  # the history and the diagnosis are checked by loading them into throwaway copies
        History.from_config(config).load_state_dict(state)
        last = state.get("last_diagnosis")
        if last:
            Diagnosis.from_dict(last)
    except Exception as err:
        raise ValueError(f"cannot load the guard state (history or last_diagnosis): {err!r}") from None


def listener(on_event: Any, disabled: bool) -> Callable[[dict[str, Any]], None] | None:
    if on_event is not None and not callable(on_event):
        raise ValueError(f"on_event must be None or a callable taking an event dict, got {type(on_event).__name__}")
    return None if disabled else on_event
