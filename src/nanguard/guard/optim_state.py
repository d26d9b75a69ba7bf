"""An optimizer's state as a snapshot holds it: each rank's own shard of a sharded optimizer.

A ``ZeroRedundancyOptimizer`` keeps on each rank only the state of the parameters that rank
updates; its ``state_dict()`` first gathers every shard to one rank (``consolidate_state_dict``,
a collective on every rank). A rollback restores the same step on every rank, so each rank needs
only its own shard back: the snapshot holds the local optimizer's state, with no gather, and the
wrapper's hyperparameters (which it copies into the local optimizer at each step).

A container of optimizers (torchtitan's ``OptimizersContainer``, one optimizer per model part and
kind) is held as its optimizers' own states: its ``state_dict()`` first runs a zero-LR step on an
optimizer with no state yet, which counts a step and changes the run's first real update.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from nanguard import compat

__all__ = ["group_settings", "load_optimizer_state", "optimizer_state", "set_group_settings"]


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's optimizer state: ``state_dict()``, or a ZeRO optimizer's own shard.

    Example:
        >>> state = optimizer_state(zero)   # no collective
        >>> load_optimizer_state(zero, state)
    """
    inner = _contained(optimizer)
    if inner is not None:
        return {"contained": [torch.optim.Optimizer.state_dict(o) for o in inner]}
    local = compat.zero_local_optimizer(optimizer)
    if local is None:
        return optimizer.state_dict()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"zero_shard": local.state_dict(), "zero_groups": groups}


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Put back what ``optimizer_state`` returned (on this rank: no collective)."""
    inner = _contained(optimizer)
    if inner is not None:
        for o, saved in zip(inner, state["contained"], strict=True):
            torch.optim.Optimizer.load_state_dict(o, saved)
        return
    local = compat.zero_local_optimizer(optimizer)
    if local is None:
        optimizer.load_state_dict(state)
        return
    local.load_state_dict(state["zero_shard"])
    for group, saved in zip(optimizer.param_groups, state["zero_groups"], strict=True):
        group.update(saved)


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """A copy of each parameter group's settings (the LR, momentum... what a scheduler sets), every group
    of a container's optimizers in turn.

    Example:
        >>> group_settings(torch.optim.SGD(model.parameters(), lr=0.1))[0]["lr"]
        0.1
    """
    groups = [g for o in (_contained(optimizer) or [optimizer]) for g in o.param_groups]
    return [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in groups]


def set_group_settings(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]]) -> None:
    """Put back what ``group_settings`` returned."""
    groups = [g for o in (_contained(optimizer) or [optimizer]) for g in o.param_groups]
    for group, saved in zip(groups, settings, strict=True):
        group.update(copy.deepcopy(saved))


def current_lr(optimizer: torch.optim.Optimizer) -> Any:
    """The learning rate of ``optimizer``'s first parameter group; of a container's first optimizer
    (its own groups carry none: a scheduler sets its optimizers' rates). None when it has none.

    Example:
        >>> current_lr(torch.optim.SGD(model.parameters(), lr=0.1))
        0.1
    """
    groups = optimizer.param_groups
    lr = groups[0].get("lr") if groups else None
    inner = _contained(optimizer) if lr is None else None
    return inner[0].param_groups[0].get("lr") if inner and inner[0].param_groups else lr


def _contained(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer] | None:
    """The optimizers a container steps (``optimizer.optimizers``), or None for a plain optimizer."""
    inner = vars(optimizer).get("optimizers")
    if isinstance(inner, list) and inner and all(isinstance(o, torch.optim.Optimizer) for o in inner):
        return inner
    return None
