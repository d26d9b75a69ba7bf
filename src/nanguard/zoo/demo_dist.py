"""``nanguard demo --ranks N``: the demo under real torch.distributed (gloo ranks on CPU, DDP).

The fault hits the last rank's data only; every rank skips the same step, and the diagnosis
names the rank it came from.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as tdist

from nanguard.guard import Guard
from nanguard.zoo import build, get, synthetic_batch
from nanguard.zoo.spawn import RanksFailed, spawn_ranks

__all__ = ["ddp_rank_loop", "demo_rank", "run_distributed_demo"]


def ddp_rank_loop(fault: str, *, steps: int, run_dir: str | None, seed: int = 0, **guard_config: Any) -> Guard:
    """One rank's guarded DDP loop on the tiny GPT; the fault hits the last rank's batch.

    Needs an initialized process group. Each rank draws its own data; the model starts
    identical everywhere.
    """
    rank, world = tdist.get_rank(), tdist.get_world_size()
    scenario = get(fault)
    run = build(scenario, seed)
    model = torch.nn.parallel.DistributedDataParallel(run.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=scenario.lr)
    guard = Guard(model, optimizer, policy="skip", run_dir=run_dir, **guard_config)
    for step in range(steps):
        batch = synthetic_batch(run.model.config, torch.Generator().manual_seed(seed * 7919 + rank * 1000 + step))
        if rank == world - 1 and step == scenario.fault_step and scenario.fault is not None:
            batch = scenario.fault(run.model, batch)

        def closure(batch: dict[str, torch.Tensor] = batch) -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            _, loss = model(**batch)
            loss.backward()
            return loss

        guard.step(closure, batch=batch)
    guard.close()
    return guard


def demo_rank(rank: int, world: int, fault: str, steps: int, run_dir: str | None, seed: int) -> dict[str, Any]:
    guard = ddp_rank_loop(fault, steps=steps, run_dir=run_dir, seed=seed)
    diag = guard.last_diagnosis
    return {"rank": rank, "skipped": guard.skipped, "diagnosis": diag.to_dict() if diag else None}


def run_distributed_demo(fault: str, *, steps: int, ranks: int, run_dir: str | None, seed: int = 0) -> int:
    from nanguard.findings import Diagnosis
    from nanguard.report.terminal import Console

    console = Console()
    scenario = get(fault)
    console.title(
        f"nanguard demo: {scenario.name} on {ranks} gloo ranks", f"{scenario.summary} (rank {ranks - 1} only)"
    )
    try:
        results = spawn_ranks(demo_rank, fault, steps, run_dir, seed, world=ranks)
    except RanksFailed as err:
        console.line(str(err))
        return 1
    console.line("skipped per rank: " + ", ".join(f"rank {r['rank']}: {r['skipped']}" for r in results))
    diag = results[0]["diagnosis"]
    if diag is not None:
        console.diagnosis(Diagnosis.from_dict(diag))
    if run_dir is not None:
        console.line(f"events and bundles in {run_dir}; see `nanguard report {run_dir}`")
    return 0
