"""``nanguard demo``: the tiny GPT trains, a zoo fault breaks it, the guard explains and skips."""

from __future__ import annotations

import time
from pathlib import Path

from nanguard.errors import NonFiniteError
from nanguard.guard import Guard
from nanguard.zoo import SCENARIOS, build, get, train_step

__all__ = ["list_faults", "run_demo"]


def list_faults() -> str:
    width = max(len(s.name) for s in SCENARIOS)
    return "\n".join(f"{s.name:<{width}}  {s.summary}" for s in SCENARIOS)


def run_demo(fault: str, *, steps: int = 8, ranks: int = 1, run_dir: str | None = None, seed: int = 0) -> int:
    """Train ``steps`` steps of the tiny GPT with ``fault`` injected; print what the guard finds.

    Example:
        >>> run_demo("padding_fully_masked", steps=6)
        0
    """
    scenario = get(fault)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if ranks > 1:
        from nanguard.zoo.demo_dist import run_distributed_demo

        return run_distributed_demo(scenario.name, steps=steps, ranks=ranks, run_dir=run_dir, seed=seed)
    from nanguard.report.terminal import Console

    console = Console()
    console.title(f"nanguard demo: {scenario.name}", scenario.summary)
    run = build(scenario, seed)
    if run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    guard = Guard(run.model, run.optimizer, policy="skip", run_dir=run_dir)
    start = time.perf_counter()
    first = None
    try:
        with console.progress(steps, "training") as advance:
            for step, batch in run.batches(steps):
                loss = guard.step(lambda batch=batch: train_step(run.model, batch), batch=batch)
                status = "ok" if guard.last_action == "step" else guard.last_action
                value = f"{loss.item():.4f}" if loss is not None else "-"
                advance(f"step {step:3d}  loss {value:>8}  {status}")
                first = first or guard.last_diagnosis
    except NonFiniteError as err:
        console.diagnosis(err.diagnosis)
        return 1
    finally:
        guard.close()
    elapsed = time.perf_counter() - start
    console.line(f"{steps} steps in {elapsed:.1f}s, {guard.skipped} skipped, {guard.rollbacks} rolled back")
    if first is not None:
        console.diagnosis(first)
    elif scenario.expect.cause is None:
        console.line("no trip: this scenario is healthy, and nanguard stayed quiet")
    if run_dir is not None:
        console.line(f"events and bundles in {run_dir}; see `nanguard report {run_dir}`")
    return 0
