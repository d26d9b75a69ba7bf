"""Wall time of real loop shapes, guarded against unguarded, interleaved in one run.

- A litgpt-style Lightning Fabric loop (``FabricGuard``): one batch per iteration, gradient
  accumulation under ``fabric.no_backward_sync``, ``fabric.backward``, ``fabric.clip_gradients``,
  ``optimizer.step()``.
- An llm.c-style loop (``LoopGuard``): the micro-batches fetched inside the loop, ``loss.backward()``
  on each, ``clip_grad_norm_``, the LR set by hand, ``optimizer.step()``.

Each configuration trains its own copy of the zoo's tiny GPT (2 layers, d=128, T=32, batch 8),
2 micro-batches per optimizer step, on the same pool of batches; one timed call is one
optimizer step. Run: ``.venv/bin/python benchmarks/loops.py [--rounds N]``; writes BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import warnings
from collections.abc import Callable

import torch

from _common import interleaved, machine, write_section
from nanguard.integrations.fabric import FabricGuard
from nanguard.integrations.loop import LoopGuard
from nanguard.zoo import GPT, GPTConfig, synthetic_batch

CONFIG = GPTConfig()
ACCUM = 2


def _pool() -> Callable[[], dict[str, torch.Tensor]]:
    batches = itertools.cycle([synthetic_batch(CONFIG, torch.Generator().manual_seed(i)) for i in range(16)])
    return lambda: next(batches)


def _model() -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def fabric_step(guarded: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    import lightning as L

    fabric = L.Fabric(accelerator="cpu", devices=1)
    model, optimizer = fabric.setup(*_model())
    guard = FabricGuard(fabric, model, optimizer) if guarded else None
    nxt = _pool()

    def step() -> None:
        for micro in range(ACCUM):
            batch = nxt()
            with fabric.no_backward_sync(model, enabled=micro != ACCUM - 1):
                _, loss = model(**batch)
                fabric.backward(loss / ACCUM)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()

    return step, (guard.close if guard is not None else (lambda: None))


def llmc_step(guarded: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    model, optimizer = _model()
    guard = LoopGuard(model, optimizer) if guarded else None
    nxt = _pool()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        lossf = torch.zeros(())
        for _ in range(ACCUM):
            _, loss = model(**nxt())
            loss = loss / ACCUM
            lossf += loss.detach()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in optimizer.param_groups:
            group["lr"] = 1e-4
        optimizer.step()

    return step, (guard.close if guard is not None else (lambda: None))


# The guard's entry points in a watched loop; cProfile's cumulative time of each covers the guard's work.
HOOKS = ("_decide", "_after_step", "_before_forward", "_after_forward")
WRAPPERS = ("_fabric_backward", "_clip_gradients")  # their own time only: they call Fabric's originals


def guard_share(build: Callable[[bool], tuple[Callable[[], None], Callable[[], None]]], steps: int = 10) -> float:
    """The share of a guarded step spent in the guard's own code, by cProfile (which slows Python
    code most, so the share is an upper bound); unlike a wall ratio it does not drift with load."""
    step, close = build(True)
    for _ in range(3):
        step()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step()
    profile.disable()
    close()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    total = sum(v[3] for k, v in stats.items() if k[2] == "step" and k[0].endswith("loops.py"))
    own = sum(v[3] for k, v in stats.items() if "nanguard" in k[0] and k[2] in HOOKS)
    own += sum(v[2] for k, v in stats.items() if "nanguard" in k[0] and k[2] in WRAPPERS)
    return own / total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=150)
    args = parser.parse_args()
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore")  # Lightning's hints about a CPU machine
    configs, closers = {}, []
    for name, build in (("Fabric loop (litgpt-style)", fabric_step), ("llm.c-style loop", llmc_step)):
        for guarded in (False, True):
            step, close = build(guarded)
            configs[f"{name}, {'guarded' if guarded else 'unguarded'}"] = step
            closers.append(close)
    times = interleaved(configs, rounds=args.rounds)
    for close in closers:
        close()
    rows = []
    for name, build in (("Fabric loop (litgpt-style)", fabric_step), ("llm.c-style loop", llmc_step)):
        plain, guarded = times[f"{name}, unguarded"], times[f"{name}, guarded"]
        share = guard_share(build)
        rows.append(f"| {name} | {plain * 1e3:.2f} | {guarded * 1e3:.2f} | {guarded / plain:.3f}x | {share:.2%} |")
    conditions = (
        f"Median wall time of one optimizer step (2 micro-batches of the tiny "
        f"GPT, AdamW), four configurations, {args.rounds} interleaved rounds:"
    )
    body = f"""## Real loop shapes: Fabric and llm.c, guarded against unguarded

{conditions}

| loop | unguarded step ms | guarded step ms | ratio | guard's own share (cProfile) |
|---|---:|---:|---:|---:|
{chr(10).join(rows)}

`benchmarks/loops.py --rounds {args.rounds}` on {machine()}. One optimizer step is 2 micro-batches of the zoo's
tiny GPT (batch 8, T=32; gradient clipping at 1.0; AdamW), the four configurations interleaved round by
round. The Fabric loop is guarded by `FabricGuard`, the
llm.c-style loop by `LoopGuard` (a few added lines each, README "Plain loops" and "Lightning Fabric").
The last column is the share of a guarded step spent in the guard's own code (its hooks, the check
and the after-step record), by cProfile over 10 steps: an upper bound, since cProfile slows Python
code most, and one that does not drift with the machine's load as the wall ratio does.
"""
    write_section("loops", body)
    print(body)


if __name__ == "__main__":
    main()
