"""What sampling the precursors costs: a guarded step with the precursors sampled against the same guarded
step without them (``precursor_every=0``), interleaved, median of the paired ratios. The cost at the default
(``precursor_every=20``) is the sampled step's extra time over 20 steps. ``--write`` replaces the
``precursor-cost`` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import nanguard as ng
from _common import machine, write_section
from nanguard.guard.config import GuardConfig
from nanguard.zoo.gpt import GPT, GPTConfig, synthetic_batch

SIZES = {
    "tiny GPT (2 layers, d=128, T=32, batch 8)": GPTConfig(),
    "GPT (4 layers, d=256, T=128, batch 8)": GPTConfig(n_layer=4, n_embd=256, block_size=128),
}


def _step(config: GPTConfig, every: int) -> Callable[[], None]:
    torch.manual_seed(0)
    model = GPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = synthetic_batch(config, torch.Generator().manual_seed(0))
    guard = ng.Guard(model, opt, precursor_every=every, headroom_every=0)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        _, loss = model(**batch)
        loss.backward()
        return loss

    return lambda: guard.step(closure)


def paired(config: GPTConfig, rounds: int) -> tuple[float, float]:
    """(median seconds of a plain guarded step, median ratio sampled / plain)."""
    plain, sampled = _step(config, 0), _step(config, 1)  # every=1: every step from step 1 on is sampled
    for _ in range(3):
        plain()
        sampled()
    times, ratios = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        plain()
        middle = time.perf_counter()
        sampled()
        end = time.perf_counter()
        times.append(middle - start)
        ratios.append((end - middle) / (middle - start))
    return statistics.median(times), statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--write", action="store_true", help="replace BENCHMARKS.md's precursor-cost section")
    args = parser.parse_args()
    torch.set_num_threads(1)
    every = GuardConfig().precursor_every
    rows = []
    for name, config in SIZES.items():
        seconds, ratio = paired(config, args.rounds)
        rows.append(f"| {name} | {seconds * 1e3:.1f} | +{(ratio - 1) * 100:.1f}% | +{(ratio - 1) * 100 / every:.2f}% |")
        print(rows[-1], flush=True)
    conditions = (
        "Guarded AdamW step with the precursors sampled against the same guarded step without them, interleaved, "
        f"{args.rounds} rounds, median of the paired ratios:"
    )
    body = f"""## Precursor sampling cost

{conditions}

| model | plain guarded step (ms) | a sampled step | at the default (every {every} steps) |
|---|---:|---:|---:|
{chr(10).join(rows)}

Target: <= 1% of a step at the default sampling. A sampled step installs its hooks, runs its forward under the
capture mode (a Python call per torch function, in the modules the first sample found its measurements in: the
attention modules, the output layer, the root where the loss runs; the attention's `amax`, log Z, each layer's
RMS), copies the weights before the update, and after it takes four foreach norms (the old weights, the update,
the new weights, Adam's second moment) and sums them per module in one `index_add`: Adam's update per unit of LR
is read from the update itself, its decoupled decay taken out through those norms, not recomputed from m and v
(which took six more passes over the state). The steps in between run nothing of the check (the guard compares
its step count with the next sampled step). On a tiny CPU model a kernel per tensor per pass and the per-call
Python cost weigh most; on a model of real size on a GPU they are a smaller share of the step.

Machine: {machine()}. Reproduce: `.venv/bin/python benchmarks/precursor_cost.py --write`."""
    print(body)
    if args.write:
        write_section("precursor-cost", body)


if __name__ == "__main__":
    main()
