"""A guarded DDP training script: run it with torchrun.

    torchrun --nproc-per-node 2 examples/ddp_train.py --run-dir runs/ddp --bad-step 2

Rank 1 gets a NaN pixel at --bad-step; every rank skips that step, and rank 0 prints the
diagnosis naming rank 1.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import nanguard as ng
from nanguard.zoo import GPT, GPTConfig, synthetic_batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--bad-step", type=int, default=3)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vision_dim=16))
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    guard = ng.Guard(ddp, optimizer, policy="skip", run_dir=args.run_dir)

    for step in range(args.steps):
        batch = synthetic_batch(model.config, torch.Generator().manual_seed(rank * 1000 + step))
        if rank == 1 and step == args.bad_step:
            batch["pixel_values"][0, 0, :3] = float("nan")

        def closure(batch=batch):
            optimizer.zero_grad(set_to_none=True)
            _, loss = ddp(**batch)
            loss.backward()
            return loss

        loss = guard.step(closure, batch=batch)
        if rank == 0:
            status = f"loss {loss.item():.4f}" if loss is not None else f"skipped ({guard.last_action})"
            print(f"step {step}: {status}")
    guard.close()
    if rank == 0 and guard.last_diagnosis is not None:
        print(guard.last_diagnosis)
    dist.barrier()  # no rank ends the group while another still talks in it (gloo aborts at exit then)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
