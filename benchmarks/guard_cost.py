"""The guard's own work per healthy step, counted where timing is too noisy to tell.

On a shared 2-core machine a step's time drifts by 1-3% from run to run, as much as a change to
the guard's per-step work. Counts do not drift:

- aten ops the guard adds per healthy step of the tiny GPT (a ``TorchDispatchMode`` counts the
  ops of a guarded step and of the plain one), with the default options, averaged over two precursor
  sampling periods (``precursor_every=20``: the sampled steps count as often as a run has them);
- Python calls it adds (``sys.setprofile``, calls into Python and C functions alike), averaged the same way,
  and on the steps between two precursor samples alone (``precursor_every=0``: what every step pays);
- its own time per step on a 4-parameter model, where reading the tensors costs next to nothing:
  the median of interleaved rounds, guarded minus plain; and, in the same rounds, what the floor
  of any check (the guard's two reads alone: the gradient norm, the parameter norm after the
  update) and the RNG capture before each step (``nanguard.rng.capture_rng``) take of it.

With ``--baseline SRC`` each count is also taken on the nanguard sources at SRC (a ``src/``
folder: the code before a change), in a process of its own; ``--repeats K`` alternates K
processes of each and keeps each measure's median (the machine's load drifts between processes).

Run: ``.venv/bin/python benchmarks/guard_cost.py [--rounds N] [--baseline SRC] [--repeats K]``;
writes BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent


def _period() -> int:
    """Steps a count covers: two of the default precursor sampling periods (the average a run pays,
    sampled steps included), else 20 (sources without precursors)."""
    from nanguard.guard.config import GuardConfig

    every = getattr(GuardConfig(), "precursor_every", 0)
    return 2 * every if every else 20


def _counts(step: Callable[[], None]) -> tuple[float, float]:
    """aten ops and Python calls per call of ``step``, averaged over ``_period()`` steps, after a warmup
    past the first precursor sample (which names the model's modules once)."""
    from _common import CountOps

    steps = _period()
    for _ in range(steps // 2 + 3):
        step()
    with CountOps() as mode:
        for _ in range(steps):
            step()
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(profile)
    try:
        for _ in range(steps):
            step()
    finally:
        sys.setprofile(None)
    return mode.ops / steps, calls / steps


def _tiny_loops(**options: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    import nanguard as ng
    from nanguard.zoo import GPTConfig, train_step
    from overhead import _batches, _setup

    cfg = GPTConfig()
    model, opt = _setup(cfg)
    nxt = _batches(cfg)

    def plain() -> None:
        train_step(model, nxt())
        opt.step()

    g_model, g_opt = _setup(cfg)
    g_next = _batches(cfg)
    guard = ng.Guard(g_model, g_opt, policy="skip", **options)

    def guarded() -> None:
        batch = g_next()
        guard.step(lambda: train_step(g_model, batch), batch=batch)

    return plain, guarded


def _micro_loops() -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
    """The plain step, the plain step with the guard's two reads alone, and the guarded step."""
    import nanguard as ng
    from nanguard.stats import total_norm

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        return model, torch.optim.SGD(model.parameters(), lr=1e-3), torch.randn(8, 4)

    model, opt, x = build()
    r_model, r_opt, r_x = build()
    r_params = list(r_model.parameters())
    g_model, g_opt, g_x = build()
    guard = ng.Guard(g_model, g_opt, policy="skip")

    def plain() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).sum().backward()
        opt.step()

    def reads() -> None:
        r_opt.zero_grad(set_to_none=True)
        r_model(r_x).sum().backward()
        with torch.no_grad():
            total_norm([[p.grad for p in r_params]])
        r_opt.step()
        with torch.no_grad():
            total_norm([r_params])

    def closure() -> torch.Tensor:
        g_opt.zero_grad(set_to_none=True)
        loss = g_model(g_x).sum()
        loss.backward()
        return loss

    return plain, reads, lambda: guard.step(closure)


def measure(rounds: int) -> dict[str, float]:
    """The three counts for the nanguard that ``import nanguard`` finds."""
    plain, guarded = _tiny_loops()
    (p_ops, p_calls), (g_ops, g_calls) = _counts(plain), _counts(guarded)
    plain, unsampled = _tiny_loops(precursor_every=0)  # the steps between two precursor samples
    (_, p_calls_0), (_, g_calls_0) = _counts(plain), _counts(unsampled)
    import nanguard.rng

    # What the guard calls before each step (older sources: get_rng_state).
    capture = getattr(nanguard.rng, "capture_rng", nanguard.rng.get_rng_state)
    plain, reads, guarded = _micro_loops()
    loops = {"plain": plain, "reads": reads, "guarded": guarded, "rng": capture}
    times: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(200):
        for fn in loops.values():
            fn()
    for _ in range(rounds):
        for name, fn in loops.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(ts) * 1e6 for name, ts in times.items()}
    return {
        "ops": g_ops - p_ops,
        "calls": g_calls - p_calls,
        "calls_unsampled": g_calls_0 - p_calls_0,
        "own_us": median["guarded"] - median["plain"],
        "floor_us": median["reads"] - median["plain"],
        "rng_us": median["rng"],
    }


def _medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def _run(src: Path | None, rounds: int) -> dict[str, float]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(Path(__file__).resolve()), "--json", "--rounds", str(rounds)]
    out = subprocess.run(cmd, env=env, cwd=HERE, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--baseline", type=Path, help="nanguard sources to compare with (a src/ folder)")
    parser.add_argument("--repeats", type=int, default=1, help="processes of each, alternated; medians kept")
    parser.add_argument("--json", action="store_true", help="print this process's counts as JSON (internal)")
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.rounds)))
        return
    from _common import machine, write_section

    start_load = os.getloadavg()[0]
    nows: list[dict[str, float]] = []
    befores: list[dict[str, float]] = []
    for _ in range(args.repeats):
        nows.append(_run(None, args.rounds))
        if args.baseline is not None:
            befores.append(_run(args.baseline.resolve(), args.rounds))
    now, before = _medians(nows), (_medians(befores) if befores else None)
    rows = [
        ("aten ops added per healthy step (tiny GPT)", "ops", "{:.1f}"),
        ("Python calls added per healthy step (tiny GPT)", "calls", "{:.0f}"),
        ("Python calls added per step that samples no precursor (`precursor_every=0`)", "calls_unsampled", "{:.0f}"),
        ("the guard's own time per step, 4-parameter model (us)", "own_us", "{:.0f}"),
        ("of it, the two reads alone: gradient norm, parameter norm after the update (us)", "floor_us", "{:.0f}"),
        ("of it, the RNG capture before the step, `capture_rng()` (us)", "rng_us", "{:.1f}"),
    ]
    head = "| measure | now |" + (" before |" if before else "")
    rule = "|---|---:|" + ("---:|" if before else "")
    lines = [head, rule]
    for label, key, fmt in rows:
        lines.append(f"| {label} | {fmt.format(now[key])} |" + (f" {fmt.format(before[key])} |" if before else ""))
    table = "\n".join(lines)
    runs = f"{args.repeats} processes of each, alternated, medians" if args.repeats > 1 else "one process"
    baseline = f' The "before" column ran on the sources at `{args.baseline}`.' if before else ""
    conditions = (  # one line above the table (tests/test_docs.py)
        f"Healthy guarded steps beyond the plain ones, default options; counts: the average over {_period()} steps "
        f"(the precursors' sampled steps included); times: median of {args.rounds} interleaved rounds, {runs}."
    )
    body = f"""## The guard's own work per step (counts)

{conditions}

{table}

Counted where a step's time is too noisy to show it: the aten ops and Python calls a guarded healthy step
of the tiny GPT makes beyond the plain one (the calls also of a step between two precursor samples, the
average less the sampled steps' share), and the guard's own time on a 4-parameter model, where reading
the tensors costs next to nothing. The floor of any check that reads every gradient and parameter once is
the two reads alone (the same `total_norm` calls in a plain loop); the target is the guard's work above it,
<= 0.1 ms a step on CPU. The RNG capture lets a replay or a skip draw what the step drew from torch's,
Python's `random` and numpy's legacy generators.{baseline}

Machine: {machine()}, load average {start_load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end. Reproduce:
`.venv/bin/python benchmarks/guard_cost.py [--baseline SRC] [--repeats K]`."""
    write_section("guard-cost", body)
    print(body)


if __name__ == "__main__":
    main()
