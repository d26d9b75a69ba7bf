"""TitanGuard's overhead in torchtitan's loop: its llama3 (shrunk), FSDP2 dp_shard=2 and TP=2, its
chunked loss, containers and its ``clip_grad_norm_`` (``torchtitan.distributed.utils``), on 2 gloo ranks
(CPU), guarded against the same unguarded loop, interleaved in one run; and the collectives the guard adds.

Writes the ``overhead-torchtitan`` section of BENCHMARKS.md.

    .venv/bin/python benchmarks/torchtitan_overhead.py --rounds 40
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as tdist

from _common import interleaved, machine, write_section

SETUPS = ("fsdp", "tp")


def rank_times(rank: int, world: int, setup: str, rounds: int) -> dict[str, float]:
    """One rank: torchtitan's step unguarded and guarded by TitanGuard, interleaved."""
    steps = loops(rank, world, setup)
    pair = {k: steps[k] for k in ("plain", "guarded")}
    times = interleaved(pair, rounds=rounds)
    synced = _synced(steps, rounds)
    times.update({f"synced_{k}": v for k, v in synced.items()})
    times["share"] = _own_share(steps["guarded"], rounds)
    times["added"] = _added_collectives(steps)
    return times


def loops(rank: int, world: int, setup: str) -> dict[str, Callable[[], None]]:
    """torchtitan's train step on this rank, ``"plain"`` and ``"guarded"`` (by TitanGuard), built alike."""
    from torchtitan.distributed import utils as dist_utils

    from nanguard.integrations.torchtitan import TitanGuard
    from nanguard.zoo.titan import SEQ, VOCAB, build

    torch.set_num_threads(1)
    positions = torch.arange(SEQ).expand(2, SEQ)
    batches = [
        torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(i * 10 + rank)) for i in range(8)
    ]
    steps: dict[str, Callable[[], None]] = {}
    for kind in ("plain", "guarded"):
        parts = build(setup)
        model, loss_fn, optimizers, schedulers = (parts[k] for k in ("model", "loss_fn", "optimizers", "lr_schedulers"))
        if kind == "guarded":
            guard = TitanGuard([model], optimizers, schedulers, module_stats=False)
            loss_fn = guard.loss(loss_fn)
        count = [0]

        def step(
            model=model, loss_fn=loss_fn, optimizers=optimizers, schedulers=schedulers, count=count, kind=kind
        ) -> None:
            x = batches[count[0] % len(batches)]
            count[0] += 1
            optimizers.zero_grad()
            tokens, labels = x[:, :-1], x[:, 1:]
            loss, _ = loss_fn(model(tokens, positions=positions), labels, torch.tensor(labels.numel() * world))
            loss.backward()
            dist_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)  # as train_step clips
            optimizers.step()
            schedulers.step()

        steps[kind] = step
    return steps


def _added_collectives(steps: dict[str, Callable[[], None]], n: int = 4) -> float:
    """The ``torch.distributed`` calls a guarded step makes beyond an unguarded one, per step, over ``n`` steps
    each (the guard calls its collectives there; DTensor's own go through the functional ops, alike in both)."""
    from nanguard import compat

    counted: dict[str, int] = {}
    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "all_gather_object", "barrier")
    for kind in ("plain", "guarded"):
        calls = [0]

        def counter(original: Callable[..., Any], calls: list[int] = calls) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                calls[0] += 1
                return original(*args, **kwargs)

            return call

        with compat.swap_collectives({name: counter(getattr(tdist, name)) for name in names}):
            for _ in range(n):
                steps[kind]()
        counted[kind] = calls[0]
    return (counted["guarded"] - counted["plain"]) / n


