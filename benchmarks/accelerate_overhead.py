"""LoopGuard's overhead on an accelerate loop (the loop of transformers' ``run_clm_no_trainer.py``: accumulate,
``accelerator.backward``, the clip, ``optimizer.step()``, ``lr_scheduler.step()``): the unguarded loop and the
guarded one, built alike from one Accelerator, interleaved step by step in one process; and the guard's own
share of the guarded step, timed inside its hooks and its check.

Writes the ``overhead-accelerate`` section of BENCHMARKS.md.

    .venv/bin/python benchmarks/accelerate_overhead.py --rounds 60 --repeats 3 --threads 1
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from _common import interleaved, machine, write_section

GA, BATCH, T = 2, 8, 32
SCRIPT = ".venv/bin/python benchmarks/accelerate_overhead.py"
SIZE = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": T}


def _timed(spent: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    return run


def _loop(mixed_precision: str, guarded: bool, spent: list[float]) -> tuple[Callable[[], None], Any]:
    """One optimizer step of the loop (GA micro-batches), and its LoopGuard (None unguarded)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler

    from nanguard.integrations.loop import LoopGuard

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(gradient_accumulation_steps=GA, cpu=True, mixed_precision=mixed_precision)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**SIZE))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lr_scheduler = get_scheduler("linear", optimizer, num_warmup_steps=10, num_training_steps=10**6)
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    guard = None
    if guarded:
        guard = LoopGuard(model, optimizer, scheduler=lr_scheduler)
        guard._decide = _timed(spent, guard._decide)  # type: ignore[method-assign]
        guard._capture.record = _timed(spent, guard._capture.record)  # type: ignore[method-assign]
        assert guard.guard is not None
        guard.guard.after_step = _timed(spent, guard.guard.after_step)  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(1)
    model.train()

    def step() -> None:
        for _ in range(GA):
            ids = torch.randint(0, SIZE["vocab_size"], (BATCH, T), generator=g)
            with accelerator.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

    return step, guard


def times(mixed_precision: str, rounds: int) -> dict[str, float]:
    """The unguarded and the guarded loop interleaved; and the guard's own time a step."""
    spent: list[float] = []
    plain, _ = _loop(mixed_precision, False, spent)
    guarded, guard = _loop(mixed_precision, True, spent)
    out = interleaved({"plain": plain, "guarded": guarded}, rounds=rounds)
    assert guard is not None and guard.guard is not None and guard.skipped == 0
    out["own"] = sum(spent) / guard.guard.step_count
    guard.close()
    return out


HEADER = (
    "| mixed precision | unguarded ms/step | guarded ms/step | ratio (median) | range "
    "| guard's own ms/step (share) |\n|---|---|---|---|---|---|"
)


def section(precisions: list[str], rounds: int, repeats: int) -> str:
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in precisions}
    loads = [os.getloadavg()[0]]
    for _ in range(repeats):  # the precisions alternate, so a load swing hits each alike
        for p in precisions:
            runs[p].append(times(p, rounds))
            loads.append(os.getloadavg()[0])
    rows = []
    for p in precisions:
        ratios = sorted(t["guarded"] / t["plain"] for t in runs[p])
        mid = sorted(runs[p], key=lambda t: t["guarded"] / t["plain"])[len(ratios) // 2]
        rows.append(
            f"| `{p}` | {mid['plain'] * 1e3:.2f} | {mid['guarded'] * 1e3:.2f} | {statistics.median(ratios):.3f}x "
            f"| {ratios[0]:.3f}-{ratios[-1]:.3f}x | {mid['own'] * 1e3:.2f} ({mid['own'] / mid['guarded']:.1%}) |"
        )
    from transformers import GPT2Config, GPT2LMHeadModel

    params = sum(p.numel() for p in GPT2LMHeadModel(GPT2Config(**SIZE)).parameters())
    conditions = (
        f"A {params:,}-parameter GPT-2 from its config, {GA} micro-batches of {BATCH}x{T} tokens a step, AdamW, "
        f"clip 1.0, one process, {rounds} interleaved rounds x {repeats} runs, 1-minute load average "
        f"{min(loads):.1f}-{max(loads):.1f}:"
    )
    reproduce = f"{SCRIPT} --rounds {rounds} --repeats {repeats} --threads {torch.get_num_threads()}"
    return f"""## Accelerate loops (LoopGuard on `run_clm_no_trainer.py`'s loop)

{conditions}

{HEADER}
{chr(10).join(rows)}

{machine()}; accelerate on the CPU; a shared machine. The unguarded and the guarded loop (the
documented lines added: `LoopGuard(model, optimizer, scheduler=lr_scheduler)`) run side by side, step by step;
a step is `accelerator.accumulate`, the forward, `accelerator.backward`, the clip on the last micro-batch,
`optimizer.step()`, `lr_scheduler.step()` and `optimizer.zero_grad()` for each of the {GA} micro-batches. The
ratio is the median over the runs (the run it comes from gives the ms columns), with the range over the runs.
"guard's own" is the time spent inside the guard per step: recording each forward's inputs and RNG state, the
check at the real `optimizer.step()`, and the bookkeeping after the update.
Reproduce: `{reproduce}`.

The guard's cost is per step, not per parameter beyond the one fused read of the gradients: on this tiny
model a step takes milliseconds, so the same cost is a larger share than it would be on a model of real size.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", nargs="+", default=["no", "bf16"], choices=["no", "bf16"])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3, help="runs per precision, the precisions alternating")
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op threads (1: on a shared machine more threads oversubscribe it)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["HF_HUB_OFFLINE"] = "1"
    warnings.filterwarnings("ignore")
    body = section(args.precisions, args.rounds, args.repeats)
    print(body)
    write_section("overhead-accelerate", body)


if __name__ == "__main__":
    main()
