"""Replay a tripped step: once under the op tracer to find the origin, once more for
per-module statistics. Each rank replays with its gradient communication off, so it sees
only what its own data and compute make.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nanguard import dist
from nanguard.findings import Diagnosis
from nanguard.rng import set_rng_state
from nanguard.tracer import trace
from nanguard.tracer.replay import module_stats

__all__ = ["Replayed", "replay_trip"]


@dataclass
class Replayed:
    """What the replays of one tripped step found on this rank."""

    diagnosis: Diagnosis | None
    """This rank's located diagnosis; None when its replay stayed finite or failed."""
    located: bool
    """Whether the tracer ran to the end (False when it failed)."""
    module_stats: dict[str, Any] | None = None
    """Per-module activation absmax and grad norm, for the report."""


def replay_trip(
    model: nn.Module,
    closure: Callable[[], Any],
    *,
    batch: Any,
    rng: dict[str, torch.Tensor] | None,
    step: int,
    with_module_stats: bool,
) -> Replayed:
    """Re-run ``closure`` from the step's RNG state under the tracer; a failure of nanguard's
    own only warns, since it must not kill training.

    Example:
        >>> replayed = replay_trip(model, closure, batch=batch, rng=rng, step=7, with_module_stats=True)
        >>> replayed.diagnosis.cause
        'op.log_domain'
    """
    inner = dist.unwrap(model)
    if rng is not None:
        set_rng_state(rng)
    try:
        found = dist.replay_locally(model, lambda: trace(closure, (), {}, model=inner, inputs={"batch": batch}))
        replayed = Replayed(found, located=True)
    except Exception as err:  # the guard's own failure must not kill training
        warnings.warn(f"nanguard: locate failed on step {step}: {err!r}", stacklevel=4)
        replayed = Replayed(None, located=False)
    # Every rank replays or none does: the replays' DDP forwards may broadcast buffers.
    if with_module_stats:
        if rng is not None:
            set_rng_state(rng)
        try:
            replayed.module_stats = dist.replay_locally(model, lambda: module_stats(inner, closure))
        except Exception as err:  # evidence for the report only: never worth killing training
            warnings.warn(f"nanguard: module stats failed on step {step}: {err!r}", stacklevel=4)
    return replayed
