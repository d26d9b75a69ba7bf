"""The fault zoo scored for nanguard and the reference tools, on the same scenarios.

Tools:
- ``torch.autograd.detect_anomaly(check_nan=True)``: the backward node it names;
- Hugging Face ``DebugUnderflowOverflow``: the module whose forward hook saw inf/nan first;
- a plain check of the loss and gradient norm after backward: detection only;
- nanguard: ``Guard`` with its replay (``nanguard.zoo.runner``).

Every tool trains the scenario's tiny GPT from the same seed up to its fault step and then
runs the faulty step. Scored per scenario: detected, right module, right op, right phase,
cause named, false alarm (a trip on a healthy scenario), and seconds.

Run: ``.venv/bin/python benchmarks/zoo_compare.py [--ranks 2]``; writes BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from _common import machine, write_section
from nanguard.text import short_op
from nanguard.zoo import SCENARIOS, Scenario, build
from nanguard.zoo.runner import run_distributed, run_scenario


@dataclass
class Score:
    detected: bool
    module: bool = False
    op: bool = False
    phase: bool = False
    cause: bool = False
    seconds: float = 0.0
    note: str = ""


def _norm(name: str | None) -> str:
    """``aten._softmax.default`` / ``SoftmaxBackward0`` -> ``softmax``: comparable op names."""
    return re.sub(r"Backward\d*$", "", short_op(name)).replace("_", "").lower()


def _steps_until_fault(s: Scenario, step_fn: Callable[[Any, dict], bool]) -> tuple[bool, float]:
    """Train with ``step_fn`` until it reports a detection or the run ends; (detected, seconds)."""
    run = build(s)
    start = time.perf_counter()
    for step in range(s.run_steps):
        if step_fn(run, run.batch(step)):
            return True, time.perf_counter() - start
    return False, time.perf_counter() - start


def plain_check(s: Scenario) -> Score:
    def step(run: Any, batch: dict) -> bool:
        try:
            loss = run.closure(batch)()
        except (IndexError, RuntimeError):
            return True
        grads = [p.grad for p in run.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if not (math.isfinite(loss.item()) and math.isfinite(norm.item())):
            return True
        run.optimizer_step()
        return False

    detected, seconds = _steps_until_fault(s, step)
    return Score(detected, seconds=seconds)


def anomaly(s: Scenario) -> Score:
    found: dict[str, Any] = {}

    def step(run: Any, batch: dict) -> bool:
        try:
            with warnings.catch_warnings(), torch.autograd.detect_anomaly(check_nan=True):
                warnings.simplefilter("ignore")
                loss = run.closure(batch)()
        except RuntimeError as err:
            match = re.search(r"Function '(\w+)' returned nan", str(err))
            found["node"] = match.group(1) if match else None
            return True
        except IndexError:
            found["node"] = None
            return True
        if not math.isfinite(loss.item()):
            found["node"] = None  # it only watches backward: a NaN loss with clean gradients passes
            return False
        run.optimizer_step()
        return False

    detected, seconds = _steps_until_fault(s, step)
    node = found.get("node")
    e = s.expect
    return Score(
        detected,
        op=bool(node) and _norm(node) == _norm(e.op),
        phase=detected and e.phase == "backward",
        seconds=seconds,
        note=node or "",
    )


def hf_debug(s: Scenario) -> Score:
    from transformers.debug_utils import DebugUnderflowOverflow

    found: dict[str, Any] = {}

    def step(run: Any, batch: dict) -> bool:
        if "debug" not in found:
            # Our hook goes first, so the last module it records is the one whose hook raised.
            seen: list[str] = []
            for name, module in run.model.named_modules():
                module.register_forward_hook(lambda m, a, out, name=name: seen.append(name))
            found["debug"] = DebugUnderflowOverflow(run.model)
            found["seen"] = seen
            # It calls .abs() on every input and fails on a bool attention mask: no hooks there.
            for block in getattr(run.model, "blocks", []):
                for m in (block, block.attn):
                    hooks = m._forward_hooks
                    for key in [k for k, h in hooks.items() if getattr(h, "__self__", None) is found["debug"]]:
                        del hooks[key]
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                run.closure(batch)()
        except ValueError as err:
            if "DebugUnderflowOverflow" not in str(err):
                raise
            found["module"] = found["seen"][-1] if found["seen"] else None
            return True
        except (IndexError, RuntimeError):
            found["module"] = None
            return True
        run.optimizer_step()
        return False

    detected, seconds = _steps_until_fault(s, step)
    module = found.get("module")
    e = s.expect
    return Score(
        detected,
        module=module is not None and module == e.module,
        phase=detected and e.phase == "forward",
        seconds=seconds,
        note=str(module) if module is not None else "",
    )


def nanguard_score(s: Scenario) -> Score:
    result = run_distributed(s) if s.ranks > 1 else run_scenario(s)
    got = result.got or {}
    e = s.expect
    return Score(
        detected=result.got is not None,
        module=got.get("module") == e.module,
        op=got.get("op") == e.op,
        phase=got.get("phase") == e.phase,
        cause=got.get("cause") == e.cause,
        seconds=result.seconds,
        note=str(got.get("cause", "")),
    )


TOOLS: dict[str, Callable[[Scenario], Score]] = {
    "nanguard": nanguard_score,
    "detect_anomaly": anomaly,
    "HF DebugUnderflowOverflow": hf_debug,
    "plain loss/grad-norm check": plain_check,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=1, help="2 also runs the distributed scenarios (nanguard only)")
    args = parser.parse_args()
    scenarios = [s for s in SCENARIOS if s.ranks == 1 or args.ranks >= s.ranks]
    faults = [s for s in scenarios if s.expect.cause is not None]
    healthy = [s for s in scenarios if s.expect.cause is None]
    table: dict[str, dict[str, Score]] = {}
    for s in scenarios:
        table[s.name] = {}
        for tool, fn in TOOLS.items():
            if s.ranks > 1 and tool != "nanguard":
                continue
            try:
                table[s.name][tool] = fn(s)
            except Exception as err:  # a reference tool that crashes on a scenario scores nothing
                table[s.name][tool] = Score(False, note=f"crashed: {type(err).__name__}")
        print(s.name, {t: (sc.detected, sc.note) for t, sc in table[s.name].items()}, flush=True)

    def total(tool: str, attr: str, group: list[Scenario]) -> int:
        return sum(bool(getattr(table[s.name][tool], attr)) for s in group if tool in table[s.name])

    lines = [
        "| tool | scenarios run | detected | right module | right op | right phase | cause named |"
        " false alarms | median s / scenario |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for tool in TOOLS:
        ran = [s for s in faults if tool in table[s.name]]
        times = sorted(table[s.name][tool].seconds for s in scenarios if tool in table[s.name])
        alarms = sum(table[s.name][tool].detected for s in healthy)
        lines.append(
            f"| {tool} | {len(ran)} | {total(tool, 'detected', ran)} | {total(tool, 'module', ran)} | "
            f"{total(tool, 'op', ran)} | {total(tool, 'phase', ran)} | {total(tool, 'cause', ran)} | "
            f"{alarms}/{len(healthy)} | {times[len(times) // 2]:.2f} |"
        )
    detail = ["| scenario | expected cause | " + " | ".join(TOOLS) + " |", "|---|---|" + "---|" * len(TOOLS)]
    for s in scenarios:
        cells = []
        for tool in TOOLS:
            sc = table[s.name].get(tool)
            if sc is None:
                cells.append("n/a")
                continue
            marks = "detected" if sc.detected else "missed"
            if s.expect.cause is None:
                marks = "false alarm" if sc.detected else "quiet (ok)"
            elif sc.detected:
                right = [k for k in ("module", "op", "phase", "cause") if getattr(sc, k)]
                marks += f" ({', '.join(right)})" if right else ""
            cells.append(marks + (f": `{sc.note}`" if sc.note and tool != "nanguard" else ""))
        detail.append(f"| {s.name} | {s.expect.cause or 'healthy'} | " + " | ".join(cells) + " |")
    body = f"""## Fault zoo: nanguard against the reference tools

{len(faults)} faulty and {len(healthy)} healthy scenarios (`nanguard.zoo`), each a short training run of the tiny
GPT from the same seed. "Right module/op/phase" compares with the scenario's expectation; detect_anomaly
names a backward node, compared by op name (`LogBackward0` ~ `aten.log.default`); DebugUnderflowOverflow
names the module whose forward saw inf/nan first (its hooks are removed from the attention blocks, where it
crashes on the bool mask). Distributed scenarios run for nanguard only: the reference tools have no notion
of ranks.

{chr(10).join(lines)}

<details><summary>Per scenario</summary>

{chr(10).join(detail)}

</details>

Machine: {machine()}. Reproduce: `.venv/bin/python benchmarks/zoo_compare.py --ranks 2` (needs the `bench` extra)."""
    write_section("zoo-compare", body)
    print(body)


if __name__ == "__main__":
    main()
