"""nanoGPT's training loop, guarded: gradient accumulation, GradScaler, clipping, torch.compile.

    python examples/nanogpt_guarded.py --steps 8 --bad-step 3 --compile

The loop is nanoGPT's ``train.py`` inner loop with the changes marked ``# nanguard``: the
micro-batches of a step are fetched before it (the replay needs every one of them), and
``guard.step_accumulated`` runs the micro-steps (forward under autocast in ``loss_fn``; the
backward divided by their number and scaled; ``no_sync()`` under DDP but on the last one),
checks their summed loss, unscales, clips (``clip_grad_norm=``) and steps.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch

import nanguard as ng
from nanguard.zoo import GPT, GPTConfig, synthetic_batch


def train(
    steps: int,
    *,
    bad_step: int | None = None,
    grad_clip: float = 1.0,
    accumulation: int = 4,
    compile_backend: str | None = None,
    run_dir: str | None = None,
) -> ng.Guard:
    """Train the tiny GPT nanoGPT-style; micro-batch 0 of ``bad_step`` holds a NaN image."""
    torch.manual_seed(0)
    raw = GPT(GPTConfig(vision_dim=16))
    model = torch.compile(raw, backend=compile_backend) if compile_backend else raw
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-3)
    fp16 = torch.cuda.is_available()
    scaler = torch.amp.GradScaler("cuda" if fp16 else "cpu", enabled=fp16)  # nanoGPT: enabled for float16 only
    ctx = torch.autocast("cuda", dtype=torch.float16) if fp16 else nullcontext()
    gen = torch.Generator().manual_seed(0)

    def get_batch() -> dict[str, torch.Tensor]:
        return synthetic_batch(raw.config, gen)

    guard = ng.Guard(model, optimizer, scaler=scaler, clip_grad_norm=grad_clip or None, run_dir=run_dir)  # nanguard
    for step in range(steps):
        batches = [get_batch() for _ in range(accumulation)]  # nanguard: the whole step's micro-batches
        if step == bad_step:
            batches[0]["pixel_values"][0, 0, 0] = float("nan")

        def loss_fn(batch: dict[str, torch.Tensor]) -> torch.Tensor:  # nanguard: one micro-step's forward
            with ctx:
                return model(**batch)[1]

        guard.step_accumulated(batches, loss_fn)  # nanguard: micro-steps, check, unscale, clip, step, update
    guard.close()
    return guard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--bad-step", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (inductor)")
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args()
    guard = train(
        args.steps, bad_step=args.bad_step, compile_backend="inductor" if args.compile else None, run_dir=args.run_dir
    )
    print(f"{guard.skipped} skipped; {guard.last_diagnosis}")


if __name__ == "__main__":
    main()
