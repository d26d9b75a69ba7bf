"""A litgpt-style Lightning Fabric pretraining loop, guarded: the lines marked ``# nanguard``.

    python examples/fabric_pretrain.py --steps 8 --bad-step 3
    python examples/fabric_pretrain.py --devices 2          # Fabric's DDP on 2 CPU processes

The loop has litgpt's ``pretrain`` shape: the LR set by hand each iteration, one batch per
iteration with gradient accumulation under ``fabric.no_backward_sync``, the loss computed
outside the model (``chunked_cross_entropy`` there, ``cross_entropy`` here), ``fabric.backward``,
``fabric.clip_gradients``, ``optimizer.step()``. ``FabricGuard`` checks each optimizer step
before the clip, replays a tripped step's micro-batches itself, and skips it on every rank.
The image of micro-batch 1 of ``--bad-step`` holds a NaN (on the last rank under DDP).
"""

from __future__ import annotations

import argparse
import math

import lightning as L
import torch
import torch.nn.functional as F

from nanguard.integrations.fabric import FabricGuard  # nanguard
from nanguard.zoo import GPT, GPTConfig, synthetic_batch


def train(
    fabric: L.Fabric,
    steps: int,
    *,
    bad_step: int | None,
    accumulation: int = 2,
    max_norm: float = 1.0,
    run_dir: str | None = None,
) -> FabricGuard:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vision_dim=16, n_embd=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    guard = FabricGuard(fabric, model, optimizer, policy="skip", run_dir=run_dir)  # nanguard
    gen = torch.Generator().manual_seed(fabric.global_rank)

    @guard.micro_step  # nanguard: the replay re-runs this micro-batch's forward and loss
    def loss_of(input_ids: torch.Tensor, pixel_values: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits, _ = model(input_ids, pixel_values=pixel_values)
        logits = logits[:, -targets.size(1) :]  # the text positions (the image prefix comes first)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    for iter_num in range(steps * accumulation):
        step = iter_num // accumulation
        lr = 1e-3 * 0.5 * (1 + math.cos(math.pi * step / steps))  # litgpt: the LR set by hand
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = synthetic_batch(model.module.config, gen)
        if step == bad_step and iter_num % accumulation == 1 and fabric.global_rank == fabric.world_size - 1:
            batch["pixel_values"][0, 0, 0] = float("nan")
        is_accumulating = (iter_num + 1) % accumulation != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            loss = loss_of(batch["input_ids"], batch["pixel_values"], batch["labels"])
            fabric.backward(loss / accumulation)
        if not is_accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=max_norm)
            optimizer.step()  # skipped by the guard when the step tripped
            optimizer.zero_grad()
    guard.close()  # nanguard
    return guard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--bad-step", type=int, default=3)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args()
    strategy = "ddp" if args.devices > 1 else "auto"
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    guard = train(fabric, args.steps, bad_step=args.bad_step, run_dir=args.run_dir)
    diag = guard.last_diagnosis
    fabric.print(f"{guard.skipped} skipped; {diag.summary() if diag else 'no trip'}")
    if torch.distributed.is_initialized():  # gloo's threads left at exit can abort the process
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
