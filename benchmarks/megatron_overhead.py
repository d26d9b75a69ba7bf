"""MegatronGuard's overhead in Megatron-core's own loop: a tiny GPT from a ``TransformerConfig`` on 2 gloo
ranks (CPU, the test suite's CUDA shim), data parallel 2 with Megatron's DDP and DistributedOptimizer, and
tensor parallel 2; ``forward_backward_func`` then ``optimizer.step()``, guarded against the same unguarded
loop, interleaved in one run. Counts the collectives a step issues, guarded minus unguarded.

Writes the ``overhead-megatron`` section of BENCHMARKS.md.

    .venv/bin/python benchmarks/megatron_overhead.py --rounds 40
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from _common import interleaved, machine, write_section

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SETUPS = {"dp": ("DP=2, DistributedOptimizer", {"dist_opt": True}), "tp": ("TP=2", {"tp": 2})}


def rank_times(rank: int, world: int, setup: str, rounds: int) -> dict[str, float]:
    """One rank: Megatron's step unguarded and guarded, interleaved; collectives counted per step."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from _megatron_ranks import ROWS, SEQ, batch, build, forward_step, init
    from nanguard.integrations.megatron import MegatronGuard

    torch.set_num_threads(1)
    run = SETUPS[setup][1]
    init(run.get("tp", 1), 1)
    forward_backward = get_forward_backward_func()
    dp = parallel_state.get_data_parallel_rank()
    steps: dict[str, Callable[[], None]] = {}
    for kind in ("plain", "guarded"):
        chunks, optimizer, _ = build(run)
        step_func: Any = forward_step
        if kind == "guarded":
            guard = MegatronGuard(chunks, optimizer, module_stats=False)
            step_func = guard.forward_step(forward_step)
        count = [0]

        def step(chunks=chunks, optimizer=optimizer, step_func=step_func, count=count) -> None:
            count[0] += 1
            for chunk in chunks:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            forward_backward(
                forward_step_func=step_func,
                data_iterator=iter([batch(dp, count[0] % 8, 0)]),
                model=chunks,
                num_microbatches=1,
                seq_length=SEQ,
                micro_batch_size=ROWS,
                decoder_seq_length=SEQ,
                forward_only=False,
            )
            optimizer.step()

        steps[kind] = step
    times = interleaved(steps, rounds=rounds)
    for kind, fn in steps.items():
        times[f"collectives_{kind}"] = _collectives(fn)
    return times


def _collectives(step: Callable[[], None]) -> float:
    """The collectives one step issues, counted at the dispatcher (``tests/_sync_count.py``)."""
    from _sync_count import counting

    with counting() as counted:
        step()
    return float(counted.n_collectives)


def section(rounds: int) -> str:
    from nanguard.zoo.spawn import spawn_ranks

    load = os.getloadavg()[0]
    rows = []
    for setup, (name, _) in SETUPS.items():
        t = spawn_ranks(rank_times, setup, rounds, world=2, timeout=1800)[0]
        added = t["collectives_guarded"] - t["collectives_plain"]
        rows.append(
            f"| {name} | {t['plain'] * 1e3:.1f} | {t['guarded'] * 1e3:.1f} | {t['guarded'] / t['plain']:.3f}x "
            f"| {t['collectives_plain']:.0f} | {added:+.0f} |"
        )
    conditions = (
        f"megatron-core 0.16.1's GPT (2 layers, hidden 16, vocab 64, seq 8, batch 2) unguarded and under "
        f"`MegatronGuard`, {rounds} interleaved rounds (rank 0), load average {load:.2f} at the start:"
    )
    return f"""## Guard overhead in Megatron-core's loop (2 gloo ranks, CPU)

{conditions}

| setup | plain ms | guarded ms | ratio | collectives a step, unguarded | added by the guard |
|---|---:|---:|---:|---:|---:|
{chr(10).join(rows)}

Megatron's DDP (fp32 gradient buffers), its optimizer (Adam, `clip_grad=1.0`) and `get_forward_backward_func`,
as `tests/_megatron_ranks.py` builds them on CPU with the tests' CUDA shim; a step is `zero_grad_buffer`,
`forward_backward_func` with one micro-batch and `optimizer.step()`; unguarded and guarded by
`MegatronGuard(..., module_stats=False)` with `guard.forward_step(forward_step_func)` in one run, median step time
as seen by rank 0, one intra-op thread per rank. The machine is shared, so the ratio, not the time, is the result.
{machine()}. Reproduce: `.venv/bin/python benchmarks/megatron_overhead.py --rounds {rounds}`.

The collectives are counted at the dispatcher for one step of each (every c10d and functional op,
`tests/_sync_count.py`). The guard reads the gradient norm Megatron's optimizer reduces for its clip (its clip then
reuses it: no second reduction); that norm is non-finite on every rank when any rank's gradients are, and each
rank's loss rides in its gradients (a non-finite one seeds their backward with NaN), so a healthy step adds no
collective; only a step with a non-finite norm makes the ranks agree on who flagged what. Under tensor parallelism
the same (the norm is reduced over the model-parallel group); under pipeline parallelism (not measured here) a
stage before the last, which has no loss, carries its parameter check in the gradient its output receives back. Its
other work a step is Python: the micro-batch record (inputs, RNG state), the loss, the check's one host read
(Megatron's own `get_grad_norm` reads the norm to the host already). Not measured: GPUs, NCCL, a model of real
size, where that fixed cost is a small share of a step."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    body = section(args.rounds)
    write_section("overhead-megatron", body)
    print(body)


if __name__ == "__main__":
    main()
