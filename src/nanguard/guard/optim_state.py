"""An optimizer's state as a snapshot holds it: each rank's own shard of a sharded optimizer.

A ``ZeroRedundancyOptimizer`` keeps on each rank only the state of the parameters that rank
updates; its ``state_dict()`` first gathers every shard to one rank (``consolidate_state_dict``,
a collective on every rank). A rollback restores the same step on every rank, so each rank needs
only its own shard back: the snapshot holds the local optimizer's state, with no gather, and the
wrapper's hyperparameters (which it copies into the local optimizer at each step).
"""

from __future__ import annotations

from typing import Any

import torch

from nanguard import compat

__all__ = ["load_optimizer_state", "optimizer_state"]


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's optimizer state: ``state_dict()``, or a ZeRO optimizer's own shard.

    Example:
        >>> state = optimizer_state(zero)   # no collective
        >>> load_optimizer_state(zero, state)
    """
    local = compat.zero_local_optimizer(optimizer)
    if local is None:
        return optimizer.state_dict()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"zero_shard": local.state_dict(), "zero_groups": groups}


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Put back what ``optimizer_state`` returned (on this rank: no collective)."""
    local = compat.zero_local_optimizer(optimizer)
    if local is None:
        optimizer.load_state_dict(state)
        return
    local.load_state_dict(state["zero_shard"])
    for group, saved in zip(optimizer.param_groups, state["zero_groups"], strict=True):
        group.update(saved)
