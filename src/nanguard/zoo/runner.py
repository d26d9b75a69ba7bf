"""``nanguard zoo``: every scenario as a short guarded training run, scored against its expectation.

For each scenario the run records the first trip's diagnosis and the step it was detected
at. A plain unguarded run of the same scenario gives the step where a non-finite loss or
gradient first appears, so "steps late" is measured, not assumed.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from nanguard.errors import NonFiniteError
from nanguard.findings import Diagnosis
from nanguard.guard import Guard
from nanguard.zoo.dist_scenarios import EDGE_FAULTS, edge_rank
from nanguard.zoo.scenarios import BY_FIRST_BAD, FIRST_BAD, SCENARIOS, Run, Scenario, WildScenario, build, get
from nanguard.zoo.wild import WILD, get_wild

if TYPE_CHECKING:
    from nanguard.report.terminal import Console

__all__ = ["GROUPS", "CorruptOnce", "Result", "dist_rank", "run_one", "run_scenario", "run_wild", "run_zoo"]

FIELDS = ("cause", "op", "module", "phase", "kind", "rank", "ranks")


@dataclass
class Result:
    name: str
    expected: dict[str, Any]
    got: dict[str, Any] | None
    detect_step: int | None
    first_bad_step: int | None
    seconds: float
    ranks_agree: bool = True

    @property
    def steps_late(self) -> int | None:
        if self.detect_step is None or self.first_bad_step is None:
            return None
        return self.detect_step - self.first_bad_step

    @property
    def expected_step(self) -> int | None:
        """The step the guard must trip at: a ``FIRST_BAD`` expectation read as the plain run's
        first bad step; a ``BY_FIRST_BAD`` one as the step it tripped at, when that is no later."""
        detect, first_bad = self.detect_step, self.first_bad_step
        if self.expected["step"] == BY_FIRST_BAD:
            return detect if detect is not None and first_bad is not None and detect <= first_bad else first_bad
        return self.first_bad_step if self.expected["step"] == FIRST_BAD else self.expected["step"]

    @property
    def ok(self) -> bool:
        if self.expected["cause"] is None:
            return self.got is None
        if self.got is None or not self.ranks_agree:
            return False
        # Only what the expectation names is scored (see Expect).
        fields_ok = all(self.got.get(k) == v for k, v in self.expected.items() if v is not None and k != "step")
        early = self.expected["step"] == BY_FIRST_BAD and (self.steps_late or 0) <= 0
        return fields_ok and self.got.get("step") == self.expected_step and (early or self.steps_late in (0, None))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "steps_late": self.steps_late, "ok": self.ok}


def _expected(s: Scenario | WildScenario) -> dict[str, Any]:
    step = s.trip_step if isinstance(s, Scenario) else 0
    expected = {k: getattr(s.expect, k) for k in FIELDS}
    if expected["ranks"] is not None:
        expected["ranks"] = list(expected["ranks"])
    return {**expected, "step": step}


def _summarized(diag: Diagnosis | None, step: int | None) -> tuple[dict[str, Any] | None, int | None]:
    return _summary(diag), step


def _summary(diag: Diagnosis | None) -> dict[str, Any] | None:
    if diag is None:
        return None
    return {**{k: getattr(diag, k) for k in FIELDS}, "ranks": list(diag.ranks), "step": diag.step}


def _guarded(run: Run, model: torch.nn.Module, **config: Any) -> tuple[Diagnosis | None, int | None]:
    """Train under the guard; return the first trip's diagnosis and the loop step it came at."""
    s = run.scenario
    guard = Guard(model, run.optimizer, policy="skip", scaler=run.scaler, max_consecutive_skips=10**6, **config)
    first: Diagnosis | None = None
    detect: int | None = None
    try:
        for step in range(s.run_steps):
            batch = run.batch(step)
            guard.step(run.closure(batch, model), batch=batch)
            run.after_step()
            if first is None and guard.last_diagnosis is not None:
                first, detect = guard.last_diagnosis, step
                break  # the first trip is scored; a run that keeps growing would trip (and replay) at every step
    except NonFiniteError as err:
        first, detect = first or err.diagnosis, detect if first else step
    return first, detect


def _first_bad_step(s: Scenario, seed: int) -> int | None:
    """The step where a plain, unguarded loop first sees a non-finite loss or gradient (or gradient norm)."""
    if s.amp or s.ranks > 1 or s.expect.cause is None:
        return None
    run = build(s, seed)
    for step in range(s.run_steps):
        try:
            loss = run.closure(run.batch(step))()
        except (IndexError, RuntimeError):
            return step  # an out-of-range id raises right there on CPU
        grads = [p.grad for p in run.model.parameters() if p.grad is not None]
        if not math.isfinite(loss.item()) or not all(bool(torch.isfinite(g).all()) for g in grads):
            return step
        if grads and not math.isfinite(torch.nn.utils.get_total_norm(grads).item()):
            return step  # finite gradients a float32 clip_grad_norm_ cannot measure
        run.optimizer_step()
    return None


