"""The guard's own work per healthy step in the engines' loops, counted where their step times are too noisy
to show it: DeepSpeed ZeRO 1-3 and torchtitan FSDP2 / TP, the loops of ``deepspeed_overhead.py`` and
``torchtitan_overhead.py`` (2 gloo ranks, CPU).

Per step, on rank 0, guarded minus unguarded: the aten ops (a ``TorchDispatchMode``), the Python calls
(``sys.setprofile``: calls into Python and C functions alike) and the host reads (``aten._local_scalar_dense``,
which ``item``/``float``/``bool`` end in, and ``Tensor.tolist``). Each count is the median over the steps
counted (a precursor's sampled step, one in ``precursor_every``, stays out of it, as it does out of the
overhead benchmarks' median step time); a step is counted under one counter at a time.

With ``--baseline SRC`` each setup is also counted on the nanguard sources at SRC (a ``src/`` folder: the code
before a change), in processes of their own.

Writes the ``engine-cost`` section of BENCHMARKS.md.

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/engine_cost.py [--setups ...] [--steps N] [--baseline SRC]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent
SETUPS = ("zero1", "zero2", "zero3", "fsdp", "tp")
LABELS = {
    "zero1": "DeepSpeed ZeRO-1",
    "zero2": "DeepSpeed ZeRO-2",
    "zero3": "DeepSpeed ZeRO-3",
    "fsdp": "torchtitan FSDP2",
    "tp": "torchtitan TP",
}
WARMUP = 25  # past the first precursor sample (step 20) and the spike detectors' warm-up


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops += 1
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def _one_step(step: Callable[[], None]) -> tuple[int, int, int]:
    """aten ops, Python calls and host reads of one call of ``step`` (two calls: one per counter)."""
    with _Ops() as mode:
        step()
    calls = tolist = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls, tolist
        if event in ("call", "c_call"):
            calls += 1
            tolist += event == "c_call" and getattr(arg, "__name__", "") == "tolist"

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return mode.ops, calls, mode.reads + tolist


def rank_counts(rank: int, world: int, setup: str, steps: int) -> dict[str, float]:
    """One rank: the median counts of a plain and a guarded step, and the guarded minus the plain."""
    sys.path.insert(0, str(HERE))
    if setup.startswith("zero"):
        from deepspeed_overhead import loops as deepspeed_loops

        loops, guard = deepspeed_loops(rank, int(setup[-1]))
    else:
        from torchtitan_overhead import loops as titan_loops

        torch.set_num_threads(1)
        loops, guard = titan_loops(rank, world, setup), None
    for _ in range(WARMUP):
        for fn in loops.values():
            fn()
    counted: dict[str, list[tuple[int, int, int]]] = {kind: [] for kind in loops}
    for _ in range(steps):
        for kind, fn in loops.items():
            counted[kind].append(_one_step(fn))
    out: dict[str, float] = {}
    for i, name in enumerate(("ops", "calls", "reads")):
        plain = statistics.median(c[i] for c in counted["plain"])
        guarded = statistics.median(c[i] for c in counted["guarded"])
        out[f"plain_{name}"], out[f"guarded_{name}"], out[name] = plain, guarded, guarded - plain
    if guard is not None:
        guard.close()
    return out


def measure(setups: list[str], steps: int) -> dict[str, dict[str, float]]:
    """The counts of each setup, for the nanguard that ``import nanguard`` finds."""
    from nanguard.zoo.spawn import spawn_ranks

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return {setup: spawn_ranks(rank_counts, setup, steps, world=2, timeout=1800)[0] for setup in setups}


def _run(src: Path | None, setups: list[str], steps: int) -> dict[str, dict[str, float]]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(Path(__file__).resolve()), "--json", "--steps", str(steps), "--setups", *setups]
    out = subprocess.run(cmd, env=env, cwd=HERE, capture_output=True, text=True, check=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def _table(now: dict[str, dict[str, float]], before: dict[str, dict[str, float]] | None) -> str:
    cols = [("aten ops", "ops", "{:+.0f}"), ("Python calls", "calls", "{:+.0f}"), ("host reads", "reads", "{:+.0f}")]
    head = "| loop | " + " | ".join(
        f"{label} {when}" for label, _, _ in cols for when in (("now", "before") if before else ("now",))
    )
    rule = "|---|" + "---:|" * (len(cols) * (2 if before else 1) + 1)
    lines = [head + " | plain step: aten ops, Python calls |", rule]
    for setup, c in now.items():
        cells = []
        for _, key, fmt in cols:
            cells.append(fmt.format(c[key]))
            if before:
                cells.append(fmt.format(before[setup][key]))
        plain = f"{c['plain_ops']:.0f}, {c['plain_calls']:.0f}"
        lines.append(f"| {LABELS[setup]} | " + " | ".join(cells) + f" | {plain} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    parser.add_argument("--steps", type=int, default=10, help="steps counted per loop (each counter)")
    parser.add_argument("--baseline", type=Path, help="nanguard sources to compare with (a src/ folder)")
    parser.add_argument("--json", action="store_true", help="print this process's counts as JSON (internal)")
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.setups, args.steps)))
        return
    from _common import machine, write_section

    now = _run(None, args.setups, args.steps)
    before = _run(args.baseline.resolve(), args.setups, args.steps) if args.baseline is not None else None
    baseline = f' "before": the sources at `{args.baseline}`.' if before else ""
    conditions = (
        f"Guarded minus unguarded per healthy step, rank 0 of 2 gloo ranks, the median over {args.steps} steps "
        f"of each counter after {WARMUP} warm-up steps:"
    )
    body = f"""## The guard's own work per healthy step in the engines' loops (counts)

{conditions}

{_table(now, before)}

The loops of `deepspeed_overhead.py` (a 136,000-parameter GPT, fp32, AdamW) and `torchtitan_overhead.py` (its
shrunk llama3), each step counted under one counter at a time: the aten ops (a `TorchDispatchMode`), the Python
calls (`sys.setprofile`, calls into Python and C functions alike) and the host reads
(`aten._local_scalar_dense`, which `item`, `float` and `bool` end in, and `Tensor.tolist`). Counts do not drift
with the machine's load, as the overhead benchmarks' step times do; a precursor's sampled step (one in 20) stays
out of the median, as it does out of their median step time.{baseline} {machine()}.
Reproduce: `DS_ACCELERATOR=cpu .venv/bin/python benchmarks/engine_cost.py [--baseline SRC]`.
"""
    print(body)
    write_section("engine-cost", body)


if __name__ == "__main__":
    main()
