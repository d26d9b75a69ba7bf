"""DeepSpeedGuard's overhead on DeepSpeed engine loops (CPU accelerator, gloo, 2 ranks), ZeRO 1/2/3: the
unguarded engine loop and the guarded one, built alike, interleaved step by step in one run; and the
guard's own share of the guarded step, timed inside its check and its recording hooks.

Writes the ``overhead-deepspeed`` section of BENCHMARKS.md.

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/deepspeed_overhead.py --stages 1 2 3 --rounds 40
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from _common import interleaved, machine, write_section
from nanguard.zoo import GPT, GPTConfig, synthetic_batch

CONFIG = GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=256, vision_dim=16)


def _engine(stage: int) -> Any:
    import deepspeed

    torch.manual_seed(0)
    model = GPT(CONFIG)
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _timed(spent: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    return run


def rank_times(rank: int, world: int, stage: int, rounds: int) -> dict[str, float]:
    """One rank: the unguarded engine loop and the guarded one, interleaved; and the guard's own time a step."""
    import deepspeed

    from nanguard.integrations.deepspeed import DeepSpeedGuard

    os.environ.setdefault("LOCAL_RANK", str(rank))
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    plain, guarded = _engine(stage), _engine(stage)
    guard = DeepSpeedGuard(guarded, policy="skip")
    spent: list[float] = []  # inside the guard: its check, the forward's record, the backward's loss
    guard._decide = _timed(spent, guard._decide)  # type: ignore[method-assign]
    guard._capture.record = _timed(spent, guard._capture.record)  # type: ignore[method-assign]
    inner = guard.guard
    assert inner is not None
    inner.after_step = _timed(spent, inner.after_step)  # type: ignore[method-assign]
    counters = {"plain": 0, "guarded": 0}

    def step(engine: Any, name: str) -> None:
        i = counters[name]
        counters[name] += 1
        batch = synthetic_batch(CONFIG, torch.Generator().manual_seed(rank * 100_000 + i), batch_size=8)
        _, loss = engine(**batch)
        engine.backward(loss)
        engine.step()

    times = interleaved(
        {"plain": lambda: step(plain, "plain"), "guarded": lambda: step(guarded, "guarded")}, rounds=rounds
    )
    steps = counters["guarded"]
    times["own"] = sum(spent) / steps
    times["own_median"] = statistics.median(spent)
    guard.close()
    return times


def section(stages: list[int], rounds: int) -> str:
    from nanguard.zoo.spawn import spawn_ranks

    rows = []
    for stage in stages:
        t = spawn_ranks(rank_times, stage, rounds, world=2, timeout=1800)[0]
        ratio = t["guarded"] / t["plain"]
        share = t["own"] / t["guarded"]
        rows.append(
            f"| ZeRO-{stage} | {t['plain'] * 1e3:.2f} | {t['guarded'] * 1e3:.2f} | {ratio:.3f}x "
            f"| {t['own'] * 1e3:.3f} ({share:.1%}) |"
        )
    params = sum(p.numel() for p in GPT(CONFIG).parameters())
    return f"""## DeepSpeed engine loops (DeepSpeedGuard)

A {params:,}-parameter GPT, fp32, micro-batch 8, AdamW, 2 gloo ranks, {rounds} interleaved rounds, median step (rank 0):

| engine | unguarded ms/step | guarded ms/step | ratio | guard's own ms/step (share) |
|---|---|---|---|---|
{chr(10).join(rows)}

{machine()}; DeepSpeed's CPU accelerator; the unguarded and the guarded engine side by side in one run;
a step is the forward, `engine.backward` and `engine.step`. "guard's own" is the time
spent inside the guard per step (its check with the one all-reduce, its recording hooks, its bookkeeping after
the update), summed over the run and divided by the steps (the wait at the all-reduce for the slower rank
included). Reproduce: `DS_ACCELERATOR=cpu .venv/bin/python benchmarks/deepspeed_overhead.py`.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    body = section(args.stages, args.rounds)
    print(body)
    write_section("overhead-deepspeed", body)


if __name__ == "__main__":
    main()
