"""A 2-process Lightning DDP run on CPU with a NaN sample that only rank 1 sees.

Run as ``python tests/_lightning_ddp_script.py OUT_DIR``; Lightning's ``ddp`` strategy
re-launches this script for rank 1. Each rank writes ``OUT_DIR/rank{r}.json`` with what
its NanGuard callback saw and a fingerprint of its final weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from nanguard import dist
from nanguard.integrations.lightning import NanGuard

BATCH = 4
BAD_STEP = 2
STEPS = 5


class Regression(Dataset):
    """x -> sum(x), different data per rank; rank 1's batch BAD_STEP holds a NaN."""

    def __init__(self, rank: int) -> None:
        gen = torch.Generator().manual_seed(rank)
        self.x = torch.randn(BATCH * STEPS, 8, generator=gen)
        self.y = self.x.sum(1, keepdim=True)
        if rank == 1:
            self.x[BATCH * BAD_STEP, 3] = float("nan")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Regression(self.global_rank), batch_size=BATCH)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main(out: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    guard_cb = NanGuard(policy="skip", run_dir=out / "run")
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        callbacks=[guard_cb],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model)
    diag = guard_cb.last_diagnosis
    params = list(model.parameters())
    first = next(iter(trainer.optimizers[0].state.values()), {})
    report = {
        "rank": trainer.global_rank,
        "world_size": dist.world_size(),
        "finished": trainer.state.finished,
        "global_step": trainer.global_step,
        "skipped": guard_cb.skipped,
        "cause": diag.cause if diag else None,
        "diag_rank": diag.rank if diag else None,
        "diag_ranks": diag.ranks if diag else None,
        "diag_step": diag.step if diag else None,
        "flagged_ranks": diag.evidence.get("flagged_ranks") if diag else None,
        "finite": all(bool(torch.isfinite(p).all()) for p in params),
        "fingerprint": dist.fingerprint(model),
        "adam_steps": int(first["step"]) if "step" in first else None,
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))
    # Gloo's threads still running at interpreter exit abort the process now and then
    # ("terminate called without an active exception"): end the group as a real script does.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
