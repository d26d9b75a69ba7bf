"""The cause table (``nanguard.causes``) against everything that speaks of causes: ``ng.CAUSES``,
the order of ``diagnose.RULES``, the policy's decisions, the zoo's expected phases, the text
layer and the cause table of docs/causes.md. A cause added without one of these fails here."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

import nanguard as ng
from nanguard import diagnose
from nanguard.causes import REMEDIES, STAGES, TABLE, Cause, row_of
from nanguard.findings import Diagnosis
from nanguard.guard.config import GuardConfig
from nanguard.guard.policy import Policy
from nanguard.guard.verdict import Verdict
from nanguard.zoo.scenarios import SCENARIOS

ROOT = Path(__file__).resolve().parent.parent
FIELDS = [f.name for f in dataclasses.fields(Cause)]


def test_every_cause_has_every_field() -> None:
    assert FIELDS == [
        "id",
        "meaning",
        "stage",
        "phase",
        "skippable",
        "repeatable",
        "remedy",
        "budgeted",
        "history_overrules",
        "computed_from_inputs",
        "fixes",
    ]
    for cause_id, cause in TABLE.items():
        assert cause.id == cause_id and cause.meaning and cause.fixes and all(cause.fixes), cause_id
        assert cause.stage in STAGES and cause.remedy in REMEDIES, cause_id
        assert cause.phase is None or cause.phase in ("data", "parameters", "optimizer", "communication", "backward")
        flags = ("skippable", "repeatable", "budgeted", "history_overrules", "computed_from_inputs")
        assert all(isinstance(getattr(cause, f), bool) for f in flags)


def test_a_row_missing_a_field_is_an_error() -> None:
    row = dataclasses.asdict(row_of("op.log_domain"))
    for name in FIELDS:
        with pytest.raises(TypeError, match=name):
            Cause(**{k: v for k, v in row.items() if k != name})
    with pytest.raises(ValueError, match="remedy"):
        Cause(**{**row, "remedy": "pray"})
    with pytest.raises(ValueError, match="at least one fix"):
        Cause(**{**row, "fixes": ()})


def test_ng_causes_is_the_table() -> None:
    assert list(ng.CAUSES) == list(TABLE)
    assert all(ng.CAUSES[c] == TABLE[c].meaning for c in TABLE)
    with pytest.raises(ValueError, match="cause must be one of"):
        row_of("op.banana")


def test_docs_cause_table_is_the_table() -> None:
    text = (ROOT / "docs" / "causes.md").read_text(encoding="utf-8")
    section = text.split("# Causes (`ng.CAUSES`)", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `([a-z_.]+)` \| (.+?) \|$", section, flags=re.M))
    assert rows == {c.id: c.meaning for c in TABLE.values()}


def _rule_causes() -> dict[str, set[str]]:
    """Each function of diagnose.py and the cause ids its ``Judgement(...)`` calls name, its helpers' included."""
    tree = ast.parse(Path(diagnose.__file__).read_text(encoding="utf-8"))
    direct: dict[str, set[str]] = {}
    calls: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            called = [c for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)]
            direct[node.name] = {
                arg.value
                for call in called
                if call.func.id == "Judgement"  # type: ignore[attr-defined]
                for arg in call.args[:1]
                if isinstance(arg, ast.Constant) and arg.value in TABLE
            }
            calls[node.name] = {call.func.id for call in called}  # type: ignore[attr-defined]

    def reach(name: str, seen: set[str]) -> set[str]:
        seen.add(name)
        found = set(direct[name])
        for callee in calls[name] & direct.keys() - seen:
            found |= reach(callee, seen)
        return found

    return {name: reach(name, set()) for name in direct}


def test_rules_run_in_the_order_of_the_stages() -> None:
    named = _rule_causes()
    stages = []
    for rule in diagnose.RULES:
        causes = named.get(rule.__name__) or set()
        assert causes, f"{rule.__name__} names no cause of the table in a Judgement(...)"
        stages.append(max(STAGES.index(TABLE[c].stage) for c in causes))
    assert stages == sorted(stages), list(zip([r.__name__ for r in diagnose.RULES], stages, strict=True))


@pytest.mark.parametrize("cause", list(TABLE))
def test_the_policy_gives_each_cause_its_remedy(cause: str) -> None:
    row = row_of(cause)
    diag = Diagnosis(cause=cause, phase=row.phase or "forward", module="block")
    state = _State(has_snapshot=True)
    action = Policy(GuardConfig(policy="auto")).decide(Verdict("trip", 5, diagnosis=diag), state)
    expected = {
        "quarantine": ("skip", "quarantine"),
        "upcast": ("skip", "upcast"),
        "rollback_lower_lr": ("rollback", "rollback"),
        "rollback": ("rollback", "rollback"),
    }.get(row.remedy, ("skip", "skip"))
    assert action.remedy is not None and (action.kind, action.remedy.action) == expected
    assert action.lower_lr == (row.remedy == "rollback_lower_lr")
    policy = Policy(GuardConfig(policy="auto", remedy_budget=1))
    kinds = [policy.decide(Verdict("trip", s, diagnosis=diag), state).kind for s in range(3)]
    assert (kinds[-1] == "raise") == row.budgeted, kinds  # past the budget only a budgeted cause stops


@pytest.mark.parametrize("cause", list(TABLE))
def test_skip_refuses_exactly_the_unskippable_causes(cause: str) -> None:
    row = row_of(cause)
    diag = Diagnosis(cause=cause, phase=row.phase if row.phase and row.phase != "optimizer" else "forward")
    action = Policy(GuardConfig(policy="skip")).decide(Verdict("trip", 5, diagnosis=diag), _State())
    assert action.kind == ("skip" if row.skippable else "raise")


def test_only_causes_with_an_origin_op_are_computed_from_its_inputs() -> None:
    # A value the user passed in, state the replicas share, or a cause found without an origin op
    # (the replay, the proof, the fallback) cannot be one an op computed from its inputs on any device.
    computed = {c.id for c in TABLE.values() if c.computed_from_inputs}
    assert computed and "op.log_domain" in computed and "compile.numerics" in computed
    for cause in computed:
        assert TABLE[cause].stage != "data" and TABLE[cause].phase not in ("data", "parameters"), cause
        assert not cause.startswith(("distributed.", "hardware.", "step.")) and cause != "unknown", cause


def test_the_zoo_expects_the_phase_of_the_table() -> None:
    checked = 0
    for scenario in SCENARIOS:
        expect = scenario.expect
        if expect.cause is None or expect.phase is None or row_of(expect.cause).phase is None:
            continue
        assert row_of(expect.cause).phase == expect.phase, scenario.name
        checked += 1
    assert checked >= 5


def test_the_text_layer_says_the_meaning_of_the_table() -> None:
    for cause in TABLE.values():
        assert cause.meaning in str(Diagnosis(cause=cause.id, phase=cause.phase or "forward"))


@dataclasses.dataclass
class _State:
    has_snapshot: bool = False
    consecutive_skips: int = 0
    upcast: list[str] = dataclasses.field(default_factory=list)
    last_diagnosis: Diagnosis | None = None

    def can_upcast(self, module: str | None) -> str | None:
        return None
