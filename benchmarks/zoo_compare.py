"""The fault zoo scored for nanguard and the reference tools, on the same scenarios.

Tools:
- ``torch.autograd.detect_anomaly(check_nan=True)``: the backward node it names;
- Hugging Face ``DebugUnderflowOverflow``: the module whose forward hook saw inf/nan first;
- a plain check of the loss and gradient norm after backward: detection only;
- nanguard: ``Guard`` with its replay (``nanguard.zoo.runner``).

Every tool trains the scenario's tiny GPT from the same seed up to its fault step and then
runs the faulty step; a wild scenario is its one faulty step. Scored per scenario: detected,
right module, op, phase, cause and rank (each only where the expectation names it, else n/a),
false alarm (a trip on a healthy scenario), and seconds.

Run: ``.venv/bin/python benchmarks/zoo_compare.py [--ranks 2] [--group wild]``; writes BENCHMARKS.md.
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
from nanguard.zoo import SCENARIOS, Expect, Scenario, WildScenario, build
from nanguard.zoo.runner import run_one
from nanguard.zoo.wild import WILD

FIELDS = ("module", "op", "phase", "cause", "rank")


@dataclass
class Score:
    """What one tool got on one scenario. A field is None ("n/a") where the expectation names nothing."""

    detected: bool
    module: bool | None = False
    op: bool | None = False
    phase: bool | None = False
    cause: bool | None = False
    rank: bool | None = None
    seconds: float = 0.0
    note: str = ""

    def only_named(self, e: Expect) -> Score:
        """This score with every field the expectation ``e`` leaves unnamed set to None, for every tool alike."""
        named = {"module": e.module, "op": e.op, "phase": e.phase, "cause": e.cause, "rank": e.rank}
        for name, want in named.items():
            if want is None:
                setattr(self, name, None)
            elif getattr(self, name) is None:
                setattr(self, name, False)
        return self


def _norm(name: str | None) -> str:
    """``aten._softmax.default`` / ``SoftmaxBackward0`` -> ``softmax``: comparable op names."""
    return re.sub(r"Backward\d*$", "", short_op(name)).replace("_", "").lower()


class _WildRun:
    """A wild case dressed as a zoo ``Run``: one step, whose "closure" is the case's own step."""

    def __init__(self, s: WildScenario) -> None:
        self.case = s.build()
        self.model = self.case.model

    def closure(self, batch: dict) -> Callable[[], torch.Tensor]:
        return lambda: self.case.fn(*self.case.args)

    def optimizer_step(self) -> None:
        return None


def _steps_until_fault(s: Scenario | WildScenario, step_fn: Callable[[Any, dict], bool]) -> tuple[bool, float]:
    """Train with ``step_fn`` until it reports a detection or the run ends; (detected, seconds)."""
    if isinstance(s, WildScenario):
        run: Any = _WildRun(s)
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return step_fn(run, {}), time.perf_counter() - start
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
        except Exception:  # the step raised (an id out of range, validate_args, multinomial): the run stops
            return True
        grads = [p.grad for p in run.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if not (math.isfinite(loss.detach().item()) and math.isfinite(norm.item())):
            return True
        run.optimizer_step()
        return False

    detected, seconds = _steps_until_fault(s, step)
    return Score(detected, seconds=seconds).only_named(s.expect)


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
        except Exception:  # any other raise stops the run too, naming no node
            found["node"] = None
            return True
        if not math.isfinite(loss.detach().item()):
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
    ).only_named(e)


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
            # It calls .abs() on every input and fails on a bool mask: no hooks where one is passed.
            for block in getattr(run.model, "blocks", []):
                for m in (block, block.attn):
                    hooks = m._forward_hooks
                    for key in [k for k, h in hooks.items() if getattr(h, "__self__", None) is found["debug"]]:
                        del hooks[key]
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                run.closure(batch)()
        except ValueError as err:
            # Its own detection raises naming itself; any other ValueError is the step's own raise.
            found["module"] = found["seen"][-1] if found["seen"] and "DebugUnderflowOverflow" in str(err) else None
            return True
        except (IndexError, RuntimeError) as err:
            if "bool" in str(err).lower():
                raise  # the tool itself failed on a bool input (a mask): a crash, not a detection
            found["module"] = None
            return True
        except (AssertionError, FloatingPointError):  # the step's own check raised
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
    ).only_named(e)


def nanguard_score(s: Scenario | WildScenario) -> Score:
    result = run_one(s)
    got = result.got or {}
    e = s.expect
    return Score(
        detected=result.got is not None,
        module=got.get("module") == e.module,
        op=got.get("op") == e.op,
        phase=got.get("phase") == e.phase,
        cause=got.get("cause") == e.cause,
        rank=got.get("rank") == e.rank and (e.ranks is None or got.get("ranks") == list(e.ranks)),
        seconds=result.seconds,
        note=str(got.get("cause", "")),
    ).only_named(e)


TOOLS: dict[str, Callable[[Any], Score]] = {
    "nanguard": nanguard_score,
    "detect_anomaly": anomaly,
    "HF DebugUnderflowOverflow": hf_debug,
    "plain loss/grad-norm check": plain_check,
}


