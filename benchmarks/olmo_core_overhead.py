"""NanGuardCallback's overhead in OLMo-core's own ``Trainer`` (``nanguard.zoo.olmo``: a tiny llama-like
model, its numpy data loader, ``SkipStepAdamW``, clip 1.0), one process and DDP/FSDP on 2 gloo ranks
(CPU): unguarded and guarded runs interleaved (plain, guarded, plain, ...), each step timed from the
trainer's ``pre_step`` to its ``post_train_batch``, and the collectives a step adds counted.

Writes the ``overhead-olmo-core`` section of BENCHMARKS.md.

    .venv/bin/python benchmarks/olmo_core_overhead.py --rounds 6 --steps 12
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

from _common import machine, write_section

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

warnings.simplefilter("ignore", ImportWarning)  # OLMo-core's google-api-core import

SETUPS = ("single", "ddp", "fsdp")
_WARM = 2  # the first steps of each run (allocation, the first optimizer step) are not timed


def rounds_on_rank(rank: int, world: int, setup: str, rounds: int, steps: int) -> dict[str, Any]:
    """Plain and guarded runs alternately, ``rounds`` of each: their step times; then the collectives a
    step adds, counted at the dispatcher (``tests/_sync_count.py``, ``tests/_sync_configs.py``'s OLMo-core run)."""
    import torch

    from _sync_configs import olmo
    from _sync_count import added
    from nanguard.zoo.olmo import olmo_rank

    torch.set_num_threads(1)  # one intra-op thread per process: the ranks share this machine's cores
    times: dict[str, list[float]] = {"plain": [], "guarded": []}
    for _ in range(rounds):
        for kind, policy in (("plain", None), ("guarded", "skip")):
            r = olmo_rank(rank, world, setup, None, 0, policy, steps=steps)
            times[kind] += r["times"][_WARM:]
    counted = olmo(setup)(rank, world, 3)
    return {
        "plain": statistics.median(times["plain"]),
        "guarded": statistics.median(times["guarded"]),
        "added": added(counted["plain"], counted["guarded"], 3)["collectives"],
        "n": len(times["plain"]),
    }


def _single(rounds: int, steps: int) -> dict[str, Any]:
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(rounds_on_rank, (0, 1, "single", rounds, steps))  # type: ignore[no-any-return]


def section(rounds: int, steps: int) -> str:
    from nanguard.zoo.spawn import spawn_ranks

    load = os.getloadavg()[0]
    rows = []
    for setup in SETUPS:
        if setup == "single":
            t = _single(rounds, steps)
        else:
            t = spawn_ranks(rounds_on_rank, setup, rounds, steps, world=2, timeout=3600)[0]
        name = {"single": "1 process", "ddp": "DDP, 2 ranks", "fsdp": "FSDP, 2 ranks"}[setup]
        rows.append(
            f"| {name} | {t['plain'] * 1e3:.1f} | {t['guarded'] * 1e3:.1f} | {t['guarded'] / t['plain']:.3f}x "
            f"| {t['added']:+.0f} | {t['n']} |"
        )
    conditions = (
        f"OLMo-core's `Trainer` unguarded and with `NanGuardCallback`, {rounds} interleaved rounds of {steps} steps "
        f"(rank 0), load average {load:.2f} at the start:"
    )
    return f"""## Guard overhead in OLMo-core's Trainer (CPU; 1 process, 2 gloo ranks)

{conditions}

| setup | plain ms | guarded ms | ratio | collectives added a step | steps timed each |
|---|---:|---:|---:|---:|---:|
{chr(10).join(rows)}

ai2-olmo-core's `Trainer`, `TransformerTrainModule` and numpy data loader as shipped (`nanguard/zoo/olmo.py`: a
2-layer llama-like model, d_model 32, vocab 128, 2 micro-batches of 2 x 16 tokens a step per rank, `SkipStepAdamW`,
clip 1.0); a run unguarded, then one with `NanGuardCallback(policy="skip", module_stats=False)`, alternately; each
step timed from the trainer's `pre_step` to its `post_train_batch` (forward, backward, the callbacks'
`pre_optim_step`, clip, optimizer step), the first {_WARM} of each run left out, the median over all runs.
"collectives added" is counted at the dispatcher, every c10d and functional op, guarded minus unguarded
(`tests/_sync_count.py`, as in "Collectives and host reads a healthy step adds"). One intra-op thread per process.
The machine is shared and was
loaded (see the load average above): the ratio, not the time, is the result, and at this load it moves by tens of
percent from run to run.
{machine()}. Reproduce: `.venv/bin/python benchmarks/olmo_core_overhead.py --rounds {rounds} --steps {steps}`.

A healthy step adds one all-reduce of `2 x world_size + 2` float32 (the ranks' agreed health; none in one
process), the check's norms over the local gradients and parameters (FSDP: this rank's shards), the micro-batch
record, and two metrics (`nanguard/skipped`, `nanguard/trips`) in the trainer's logs. No replay, no second forward
or backward. The agreement does not yet ride in a collective OLMo-core already makes (its DDP's gradient
all-reduce runs inside `replicate`'s reducer, its clip's norm is reduced by DTensor): on steps this tiny the
all-reduce and the Python work weigh most. Not measured: GPUs, NCCL, a model of real size.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    body = section(args.rounds, args.steps)
    write_section("overhead-olmo-core", body)
    print(body)


if __name__ == "__main__":
    main()