def _synced(steps: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Median seconds per step of each config, round-robin, every rank starting each timed step
    together (a barrier before it, untimed): one rank's lag is not charged to the next step."""
    import statistics
    import time

    for fn in steps.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            tdist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


_HOOKS = ("_before_forward", "_after_forward", "_before_step", "_after_step")


def _own_share(step: Callable[[], None], rounds: int) -> float:
    """The guard's own share of a guarded step, by profile: the time inside LoopGuard's hooks on
    the model's forward and the optimizer's step (the check, its all-reduce, the bookkeeping)."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.runcall(lambda: [step() for _ in range(rounds)])
    stats: Any = pstats.Stats(profile).stats
    own = sum(v[3] for (file, _, name), v in stats.items() if file.endswith("loop.py") and name in _HOOKS)
    total = sum(v[3] for (_, _, name), v in stats.items() if name == "<lambda>")
    return own / total if total else 0.0


def section(rounds: int) -> str:
    from nanguard.zoo.spawn import spawn_ranks

    load = os.getloadavg()[0]
    rows = []
    for setup in SETUPS:
        t = spawn_ranks(rank_times, setup, rounds, world=2, timeout=1800)[0]
        name = {"fsdp": "FSDP2 dp_shard=2", "tp": "TP=2"}[setup]
        ratio = t["guarded"] / t["plain"]
        synced = t["synced_guarded"] / t["synced_plain"]
        rows.append(
            f"| {name} | {t['plain'] * 1e3:.1f} | {t['guarded'] * 1e3:.1f} | {ratio:.3f}x | {synced:.3f}x "
            f"| {t['added']:+g} | {t['share'] * 100:.1f}% |"
        )
    conditions = (
        f"torchtitan's shrunk llama3 unguarded and under `TitanGuard`, {rounds} "
        f"interleaved rounds (rank 0), load average {load:.2f} at the start:"
    )
    return f"""## Guard overhead in torchtitan's loop (2 gloo ranks, CPU)

{conditions}

| setup | plain ms | guarded ms | ratio | ratio, synced | collectives added a step | own share (profile) |
|---|---:|---:|---:|---:|---:|---:|
{chr(10).join(rows)}

torchtitan 0.3.0's llama3 (2 layers, dim 64, vocab 256, seq 16, batch 2), `parallelize_llama`, its
`ChunkedLossWrapper`, `OptimizersContainer` (AdamW), `LRSchedulersContainer` and its own `clip_grad_norm_`
(`torchtitan.distributed.utils`), as `train_step` runs them (`nanguard/zoo/titan.py`); unguarded and guarded by
`TitanGuard(..., module_stats=False)` with `guard.loss(loss_fn)` in one run, median step time as seen by rank 0;
then {rounds} guarded steps under cProfile, the time inside `LoopGuard`'s hooks (the check, bookkeeping) as a share
of the step. "collectives added" counts the `torch.distributed` calls of 4 guarded steps against 4 unguarded ones,
per step. One intra-op thread per rank; the machine is shared, so the ratio, not the time, is the result. {machine()}.
Reproduce: `.venv/bin/python benchmarks/torchtitan_overhead.py --rounds {rounds}`.

A healthy step adds no collective: the guard reads the total norm torchtitan's clip has already reduced over the
mesh (the same on every rank, non-finite on every rank when any rank's gradients are: under TP a replicated
parameter's norm enters the clip's partial sum from every rank; a rank's non-finite loss seeds its own gradients
with NaN in their backward, so it reaches that norm too). Only a step with a non-finite
norm makes the ranks agree on who flagged what (one all-reduce, then the replay). "ratio" runs the steps back to
back: a rank that falls behind (this machine is shared and loaded) is charged to whichever step waits for it;
"synced" puts an untimed barrier before each timed step. What remains is the guard's own work a step (its norm
over this rank's local shards, the micro-batch record, the loss, the check's one host read), which weighs most
on these tiny steps. Not measured: GPUs, NCCL, a model of real size, where that fixed cost is a small share of
a step."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    body = section(args.rounds)
    write_section("overhead-torchtitan", body)
    print(body)


if __name__ == "__main__":
    main()
