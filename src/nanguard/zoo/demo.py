"""``nanguard demo``: the tiny GPT trains, a zoo fault breaks it, the guard explains and skips."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from nanguard.errors import NonFiniteError
from nanguard.guard import Guard
from nanguard.zoo import SCENARIOS, build, get

if TYPE_CHECKING:
    from nanguard.findings import Diagnosis
    from nanguard.report.terminal import Console
    from nanguard.zoo.scenario import Run

__all__ = ["list_faults", "run_demo"]


def list_faults() -> str:
    width = max(len(s.name) for s in SCENARIOS)
    return "\n".join(f"{s.name:<{width}}  {s.summary}" for s in SCENARIOS)


def run_demo(
    fault: str,
    *,
    steps: int | None = None,
    ranks: int = 1,
    run_dir: str | None = None,
    seed: int = 0,
) -> int:
    """Train the tiny GPT with ``fault`` injected and print what the guard finds; 0 when it showed it.

    ``steps`` defaults to the scenario's own length; a scenario that needs ranks spawns them.
    ``nanguard demo`` passes ``run_dir="runs/demo"`` unless told otherwise.

    Example:
        >>> run_demo("padding_fully_masked")
        0
    """
    scenario = get(fault)
    steps = scenario.run_steps if steps is None else steps
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    if ranks > 1 or scenario.ranks > 1:
        from nanguard.zoo.demo_dist import run_distributed_demo

        world = max(ranks, scenario.ranks)
        return run_distributed_demo(scenario.name, steps=steps, ranks=world, run_dir=run_dir, seed=seed)
    from nanguard.report.terminal import Console

    console = Console()
    console.title(f"nanguard demo: {scenario.name}", scenario.summary)
    first = _train(console, build(scenario, seed), steps, run_dir)
    if first is not None:
        console.diagnosis(first)
    elif scenario.expect.cause is None:
        console.line("no trip: this scenario is healthy, and nanguard stayed quiet")
    else:
        console.line(f"no trip in {steps} steps; the fault hits at step {scenario.trip_step}: raise --steps")
        return 1
    if run_dir is not None:
        console.line(f"events and bundles in {run_dir}; see `nanguard report {run_dir}`")
    return 0


def _train(console: Console, run: Run, steps: int, run_dir: str | None) -> Diagnosis | None:
    """The guarded loop, a line a step; the first trip's diagnosis (or the one the guard raised with)."""
    # The demo shows the diagnosis itself: a long run of GradScaler overflows must reach its verdict.
    guard = Guard(
        run.model, run.optimizer, policy="skip", scaler=run.scaler, run_dir=run_dir, max_consecutive_skips=10**6
    )
    start = time.perf_counter()
    first: Diagnosis | None = None
    try:
        with console.progress(steps, "training") as advance, _narrate(console):
            for step, batch in run.batches(steps):
                loss = guard.step(run.closure(batch), batch=batch)
                run.after_step()  # the loop's own code after the update, and its LR schedule
                status = "ok" if guard.last_action == "step" else guard.last_action
                value = f"{loss.item():.4f}" if loss is not None else "-"
                advance(f"step {step:3d}  loss {value:>8}  {status}")
                first = first or guard.last_diagnosis
    except NonFiniteError as err:
        first = first or err.diagnosis
        console.line(f"the guard stopped the run: {err.diagnosis.cause if err.diagnosis else 'non-finite values'}")
    finally:
        guard.close()
    elapsed = time.perf_counter() - start
    console.line(f"{guard.step_count} steps in {elapsed:.1f}s, {guard.skipped} skipped, {guard.rollbacks} rolled back")
    return first


class _ReplayNews(logging.Handler):
    """Prints the guard's log lines in order with the steps, "replaying step N" included, so the
    replay's pause is not silent."""

    def __init__(self, console: Console) -> None:
        super().__init__(logging.INFO)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        # The first trip's whole diagnosis: the demo shows it after the steps, so here its line alone.
        self.console.line(record.getMessage().splitlines()[0])


@contextmanager
def _narrate(console: Console) -> Iterator[None]:
    logger = logging.getLogger("nanguard")
    handler, level = _ReplayNews(console), logger.level
    logger.addHandler(handler)
    logger.setLevel(min(level or logging.WARNING, logging.INFO))
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
