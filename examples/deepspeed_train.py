"""A DeepSpeed engine loop guarded by nanguard: run it with torchrun (CPU: DS_ACCELERATOR=cpu).

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 examples/deepspeed_train.py --zero 2 --bad-step 3

Rank 1 gets a NaN pixel at --bad-step. The guard reads ZeRO's own gradient partitions, every rank
skips that step through the engine (``engine.skipped_steps``), and rank 0 prints the diagnosis
naming rank 1. ``--dtype bf16`` or ``fp16`` runs the engine in that precision.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

from nanguard.integrations.deepspeed import DeepSpeedGuard
from nanguard.zoo import GPT, GPTConfig, synthetic_batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--bad-step", type=int, default=3)
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args()

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vision_dim=16))
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": args.zero},
        "steps_per_print": 10**9,
    }
    if args.dtype != "fp32":
        config[args.dtype] = {"enabled": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    guard = DeepSpeedGuard(engine, policy="skip", run_dir=args.run_dir)  # the one added line
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]

    for step in range(args.steps):
        batch = synthetic_batch(model.config, torch.Generator().manual_seed(rank * 1000 + step))
        batch["pixel_values"] = batch["pixel_values"].to(dtype)
        if rank == 1 and step == args.bad_step:
            batch["pixel_values"][0, 0, :3] = float("nan")
        _, loss = engine(**batch)
        engine.backward(loss)
        engine.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}, grad norm {guard.last_grad_norm:.4g}")

    guard.close()
    if rank == 0:
        print(f"skipped {guard.skipped} (engine: {engine.skipped_steps}); last: {guard.last_diagnosis.summary()}")
    dist.barrier()  # no rank ends the group while another still talks in it (gloo aborts at exit then)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