def run_wild(s: WildScenario) -> Result:
    """One wild scenario: ``ng.locate`` on its faulty step, and the same step run plainly for the reference."""
    from nanguard.tracer.api import locate

    case = s.build()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the faulty code's own warnings (std of one element, dynamo)
        diag = locate(case.fn, *case.args, model=case.model)
    seconds = time.perf_counter() - start
    if diag is not None:
        diag = replace(diag, step=0)
    return Result(s.name, {**_expected(s), "step": 0}, _summary(diag), 0 if diag else None, _plain_bad(s), seconds)


def _plain_bad(s: WildScenario) -> int | None:
    """0 when the wild step run plainly gives a non-finite loss or gradient, else None."""
    case = s.build()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = case.fn(*case.args)
    except Exception:  # the fault surfaced as a raise (an id out of range, validate_args, multinomial)
        return 0
    grads = [p.grad for p in case.model.parameters() if p.grad is not None]
    finite = math.isfinite(float(loss.detach())) and all(bool(torch.isfinite(g).all()) for g in grads)
    return None if finite else 0


def run_scenario(s: Scenario, seed: int = 0) -> Result:
    """One single-process scenario under the guard, plus its unguarded reference."""
    start = time.perf_counter()
    run = build(s, seed)
    diag, detect = _guarded(run, run.model)
    seconds = time.perf_counter() - start
    return Result(s.name, _expected(s), _summary(diag), detect, _first_bad_step(s, seed), seconds)


class CorruptOnce:
    """A DDP comm hook that all-reduces, and corrupts the synchronized result of call ``at_call`` (1-based).

    ``at_call=None`` corrupts nothing until it is set, e.g. to ``hook.calls + 1`` for the next call.

    Example:
        >>> hook = CorruptOnce(at_call=3)
        >>> ng.Guard(ddp, optimizer, comm_hook=(None, hook))
    """

    def __init__(self, at_call: int | None = None) -> None:
        self.calls = 0
        self.at_call = at_call
        self.__qualname__ = "corrupt_once"  # DDP logs a comm hook by its qualified name

    def __call__(self, state: Any, bucket: Any) -> Any:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.calls += 1
        fut = allreduce_hook(state, bucket)
        if self.calls != self.at_call:
            return fut

        def corrupt(f: Any) -> torch.Tensor:
            out = f.value()[0] if isinstance(f.value(), list) else f.value()
            out[0] = float("nan")
            return out

        return fut.then(corrupt)


def dist_rank(rank: int, world: int, name: str, seed: int) -> dict[str, Any]:
    """One rank of a distributed scenario (run under an initialized process group)."""
    from torch.nn.parallel import DistributedDataParallel

    s = get(name)
    if s.dist_fault in EDGE_FAULTS:
        return dict(zip(("diag", "detect"), _summarized(*edge_rank(s, rank, seed)), strict=True))
    last = rank == world - 1
    run = build(s, seed, rank=rank)
    ddp = DistributedDataParallel(run.model)
    hook = CorruptOnce()
    comm = (None, hook) if s.dist_fault == "comm" else None
    guard = Guard(
        ddp, run.optimizer, policy="skip", comm_hook=comm, fingerprint_every=1 if s.dist_fault == "replica" else 100
    )
    first: Diagnosis | None = None
    detect: int | None = None
    for step in range(s.run_steps):
        if step == s.fault_step:
            if s.dist_fault == "comm":
                hook.at_call = hook.calls + 1
            if s.dist_fault == "replica" and last:
                with torch.no_grad():
                    run.model.blocks[1].mlp.fc.weight.mul_(1.01)
        batch = run.batch(step, faulty=s.dist_fault == "data" and last)
        guard.step(run.closure(batch, ddp), batch=batch)
        if first is None and guard.last_diagnosis is not None:
            first, detect = guard.last_diagnosis, step
    guard.close()
    return {"diag": _summary(first), "detect": detect}


