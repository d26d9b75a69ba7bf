"""Cost of ``ng.locate`` against the plain step on the tiny GPT: ratio of medians, interleaved.

Run: ``.venv/bin/python benchmarks/locate_cost.py [--rounds N]``; writes BENCHMARKS.md.
"""

from __future__ import annotations

import argparse

import torch

import nanguard as ng
from _common import interleaved, machine, write_section
from nanguard.zoo import GPT, GPTConfig, synthetic_batch, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    rows = []
    for label, cfg in (
        ("tiny GPT (the zoo's default)", GPTConfig()),
        ("small GPT", GPTConfig(n_layer=4, n_embd=384, n_head=6, block_size=64)),
    ):
        torch.manual_seed(0)
        model = GPT(cfg)
        batch = synthetic_batch(cfg, torch.Generator().manual_seed(0))
        times = interleaved(
            {
                "plain": lambda model=model, batch=batch: train_step(model, batch),
                "locate": lambda model=model, batch=batch: ng.locate(train_step, model, batch, model=model),
            },
            rounds=args.rounds,
        )
        shape = f"{cfg.n_layer} layers, d={cfg.n_embd}, T={cfg.block_size}, batch 8"
        rows.append(
            f"| {label}: {shape} | {times['plain'] * 1e3:.1f} | {times['locate'] * 1e3:.1f} | "
            f"{times['locate'] / times['plain']:.2f}x |"
        )
    table = "\n".join(rows)
    body = f"""## Locate replay cost

`ng.locate(step)` against the plain step (float32 forward + backward), median of {args.rounds} interleaved
rounds. Target: <= 3x one training step. The tracer's cost is per op, so the ratio falls as ops get bigger.

| model | plain step ms | locate ms | ratio |
|---|---:|---:|---:|
{table}

Machine: {machine()}. Reproduce: `make bench` or `.venv/bin/python benchmarks/locate_cost.py`."""
    write_section("locate-cost", body)
    print(body)


if __name__ == "__main__":
    main()
