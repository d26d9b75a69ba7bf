"""The chaos soak (``nanguard.zoo.drill``) as numbers: guarded steps on gloo ranks with faults of every
kind planted at seeded random steps and ranks, how many were caught, and what the run cost.

Each rank checks every skip (bit-identical weights and optimizer state), every rollback (exactly the
snapshot's state) and, at the end, the weights against an unguarded run on only the surviving batches;
the ranks' decisions are compared step by step.

Run: ``.venv/bin/python benchmarks/chaos_soak.py [--ranks 2 3] [--steps 1500] [--seed 2]``; writes BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import Counter

from _common import machine, write_section
from nanguard.zoo.drill import chaos_faults, check_drill, drill_rank
from nanguard.zoo.spawn import spawn_ranks


def soak(world: int, steps: int, seed: int) -> str:
    faults = chaos_faults(seed, steps=steps, world=world)
    dicts = [
        {"kind": f.kind, "step": f.step, "rank": f.rank, "module": f.module, "factor": f.factor, "seconds": f.seconds}
        for f in faults
    ]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as run_dir:
        results = spawn_ranks(drill_rank, dicts, steps, run_dir, world=world, timeout=3600)
    wall = time.perf_counter() - started
    problems = check_drill(faults, results)
    actions = Counter(results[0]["actions"])
    kinds = Counter(f.kind for f in faults)
    stalls = kinds["stall"]
    caught = len(faults) - stalls - sum("not caught" in p for p in problems)
    planted = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
    verdict = "all held" if not problems else f"{len(problems)} failed: {problems[0]}"
    return (
        f"| {world} | {steps} | {len(faults)} ({planted}) | {caught} of {len(faults) - stalls} | "
        f"{actions['skip']} / {actions['rollback']} / {actions['drop_batch']} | {results[0]['applied']} | "
        f"{verdict} | {wall:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for world in args.ranks:
        rows.append(soak(world, args.steps, args.seed))
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    body = f"""## Chaos soak (fire drill)

Guarded tiny GPT under DDP on gloo ranks (`policy="auto"`, `skip_spikes=True`, AdamW), faults at seeded random steps:

| ranks | steps | faults planted | caught | skips / rollbacks / dropped | updates kept | promises | seconds |
|---:|---:|---|---:|---|---:|---|---:|
{table}

Faults of every kind (`nanguard.inject`) at seeded random steps and ranks. Caught: the fault's step (for a NaN
parameter the forward does not read, the next one) was skipped or rolled back on every rank; stalls have
nothing to catch and must only not hang. The promises checked: every rank's action identical at every step,
every skip bit-exact, every rollback exact, final weights bit-identical to a DDP run on only the batches
whose updates survived, unguarded (a healthy guarded DDP step sends the unguarded run's bits at any world
size; `skip_spikes=True` keeps the guard's values in an all-reduce of their own at 3 ranks).

Machine: {machine()}, load average {os.getloadavg()[0]:.1f} at the end. Reproduce:
`.venv/bin/python benchmarks/chaos_soak.py --ranks 2 3 --steps {args.steps} --seed {args.seed}`; the test suite
runs 100 steps on 2 ranks always and 1500 on 3 as `slow` (`tests/test_inject.py`)."""
    write_section("chaos-soak", body)
    print(body)


if __name__ == "__main__":
    main()
