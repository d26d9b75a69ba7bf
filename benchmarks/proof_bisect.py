"""What a trip's proof (a peer re-computes the suspect's step) and a bisect cost, in training steps.

- proof: 2 gloo ranks, the tiny GPT under DDP, a ``faulty_device`` planted on rank 1; the trip's step
  timed with ``prove=True`` and ``prove=False`` (fresh guards, median of rounds), against a healthy
  guarded step.
- bisect: one process, the tiny GPT, an unguarded run checkpointing every ``--every`` steps with a
  NaN batch at the last step; ``ng.bisect`` timed against one unguarded training step.

Run: ``.venv/bin/python benchmarks/proof_bisect.py [--rounds N]``; writes the "proof-bisect" section
of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import nanguard as ng
from _common import machine, write_section
from nanguard.zoo import GPT, GPTConfig, synthetic_batch
from nanguard.zoo.spawn import spawn_ranks

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
BATCH = 8
WARM = 4  # healthy steps before the trip, per round


def _build() -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _batch(rank: int, step: int) -> dict[str, torch.Tensor]:
    return synthetic_batch(CONFIG, torch.Generator().manual_seed(rank * 10_007 + step), batch_size=BATCH)


def _proof_rank(rank: int, world: int, rounds: int) -> dict[str, Any]:
    healthy: list[float] = []
    trip: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for prove in (True, False):
            net, opt = _build()
            model = torch.nn.parallel.DistributedDataParallel(net)
            spec = f"faulty_device@step={WARM},rank=1"
            guard = ng.Guard(model, opt, policy="skip", inject=spec, prove=prove, fingerprint_every=0)
            for step in range(WARM + 1):
                batch = _batch(rank, step)

                def closure(batch: dict[str, torch.Tensor] = batch, model: Any = model, opt: Any = opt) -> Any:
                    opt.zero_grad()
                    loss = model(**batch)[1]
                    loss.backward()
                    return loss

                torch.distributed.barrier()
                start = time.perf_counter()
                guard.step(closure, batch=batch)
                seconds = time.perf_counter() - start
                if step == WARM:
                    trip[prove].append(seconds)
                elif step >= 1:
                    healthy.append(seconds)
            assert guard.last_diagnosis is not None
            assert guard.last_diagnosis.cause == "hardware.faulty_device" or not prove
            guard.close()
    return {
        "healthy": statistics.median(healthy),
        "proved": statistics.median(trip[True]),
        "unproved": statistics.median(trip[False]),
    }


def _bisect(rounds: int, every: int, steps: int) -> dict[str, float]:
    bad = steps - 1

    def batch_at(step: int) -> dict[str, torch.Tensor]:
        batch = _batch(0, step)
        if step == bad:
            batch["labels"] = torch.full_like(batch["labels"], -100)  # every target ignored: the mean loss is 0/0
        return batch

    def setup() -> dict[str, Any]:
        model, opt = _build()

        def load(path: str) -> int:
            state = torch.load(path, weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            return int(state["step"])

        def closure(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            opt.zero_grad()
            loss = model(**batch)[1]
            loss.backward()
            return loss

        return {
            "model": model,
            "optimizer": opt,
            "load": load,
            "batches": lambda start: (batch_at(s) for s in range(start, steps)),
            "closure": closure,
        }

    plain: list[float] = []
    found: list[float] = []
    replayed = 0
    with tempfile.TemporaryDirectory() as tmp:
        parts = setup()
        for step in range(steps):
            if step % every == 0:
                state = {"model": parts["model"].state_dict(), "optimizer": parts["optimizer"].state_dict()}
                torch.save({**state, "step": step}, Path(tmp, f"ckpt-{step}.pt"))
            start = time.perf_counter()
            parts["closure"](batch_at(step))
            parts["optimizer"].step()
            if step != bad:
                plain.append(time.perf_counter() - start)
        for _ in range(rounds):
            start = time.perf_counter()
            result = ng.bisect(setup, tmp)
            found.append(time.perf_counter() - start)
            assert result.first_bad_step == bad and result.diagnosis is not None
            replayed = result.steps_replayed
    return {"step": statistics.median(plain), "bisect": statistics.median(found), "replayed": replayed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    ranks = spawn_ranks(_proof_rank, args.rounds, world=2, timeout=1200)
    torch.set_num_threads(1)  # as each spawned rank runs: one core each on a shared machine
    p = {k: max(r[k] for r in ranks) for k in ranks[0]}  # the slower rank sets the pace
    b = _bisect(args.rounds, args.every, args.steps)
    n, h, ckpts = CONFIG, p["healthy"], args.steps // args.every
    rows = [
        ("healthy guarded DDP step (2 gloo ranks)", h, 1.0),
        ("trip with its proof (`faulty_device` on rank 1: `hardware.faulty_device`)", p["proved"], p["proved"] / h),
        ("the same trip with `prove=False`", p["unproved"], p["unproved"] / h),
        ("the proof alone (difference)", p["proved"] - p["unproved"], (p["proved"] - p["unproved"]) / h),
        ("unguarded training step (1 process)", b["step"], 1.0),
        (
            f"`ng.bisect`: {ckpts} checkpoints checked, {b['replayed']:.0f} steps replayed, the bad one diagnosed",
            b["bisect"],
            b["bisect"] / b["step"],
        ),
    ]
    table = "\n".join(f"| {what} | {sec:.4f} | {ratio:.1f} |" for what, sec, ratio in rows)
    body = (
        "### A trip's proof and a bisect, in training steps\n"
        f"Tiny GPT ({n.n_layer} layers, width {n.n_embd}, {n.block_size} tokens, batch {BATCH}), "
        f"AdamW; medians of {args.rounds} rounds:\n\n"
        "| what | seconds | in training steps |\n|---|---:|---:|\n" + table + "\n\n"
        f"Machine: {machine()}, load average {os.getloadavg()[0]:.1f} at the end. "
        "Reproduce: `.venv/bin/python benchmarks/proof_bisect.py`.\n"
    )
    write_section("proof-bisect", body)
    print(body)


if __name__ == "__main__":
    main()