def _run_all(scenarios: list[Any]) -> dict[str, dict[str, Score]]:
    table: dict[str, dict[str, Score]] = {}
    for s in scenarios:
        table[s.name] = {}
        for tool, fn in TOOLS.items():
            if getattr(s, "ranks", 1) > 1 and tool != "nanguard":
                continue
            try:
                table[s.name][tool] = fn(s)
            except Exception as err:  # a reference tool that crashes on a scenario scores nothing
                table[s.name][tool] = Score(False, note=f"crashed: {type(err).__name__}").only_named(s.expect)
        print(s.name, {t: (sc.detected, sc.note) for t, sc in table[s.name].items()}, flush=True)
    return table


def _summary_rows(table: dict[str, dict[str, Score]], scenarios: list[Any], label: str) -> list[str]:
    """One row per tool: detected, and right/named for each field; n/a where no scenario names the field."""
    faults = [s for s in scenarios if s.expect.cause is not None]
    healthy = [s for s in scenarios if s.expect.cause is None]
    rows = []
    for tool in TOOLS:
        ran = [s for s in faults if tool in table[s.name]]
        if not ran:
            continue
        cells = [f"{sum(table[s.name][tool].detected for s in ran)}/{len(ran)}"]
        for attr in FIELDS:
            named = [table[s.name][tool] for s in ran if getattr(table[s.name][tool], attr) is not None]
            cells.append(f"{sum(bool(getattr(sc, attr)) for sc in named)}/{len(named)}" if named else "n/a")
        times = sorted(table[s.name][tool].seconds for s in scenarios if tool in table[s.name])
        alarms = f"{sum(table[s.name][tool].detected for s in healthy)}/{len(healthy)}" if healthy else "n/a"
        rows.append(f"| {label} | {tool} | {' | '.join(cells)} | {alarms} | {times[len(times) // 2]:.2f} |")
    return rows


def _detail_row(s: Any, scores: dict[str, Score]) -> str:
    cells = []
    for tool in TOOLS:
        sc = scores.get(tool)
        if sc is None:
            cells.append("not run")
            continue
        marks = "detected" if sc.detected else "missed"
        if s.expect.cause is None:
            marks = "false alarm" if sc.detected else "quiet (ok)"
        elif sc.detected:
            right = [k for k in FIELDS if getattr(sc, k)]
            marks += f" ({', '.join(right)})" if right else ""
        cells.append(marks + (f": `{sc.note}`" if sc.note and tool != "nanguard" else ""))
    source = f" ({s.source})" if isinstance(s, WildScenario) else ""
    return f"| {s.group} | {s.name}{source} | {s.expect.cause or 'healthy'} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=1, help="2 also runs the distributed scenarios (nanguard only)")
    parser.add_argument("--group", choices=("all", "gpt", "wild"), default="all", help="which zoo group to score")
    args = parser.parse_args()
    gpt = [s for s in SCENARIOS if s.ranks == 1 or args.ranks >= s.ranks] if args.group != "wild" else []
    wild = list(WILD) if args.group != "gpt" else []
    table = _run_all([*gpt, *wild])
    head = "| group | tool | detected | right module | right op | right phase | cause named | right rank |"
    lines = [head + " false alarms | median s / scenario |", "|---|---|" + "---:|" * 8]
    lines += _summary_rows(table, gpt, "gpt") + _summary_rows(table, wild, "wild")
    detail = ["| group | scenario | expected cause | " + " | ".join(TOOLS) + " |"]
    detail.append("|---|---|---|" + "---|" * len(TOOLS))
    detail += [_detail_row(s, table[s.name]) for s in [*gpt, *wild]]
    n_healthy = sum(s.expect.cause is None for s in gpt)
    counts = f"{len(gpt)} tiny-GPT scenarios ({n_healthy} healthy) and {len(wild)} wild ones"
    title = "Fault zoo" + ("" if args.group == "all" else f", {args.group} group")
    body = f"""## {title}: nanguard against the reference tools

{counts}; each cell is right/named, over the scenarios whose expectation names the field:

{chr(10).join(lines)}

<details><summary>Per scenario</summary>

{chr(10).join(detail)}

</details>

The "gpt" group is `nanguard.zoo`'s short training runs of the tiny GPT from the same seed,
nanguard under its `Guard`; the "wild" group rebuilds NaN bugs from public issue trackers (each names its
report) as one faulty step of foreign code, nanguard through `ng.locate`. Each cell is right/named: a field
counts only in the scenarios whose expectation names it (a data fault names no op, a divergence names only
its cause), for every tool alike, and "n/a" where no scenario names it. Expectations come from the fault,
not from any tool's output. detect_anomaly names a backward node, compared by op name (`LogBackward0` ~
`aten.log.default`); DebugUnderflowOverflow names the module whose forward saw inf/nan first (its hooks are
removed from each tiny-GPT block and its attention module, where it crashes on the bool mask, so it can
never name those modules; a crash elsewhere is scored as a miss). Distributed scenarios run for nanguard
only: the reference tools have no notion of ranks.

Machine: {machine()}. Reproduce: `.venv/bin/python benchmarks/zoo_compare.py --ranks {args.ranks} --group {args.group}`
(needs the `bench` extra)."""
    # Each group has its own section, so one group can be rerun alone.
    write_section("zoo-compare" if args.group == "all" else f"zoo-compare-{args.group}", body)
    print(body)


if __name__ == "__main__":
    main()
