"""``nanguard demo`` on real torch.distributed ranks (gloo on CPU, DDP).

A single-process fault hits the last rank's data only; a distributed scenario applies its
own fault (bad data on one rank, gradients corrupted in transit, one replica changed behind
DDP's back). Every rank skips the same step, and the diagnosis names the rank it came from.
"""

from __future__ import annotations

from typing import Any

import torch

from nanguard.guard import Guard
from nanguard.zoo import build, get
from nanguard.zoo.dist_scenarios import EDGE_FAULTS, edge_rank
from nanguard.zoo.runner import CorruptOnce
from nanguard.zoo.spawn import RanksFailed, spawn_ranks

__all__ = ["demo_rank", "run_distributed_demo"]


def demo_rank(rank: int, world: int, fault: str, steps: int, run_dir: str | None, seed: int) -> dict[str, Any]:
    """One rank's guarded DDP loop on the tiny GPT (run under an initialized process group)."""
    from torch.nn.parallel import DistributedDataParallel

    scenario = get(fault)
    if scenario.dist_fault in EDGE_FAULTS:  # FSDP2 shards, a compression hook, a resync: loops of their own
        diag, _ = edge_rank(scenario, rank, seed)
        return {"rank": rank, "skipped": None, "diagnosis": diag.to_dict() if diag else None}
    kind = scenario.dist_fault or "data"
    last = rank == world - 1
    run = build(scenario, seed, rank=rank)
    ddp = DistributedDataParallel(run.model)
    hook = CorruptOnce()
    guard = Guard(
        ddp,
        run.optimizer,
        policy="skip",
        scaler=run.scaler,
        run_dir=run_dir,
        comm_hook=(None, hook) if kind == "comm" else None,
        fingerprint_every=1 if kind == "replica" else 100,
        max_consecutive_skips=10**6,
    )
    for step in range(steps):
        if step == scenario.fault_step and kind == "comm":
            hook.at_call = hook.calls + 1
        if step == scenario.fault_step and kind == "replica" and last:
            with torch.no_grad():
                run.model.blocks[1].mlp.fc.weight.mul_(1.01)
        batch = run.batch(step, faulty=kind == "data" and last)
        guard.step(run.closure(batch, ddp), batch=batch)
    guard.close()
    diag = guard.last_diagnosis
    return {"rank": rank, "skipped": guard.skipped, "diagnosis": diag.to_dict() if diag else None}


def run_distributed_demo(fault: str, *, steps: int, ranks: int, run_dir: str | None, seed: int = 0) -> int:
    """Spawn ``ranks`` gloo ranks, run the demo on each, print the agreed diagnosis once."""
    from nanguard.findings import Diagnosis
    from nanguard.report.terminal import Console

    console = Console()
    scenario = get(fault)
    where = "" if scenario.dist_fault else f" (rank {ranks - 1} only)"
    console.title(f"nanguard demo: {scenario.name} on {ranks} gloo ranks", f"{scenario.summary}{where}")
    console.line(f"spawning {ranks} ranks on CPU...")
    try:
        results = spawn_ranks(demo_rank, fault, steps, run_dir, seed, world=ranks)
    except RanksFailed as err:
        console.line(str(err))
        return 1
    console.line("skipped per rank: " + ", ".join(f"rank {r['rank']}: {_count(r['skipped'])}" for r in results))
    shown = next((r["diagnosis"] for r in results if r["diagnosis"] is not None), None)
    if shown is not None:
        console.diagnosis(Diagnosis.from_dict(shown))
    elif scenario.expect.cause is not None:
        console.line(f"no trip in {steps} steps; the fault hits at step {scenario.trip_step}: raise --steps")
        return 1
    if run_dir is not None:
        console.line(f"events and bundles in {run_dir}; see `nanguard report {run_dir}`")
    return 0


def _count(skipped: int | None) -> str:
    return "-" if skipped is None else str(skipped)