def run_distributed(s: Scenario, seed: int = 0) -> Result:
    from nanguard.zoo.spawn import RanksFailed, spawn_ranks

    start = time.perf_counter()
    try:
        values = spawn_ranks(dist_rank, s.name, seed, world=s.ranks)
    except RanksFailed as err:
        raise RuntimeError(f"scenario {s.name} failed on a rank:\n{err}") from None
    seconds = time.perf_counter() - start
    agree = all(v == values[0] for v in values)
    return Result(s.name, _expected(s), values[0]["diag"], values[0]["detect"], None, seconds, agree)


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


GROUPS = ("all", "gpt", "wild")


def _select(group: str, names: list[str], ranks: int) -> list[Scenario | WildScenario]:
    if group not in GROUPS:
        raise ValueError(f"group must be one of {GROUPS}, got {group!r}")
    if names:
        wild = {w.name for w in WILD}
        return [get_wild(name) if name in wild else get(name) for name in names]
    gpt = [s for s in SCENARIOS if s.ranks == 1 or ranks >= s.ranks] if group != "wild" else []
    return [*gpt, *(WILD if group != "gpt" else ())]


def run_one(s: Scenario | WildScenario, seed: int = 0) -> Result:
    """Any zoo scenario: a wild one through ``ng.locate``, a distributed one on spawned ranks, else guarded."""
    if isinstance(s, WildScenario):
        return run_wild(s)
    return run_distributed(s, seed) if s.ranks > 1 else run_scenario(s, seed)


def run_zoo(
    *, ranks: int = 1, as_json: bool = False, only: Sequence[str] | str | None = None, seed: int = 0, group: str = "all"
) -> int:
    """Run the zoo (``group`` "gpt", "wild" or "all", or the scenarios named in ``only``), print the scored
    table (or JSON); exit code 1 on any miss."""
    from nanguard.report.terminal import Console

    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    names = [only] if isinstance(only, str) else list(only or ())
    scenarios = _select(group, names, ranks)
    console = Console()
    progress = console.progress(len(scenarios), "zoo") if not as_json else _quiet(len(scenarios))
    results = _run_all(scenarios, seed, progress)
    groups = {s.name: s.group for s in scenarios}
    misses = sum(not r.ok for r in results)
    if as_json:
        rows = [{**r.to_dict(), "group": groups[r.name]} for r in results]
        print(json.dumps({"results": rows, "total": len(results), "misses": misses}))
    else:
        skipped = ranks == 1 and group != "wild" and not names and any(s.ranks > 1 for s in SCENARIOS)
        _print_table(console, results, groups, distributed_skipped=skipped)
    return 1 if misses else 0


def _run_all(
    scenarios: Sequence[Scenario | WildScenario], seed: int, progress: AbstractContextManager[Callable[[str], None]]
) -> list[Result]:
    """Each scenario's result, in order, with a progress line as each one ends."""
    results: list[Result] = []
    with progress as advance:
        for s in scenarios:
            result = run_one(s, seed)
            results.append(result)
            advance(f"{s.name:<32} {'ok' if result.ok else 'MISS'}  {result.seconds:.1f}s")
    return results


# The table's scored columns, each shown as "expected" or "expected / got".
_SCORED = ("cause", "op", "module", "phase", "rank", "step")


def _pair(key: str, got: dict[str, Any], exp: dict[str, Any]) -> str:
    """One scored cell: the expectation, and what the run got when that differs ("n/a" where the
    expectation does not name the field)."""
    want = exp.get(key)
    if want is None and exp.get("cause") is not None:
        return "n/a" if got.get(key) is None else f"n/a / {_cell(got.get(key))}"
    same = got.get(key) == want
    return _cell(want) if same else f"{_cell(want)} / {_cell(got.get(key))}"


def _row(r: Result, group: str) -> list[str]:
    got = r.got or {}
    scored = [_pair(key, got, r.expected) for key in _SCORED]
    return [group, r.name, *scored, _cell(r.steps_late), "ok" if r.ok else "MISS"]


def _print_table(console: Console, results: list[Result], groups: dict[str, str], *, distributed_skipped: bool) -> None:
    # Console.table: rich on a terminal, full-width aligned columns when piped (never cut to 80).
    columns = ("group", "scenario", "cause (expected / got)", "op", "module", "phase", "rank", "step", "late", "ok")
    console.table(columns, [_row(r, groups[r.name]) for r in results], title="nanguard fault zoo")
    misses = sum(not r.ok for r in results)
    console.line(f"{len(results) - misses}/{len(results)} scenarios right; {misses} miss(es)")
    if distributed_skipped:
        console.line("distributed scenarios skipped: run `nanguard zoo --ranks 2` to include them")


class _quiet:
    def __init__(self, total: int) -> None:
        self.total = total

    def __enter__(self) -> Any:
        return lambda message: None

    def __exit__(self, *exc: object) -> None:
        return None
