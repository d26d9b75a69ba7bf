"""Distributed scenarios at the edges: a NaN in one rank's FSDP2 shard, a compression hook whose
cast overflows, and a replica whose weight turned NaN behind DDP's back.

Each runs on spawned gloo ranks (``nanguard zoo --ranks 4``); ``edge_rank`` is one rank's run.
The expected fields follow from the fault: the rank and parameter it hits, and the phase
where the non-finite value is made.
"""

from __future__ import annotations

from typing import Any

import torch

from nanguard.errors import NonFiniteError
from nanguard.findings import Diagnosis
from nanguard.guard import Guard
from nanguard.zoo.scenario import Expect, Scenario, build

__all__ = ["EDGE_FAULTS", "EDGE_SCENARIOS", "edge_rank"]

_WEIGHT = "blocks.1.mlp.fc"

EDGE_SCENARIOS = (
    Scenario(
        "fsdp2_shard_nan",
        "4 ranks under FSDP2; rank 2 writes a NaN into its own shard of blocks.1.mlp.fc.weight",
        Expect("parameters.nonfinite", None, _WEIGHT, "parameters", "nan", rank=2),
        ranks=4,
        dist_fault="shard",
    ),
    Scenario(
        "fp16_compress_overflow",
        "2 ranks under DDP with fp16_compress_hook; rank 0's blocks.1.mlp.fc.weight gradient is x1e9, "
        "finite in float32 but past float16's 65504",
        Expect("precision.overflow", "fp16_compress_hook", _WEIGHT, "communication", "inf", rank=0),
        ranks=2,
        dist_fault="wire",
    ),
    Scenario(
        "nan_replica_resync",
        "2 ranks under DDP; rank 0's copy of blocks.1.mlp.fc.weight turns NaN behind DDP's back: "
        "the resync must copy rank 1's finite weights",
        Expect("distributed.replica_divergence", None, _WEIGHT, "parameters", "nan", rank=0),
        ranks=2,
        dist_fault="nan_replica",
    ),
)
EDGE_FAULTS = frozenset(s.dist_fault for s in EDGE_SCENARIOS)


def edge_rank(s: Scenario, rank: int, seed: int) -> tuple[Diagnosis | None, int | None]:
    """One rank of an edge scenario: the first diagnosis and the step it came at."""
    run = build(s, seed, rank=rank)
    model = run.model
    weight = model.blocks[1].mlp.fc.weight
    if s.dist_fault == "shard":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        net: torch.nn.Module = fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr)
        guard = Guard(net, optimizer, policy="skip", max_consecutive_skips=10**6)
        weight = model.blocks[1].mlp.fc.weight
    else:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(run.model)
        optimizer = run.optimizer
        hook = (None, fp16_compress_hook) if s.dist_fault == "wire" else None
        guard = Guard(net, optimizer, policy="skip", comm_hook=hook, max_consecutive_skips=10**6,
                      fingerprint_every=1 if s.dist_fault == "nan_replica" else 100)  # fmt: skip
    run.optimizer = optimizer
    for step in range(s.run_steps):
        handle: Any = None
        if step == s.fault_step:
            if s.dist_fault == "shard" and rank == 2:
                with torch.no_grad():
                    weight.to_local().view(-1)[0] = float("nan")
            if s.dist_fault == "wire" and rank == 0:
                handle = weight.register_hook(lambda g: g * 1e9)  # through the step and its replay
            if s.dist_fault == "nan_replica" and rank == 0:
                # The update itself goes bad on rank 0 only, just before the fingerprint check.
                handle = optimizer.register_step_post_hook(lambda *_: _spoil(weight))
        batch = run.batch(step, faulty=False)
        try:
            guard.step(run.closure(batch, net), batch=batch)
        except NonFiniteError as err:  # what a skip cannot repair escalates at once
            return err.diagnosis, step
        if handle is not None:
            handle.remove()
        if guard.last_diagnosis is not None:
            return guard.last_diagnosis, step
    return None, None


def _spoil(weight: torch.Tensor) -> None:
    with torch.no_grad():
        weight.view(-1)[0] = float("nan")
