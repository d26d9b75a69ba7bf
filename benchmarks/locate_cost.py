"""Cost of ``ng.locate`` against the plain step: ratio of medians, interleaved, and peak memory.

Users meet ``locate`` on a faulty step (the guard replays a tripped one), where NaN flows
through most later ops, forward and backward, and every one of them is tracked. The faulty
rows plant the fault early: a forward hook takes the log of a module's output (about half
of it negative), so NaN runs through the rest of the forward and the whole backward. The
healthy rows time the same models without the fault, for comparison.

Each row runs in its own process, on the sources of this checkout. With ``--baseline SRC`` the
same rows also run against the nanguard sources at SRC (``/work/main/src``: the code before a
change), alternating the two processes row by row, so before and after share the machine's load.

Peak memory (Linux): the resident-set high-water mark above the resting RSS while one plain
step runs, and while one ``locate`` runs (``/proc/self/clear_refs`` resets the mark).

Beside the times, two numbers the machine's load does not move: the Python calls ``locate`` adds
per aten op (cProfile's count over one ``locate`` minus one plain step, over the step's aten ops),
and the floor of any op-level tracer, the step under a ``TorchDispatchMode`` that only runs each op.

Run: ``.venv/bin/python benchmarks/locate_cost.py [--rounds N] [--gpt2-rounds N] [--no-gpt2] [--baseline SRC]``;
writes BENCHMARKS.md. The GPT-2 row (81M parameters) needs transformers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

HERE = Path(__file__).resolve().parent
ROWS = {
    "tiny-healthy": "tiny GPT (the zoo's default): 2 layers, d=128, T=32, batch 8, healthy step",
    "tiny-faulty": "tiny GPT (the zoo's default): 2 layers, d=128, T=32, batch 8, faulty step (log of blocks.0.mlp.fc)",
    "small-healthy": "small GPT: 4 layers, d=384, T=64, batch 8, healthy step",
    "small-faulty": "small GPT: 4 layers, d=384, T=64, batch 8, faulty step (log of blocks.0.mlp.fc)",
    "gpt2-faulty": (
        "GPT-2 (transformers): 6 layers, d=768, vocab 50257, 2 x 128 tokens, 1 thread, faulty step (log of h.4.mlp.act)"
    ),
}


def _plant_log_fault(module: nn.Module) -> None:
    """From now on ``module`` returns the log of its output: NaN wherever the output was negative."""
    module.register_forward_hook(lambda _m, _args, output: output.log())


def _gpt(row: str) -> tuple[nn.Module, Callable[[], Any]]:
    from nanguard.zoo import GPT, GPTConfig, synthetic_batch, train_step

    cfg = GPTConfig() if row.startswith("tiny") else GPTConfig(n_layer=4, n_embd=384, n_head=6, block_size=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    batch = synthetic_batch(cfg, torch.Generator().manual_seed(0))
    if row.endswith("faulty"):
        _plant_log_fault(model.blocks[0].mlp.fc)
    return model, lambda: train_step(model, batch)


def _gpt2() -> tuple[nn.Module, Callable[[], Any]]:
    """GPT-2 small's widths with 6 layers (81M parameters), 2 x 128 tokens, fault in h.4's MLP activation."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=6, n_embd=768, n_head=12, vocab_size=50257, n_positions=128)
    model = GPT2LMHeadModel(config)
    _plant_log_fault(model.transformer.h[4].mlp.act)
    ids = torch.randint(0, config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    return model, step


class _ReadOutputs(TorchDispatchMode):
    """Runs each aten op and reads whether each floating output is finite (a sum, read on the host): the least
    an exact op-level tracer that judges each op as it runs does, before any bookkeeping."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for o in [out] if isinstance(out, torch.Tensor) else tree_leaves(out):
            if isinstance(o, torch.Tensor) and o.is_floating_point() and o.numel():
                math.isfinite(o.sum().item())
        return out


def _reading_outputs(step: Callable[[], Any]) -> None:
    with _ReadOutputs():
        step()


def _in_empty_mode(step: Callable[[], Any]) -> int:
    """Run ``step`` under ``CountOps``; the number of aten ops it ran."""
    from _common import CountOps

    with CountOps() as mode:
        step()
    return mode.ops


def _calls(fn: Callable[[], Any]) -> int:
    """Python calls (functions and builtins) one run of ``fn`` makes, as cProfile counts them."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.runcall(fn)
    return sum(row[1] for row in pstats.Stats(profile).stats.values())  # type: ignore[attr-defined]


def _peak_mib(fn: Callable[[], Any]) -> float | None:
    """The RSS high-water mark above the resting RSS while ``fn`` runs, MiB (None off Linux)."""
    status, clear = Path("/proc/self/status"), Path("/proc/self/clear_refs")
    if not (status.exists() and clear.exists()):
        return None

    def kib(field: str) -> int:
        line = next(line for line in status.read_text().splitlines() if line.startswith(field + ":"))
        return int(line.split()[1])

    clear.write_text("5")  # high-water mark := current RSS
    before = kib("VmRSS")
    fn()
    return (kib("VmHWM") - before) / 1024


def child(row: str, rounds: int) -> dict[str, Any]:
    """Time one row in this process: medians of interleaved rounds, then peak memory."""
    import nanguard as ng
    from _common import interleaved

    if row.startswith("gpt2"):
        torch.set_num_threads(1)
        model, step = _gpt2()
        warmup = 1
    else:
        model, step = _gpt(row)
        warmup = 3
    if row.endswith("faulty"):  # the benchmark times the fault it claims to time
        diag = ng.locate(step, model=model)
        assert diag is not None and diag.cause == "op.log_domain", diag
    configs = {
        "plain": step,
        "locate": lambda: ng.locate(step, model=model),
        "mode": lambda: _in_empty_mode(step),
        "read": lambda: _reading_outputs(step),
    }
    times = interleaved(configs, rounds=rounds, warmup=warmup)
    memory = {name: _peak_mib(configs[name]) for name in ("plain", "locate")}
    ops = _in_empty_mode(step)
    per_op = (_calls(configs["locate"]) - _calls(step)) / ops
    return {"times": times, "memory": memory, "calls_per_op": per_op, "ops": ops}


def _run(row: str, rounds: int, src: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", row, "--rounds", str(rounds)]
    done = subprocess.run(cmd, env=env, cwd=HERE, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cells(results: list[dict[str, Any]]) -> tuple[float, float, float, str, str]:
    """Plain ms, locate ms, ratio of medians (median over the processes), peak memory ratio, and the
    cells of the empty mode's ratio, the aten ops and the calls per op."""
    plain = statistics.median(r["times"]["plain"] for r in results) * 1e3
    located = statistics.median(r["times"]["locate"] for r in results) * 1e3
    ratio = statistics.median(r["times"]["locate"] / r["times"]["plain"] for r in results)
    floor = statistics.median(r["times"]["mode"] / r["times"]["plain"] for r in results)
    read = statistics.median(r["times"]["read"] / r["times"]["plain"] for r in results)
    per_op = statistics.median(r["calls_per_op"] for r in results)
    counts = f"{floor:.2f}x | {read:.2f}x | {results[0]['ops']} | {per_op:.1f}"
    peaks = [r["memory"] for r in results if r["memory"]["plain"] is not None]
    memory = "n/a"
    if peaks:
        plain_mib = statistics.median(p["plain"] for p in peaks)
        locate_mib = statistics.median(p["locate"] for p in peaks)
        memory = f"{plain_mib:.0f} / {locate_mib:.0f} MiB"
        if plain_mib >= 50:  # a smaller step's peak is lost among the allocator's reused pages
            memory += f" = {locate_mib / plain_mib:.2f}x"
    return plain, located, ratio, memory, counts


def _commit(src: Path) -> str:
    """ ", a worktree of COMMIT" when ``src`` is inside a git checkout, else nothing."""
    done = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f", a worktree of {done.stdout.strip()}" if done.returncode == 0 else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--gpt2-rounds", type=int, default=5)
    parser.add_argument("--no-gpt2", action="store_true", help="skip the 81M GPT-2 row")
    parser.add_argument("--baseline", type=Path, help="nanguard sources to compare with (a src/ folder)")
    parser.add_argument("--processes", type=int, default=2, help="processes per row and version")
    parser.add_argument("--child", choices=list(ROWS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.rounds)))
        return
    from _common import machine, write_section

    rows = [r for r in ROWS if not r.startswith("gpt2")]
    if not args.no_gpt2 and importlib.util.find_spec("transformers") is not None:
        rows.append("gpt2-faulty")
    load_before = os.getloadavg()[0]
    versions = {"after": HERE.parent / "src"}
    if args.baseline is not None:
        versions = {"before": args.baseline.resolve(), **versions}
    lines = []
    for row in rows:
        rounds = args.gpt2_rounds if row.startswith("gpt2") else args.rounds
        results: dict[str, list[dict[str, Any]]] = {v: [] for v in versions}
        for _ in range(args.processes):
            for version, src in versions.items():
                results[version].append(_run(row, rounds, src))
        cells = {v: _cells(rs) for v, rs in results.items()}
        plain, located, ratio, memory, counts = cells["after"]
        line = f"| {ROWS[row]} | {plain:.0f} | {located:.0f} | {ratio:.2f}x | {counts} | {memory} |"
        if "before" in cells:
            _, _, b_ratio, b_memory, b_counts = cells["before"]
            line += f" {b_ratio:.2f}x | {b_counts.rpartition(' | ')[2]} | {b_memory} |"
        lines.append(line)
        print(line, flush=True)
    rounds = f"{args.rounds} interleaved rounds" + (
        " (GPT-2: " + str(args.gpt2_rounds) + ")" if "gpt2-faulty" in rows else ""
    )
    header = (
        "| model, step | plain step ms | locate ms | ratio | empty dispatch mode | mode reading every output | "
        "aten ops | Python calls added per op | peak memory above rest: plain / locate |"
    )
    rule = "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    if args.baseline is not None:
        header += " ratio before | calls per op before | peak memory before |"
        rule += "---:|---:|---:|"
    table = "\n".join([header, rule, *lines])
    before = (
        f"\nThe before columns run the nanguard sources at `{args.baseline}`{_commit(args.baseline)}."
        if args.baseline
        else ""
    )
    threads = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if "OMP_NUM_THREADS" in os.environ else ""
    body = f"""## Locate replay cost

`ng.locate(step)` against the same plain step: medians of {rounds}, median over {args.processes} processes per row.

{table}

The plain step is a float32 forward + backward; the ratio is of the two medians. A faulty step is the case
users meet: the guard replays a tripped step, where NaN flows through every op after the fault, forward and
backward, and each is tracked; the healthy rows are for comparison. Targets (issue 16): <= 2.5x on the faulty
tiny GPT, <= 2x on the faulty GPT-2, peak memory <= 1.2x the plain step's; issue 44: <= 1.5x on the tiny GPT.
Peak memory is the resident-set high-water mark above the resting process while one step (or one locate) runs.
The empty dispatch mode is the same step under a `TorchDispatchMode` that only runs each op: the floor of any
tracer that sees every aten op, which the tiny GPT's short ops feel most. The mode reading every output adds
to it a finiteness read (a sum, read on the host) of each floating output: the least a tracer that judges each
op as it runs does before any bookkeeping (which op created a value, from which inputs, in which module and
line). On the tiny GPT it is already near 1.5x. The Python calls added per op
(cProfile's count of one `locate` minus one plain step, over the step's aten ops) do not move with the
machine's load; the times do.

Machine: {machine()}; load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end
(times from a loaded machine are indicative only).
Reproduce: `{threads}.venv/bin/python benchmarks/locate_cost.py {" ".join(sys.argv[1:])}`
(`make bench` runs the defaults).{before}"""
    write_section("locate-cost", body)
    print(body)


if __name__ == "__main__":
    main()
