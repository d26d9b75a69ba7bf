"""Remedies: skip vs rollback vs auto on the remedy scenarios, the cost of ``headroom_every`` and of a
repeated trip.

Run: ``.venv/bin/python benchmarks/remedies.py [--rounds N] [--costs-only]``; writes the "remedies" section
of BENCHMARKS.md (``--costs-only``: only its "remedy-costs" part, a minute's run, not the scenarios).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import torch

import nanguard as ng
from _common import machine, write_section
from nanguard.tracer.headroom import measure_headroom
from nanguard.zoo import GPT, GPTConfig, build, get, synthetic_batch, train_step
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


def _trip_cost(runs: int) -> tuple[float, float]:
    """Median ms of ``guard.step`` on the zoo's fp16_attention_overflow, which trips on every step from
    the first (a drifted LayerNorm gain): the first trip (replayed in full), and the two after it (a
    repeat of the same module's overflow, confirmed by one forward)."""
    first: list[float] = []
    repeated: list[float] = []
    for seed in range(runs):
        run = build(get("fp16_attention_overflow"), seed=seed)
        guard = ng.Guard(run.model, run.optimizer, "skip", scaler=run.scaler, max_consecutive_skips=100)
        for step in range(3):
            batch = run.batch(step)
            start = time.perf_counter()
            guard.step(run.closure(batch), batch=batch)
            (first if step == 0 else repeated).append(time.perf_counter() - start)
            assert guard.last_action == "skip", "every step of the scenario trips"
        assert [guard.last_diagnosis is not None, "repeat_of" in guard.last_diagnosis.evidence] == [True, True]
        guard.close()
    return statistics.median(first) * 1e3, statistics.median(repeated) * 1e3


def _costs(rounds: int) -> str:
    plain_ms, measured_ms = _headroom_cost(rounds)
    first_ms, repeated_ms = _trip_cost(max(3, rounds // 6))
    # The step is measured as it runs (no replay): the cost is the measured step's over the plain one.
    amortized = (measured_ms - plain_ms) / (DEFAULT_EVERY * plain_ms)
    return f"""**Costs** (tiny GPT, float16 autocast, CPU; medians; `headroom_every`: {rounds} interleaved rounds):

| measure | ms |
|---|---:|
| a plain step | {plain_ms:.2f} |
| the same step under the headroom measurement | {measured_ms:.2f} |
| a first trip's `guard.step` (zoo `fp16_attention_overflow`, replayed in full) | {first_ms:.2f} |
| a repeated trip's `guard.step` (the same module's overflow again: one forward confirms it) | {repeated_ms:.2f} |

A measured step costs {measured_ms / plain_ms:.2f}x a plain one: at the default `headroom_every={DEFAULT_EVERY}`,
{amortized * 100:.2f}% of the run's step time. An eager model's step is measured as it runs (so is a
`guard.check()` loop's next due forward); a `torch.compile`d model is not measured. A run with no
float16/bfloat16 op pays for one measurement: the first check that sees none turns the checks off. A trip that
repeats the last one's model fault costs {repeated_ms / first_ms:.2f}x the first (no tracer replay).

Machine: {machine()}. Reproduce: `.venv/bin/python benchmarks/remedies.py --costs-only`."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--costs-only", action="store_true", help="rewrite only the remedy-costs part")
    args = parser.parse_args()
    torch.set_num_threads(2)
    costs = _costs(args.rounds)
    if args.costs_only:
        write_section("remedy-costs", costs)
        print(costs)
        return
    table, described = _scores()
    body = f"""## Remedies: skip vs rollback vs auto

Short loops with a repeating fault, default options (`max_consecutive_skips=10`, `remedy_budget=3`, `lr_factor=0.5`):

{table}

{described}

Each scenario is a short training loop with a fault that repeats (`nanguard zoo --remedies` prints the same
table). A run is scored "finished, finite weights" when the loop ran to its end and every parameter is finite;
the final loss shows whether it also trained.

<!-- remedy-costs -->
{costs}
<!-- /remedy-costs -->

Machine: {machine()}. Reproduce: `.venv/bin/python benchmarks/remedies.py`.
"""
    write_section("remedies", body)
    print(body)


if __name__ == "__main__":
    main()
