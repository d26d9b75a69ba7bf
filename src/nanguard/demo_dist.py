"""``nanguard demo --ranks N``: the demo under real torch.distributed (gloo ranks on CPU, DDP).

The fault hits the last rank's data only; every rank skips the same step, and the diagnosis
names the rank it came from.
"""

from __future__ import annotations

import json
import os
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from nanguard.guard import Guard
from nanguard.zoo import build, get, synthetic_batch

__all__ = ["ddp_rank_loop", "run_distributed_demo"]


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


def _worker(rank: int, world: int, init: str, fault: str, steps: int, run_dir: str | None, seed: int, out: str) -> None:
    result: dict[str, Any] = {"rank": rank}
    try:
        tdist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
        tdist.barrier()
        guard = ddp_rank_loop(fault, steps=steps, run_dir=run_dir, seed=seed)
        diag = guard.last_diagnosis
        result.update(skipped=guard.skipped, diagnosis=diag.to_dict() if diag else None)
    except Exception:
        result["error"] = traceback.format_exc()
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def run_distributed_demo(fault: str, *, steps: int, ranks: int, run_dir: str | None, seed: int = 0) -> int:
    from nanguard.findings import Diagnosis
    from nanguard.report.terminal import Console

    console = Console()
    scenario = get(fault)
    console.title(
        f"nanguard demo: {scenario.name} on {ranks} gloo ranks", f"{scenario.summary} (rank {ranks - 1} only)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(ranks, init, fault, steps, run_dir, seed, tmp), nprocs=ranks, join=True)
        results = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(ranks)]
    errors = [r for r in results if "error" in r]
    for r in errors:
        console.line(f"rank {r['rank']} failed:\n{r['error']}")
    if errors:
        return 1
    console.line("skipped per rank: " + ", ".join(f"rank {r['rank']}: {r['skipped']}" for r in results))
    diag = results[0]["diagnosis"]
    if diag is not None:
        console.diagnosis(Diagnosis.from_dict(diag))
    if run_dir is not None:
        console.line(f"events and bundles in {run_dir}; see `nanguard report {run_dir}`")
    return 0
