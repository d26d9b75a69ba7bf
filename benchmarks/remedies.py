"""Remedies: skip vs rollback vs auto on the remedy scenarios, and the cost of ``headroom_every``.

Run: ``.venv/bin/python benchmarks/remedies.py [--rounds N]``; writes the "remedies" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import torch

from _common import machine, write_section
from nanguard.tracer.headroom import measure_headroom
from nanguard.zoo import GPT, GPTConfig, synthetic_batch, train_step
from nanguard.zoo.remedy_scenarios import REMEDY_SCENARIOS, score_policies

DEFAULT_EVERY = 100  # GuardConfig.headroom_every


def _scores() -> tuple[str, str]:
    """The scores' table, and the scenarios described."""
    rows = score_policies()
    lines = [
        "| scenario | policy | finished, finite weights | final loss | skipped | rollbacks | remedies |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        ok = "yes" if r["ok"] else f"no ({r['stopped_by']})"
        lines.append(
            f"| {r['scenario']} | {r['policy']} | {ok} | {r['final_loss']:.3g} | {r['skipped']} | "
            f"{r['rollbacks']} | {', '.join(r['remedies']) or '-'} |"
        )
    described = "\n".join(f"- `{s.name}`: {s.description}." for s in REMEDY_SCENARIOS)
    return "\n".join(lines), described


def _headroom_cost(rounds: int) -> tuple[float, float]:
    """Median ms of one autocast float16 training step of the tiny GPT, plain and under measure_headroom."""
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    pool = itertools.cycle([synthetic_batch(model.config, torch.Generator().manual_seed(i)) for i in range(8)])

    def plain() -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            train_step(model, next(pool))

    def measured() -> None:
        with measure_headroom(model), torch.autocast("cpu", dtype=torch.float16):
            train_step(model, next(pool))

    times: dict[str, list[float]] = {"plain": [], "measured": []}
    fns: dict[str, Callable[[], None]] = {"plain": plain, "measured": measured}
    for _ in range(3):
        plain()
        measured()
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return statistics.median(times["plain"]) * 1e3, statistics.median(times["measured"]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(2)
    plain_ms, measured_ms = _headroom_cost(args.rounds)
    # The step itself runs plainly; the measurement is a replay of it under the mode.
    amortized = measured_ms / (DEFAULT_EVERY * plain_ms)
    table, described = _scores()
    body = f"""## Remedies: skip vs rollback vs auto

Short loops with a repeating fault, default options (`max_consecutive_skips=10`, `remedy_budget=3`, `lr_factor=0.5`):

{table}

{described}

Each scenario is a short training loop with a fault that repeats (`nanguard zoo --remedies` prints the same
table). A run is scored "finished, finite weights" when the loop ran to its end and every parameter is finite;
the final loss shows whether it also trained.

**Cost of `headroom_every`** (tiny GPT under float16 autocast on CPU, median of {args.rounds} interleaved rounds):
a plain step takes {plain_ms:.2f} ms, its replay under the headroom measurement {measured_ms:.2f} ms, so a
measured step (the step, then the replay) costs {(plain_ms + measured_ms) / plain_ms:.2f}x a plain one. At the
default `headroom_every={DEFAULT_EVERY}` that is {amortized * 100:.2f}% of the run's step time. A run with no
float16/bfloat16 op pays for one replay: the first check that sees none turns the checks off.

Machine: {machine()}. Reproduce: `.venv/bin/python benchmarks/remedies.py`.
"""
    write_section("remedies", body)
    print(body)


if __name__ == "__main__":
    main()
