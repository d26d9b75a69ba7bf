"""A 2-process Lightning Fabric DDP loop on CPU whose forward makes a NaN on one rank only.

Run as ``python tests/_fabric_ddp_script.py OUT_DIR BAD_RANK``; Fabric's ``ddp`` strategy
re-launches this script for rank 1. The loop is litgpt's shape: gradient accumulation under
``fabric.no_backward_sync``, ``fabric.backward``, ``fabric.clip_gradients``, ``optimizer.step()``.
At step 1, micro-batch 1 (the one whose backward all-reduces), BAD_RANK's batch holds a large
but finite input, so ``torch.log`` in ``block.act`` makes the NaN. Each rank writes
``OUT_DIR/rank{r}.json`` with what its guard saw and a fingerprint of its final weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn

from nanguard import dist
from nanguard.integrations.fabric import FabricGuard

ACCUM = 2
STEPS = 4
BAD = (1, 1)


class LogAct(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x + 100.0)  # a log of a negative value once x < -100


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.act = LogAct()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = Block()
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.head(self.block.act(self.block.fc(x))), y)


def main(out: Path, bad_rank: int) -> None:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    model = Net()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    guard = FabricGuard(fabric, model, optimizer, policy="skip", run_dir=out / "run")
    for it in range(STEPS * ACCUM):
        step, micro = divmod(it, ACCUM)
        accumulating = micro != ACCUM - 1
        gen = torch.Generator().manual_seed(fabric.global_rank * 100 + it)
        x = torch.randn(4, 8, generator=gen)
        y = x.sum(1, keepdim=True)
        if (step, micro) == BAD and fabric.global_rank == bad_rank:
            x[0] = 1e4
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = model(x, y)
            fabric.backward(loss / ACCUM)
        if not accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
    guard.close()
    diag = guard.last_diagnosis
    user = model.module
    first = next(iter(optimizer.state.values()), {})
    report = {
        "rank": fabric.global_rank,
        "world_size": dist.world_size(),
        "steps": STEPS,
        "skipped": guard.skipped,
        "cause": diag.cause if diag else None,
        "op": diag.op if diag else None,
        "module": diag.module if diag else None,
        "diag_rank": diag.rank if diag else None,
        "diag_ranks": diag.ranks if diag else None,
        "diag_step": diag.step if diag else None,
        "finite": all(bool(torch.isfinite(p).all()) for p in user.parameters()),
        "fingerprint": dist.fingerprint(user),
        "adam_steps": int(first["step"]) if "step" in first else None,
    }
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))
    # Gloo's threads still running at interpreter exit abort the process now and then
    # ("terminate called without an active exception"): end the group as a real script does.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
