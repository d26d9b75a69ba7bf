"""A deterministic fuzz of the event-log format: ``nanguard report`` never crashes on a log.

The logs are real: one guarded run (a fully masked sample trips and is rolled back, a scaled
loss spikes). Each mutant changes one line of its log: a field set to a value of another type,
a field replaced by raw text (a 5000-digit number, nesting 100,000 deep), a field dropped, a
line truncated, a container turned into another, or the event's kind swapped. Every mutant must
give exit code 0, blame no line but the mutated one, and name that line (file:line) whenever
the line cannot be valid. Markup and escape sequences from the log must not reach the terminal.
"""

from __future__ import annotations

import io
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from nanguard.events import KNOWN_KINDS
from nanguard.report import run_report
from nanguard.report.terminal import Console
from test_report import STEPS, OneRank, one_rank  # noqa: F401  (the run whose log is mutated)

MUTANTS_PER_KIND = 120
RAW = "\x00RAW\x00"
POOL: list[Any] = [
    None,
    True,
    False,
    -1,
    0,
    2**63,
    10**30,
    1e308,
    -0.0,
    "nan",
    "-inf",
    "",
    "x[/]",
    "[bold red]x",
    "\x1b]0;pwned\x07\x1b[31mred",
    "<root>",
    [],
    {},
    [1, "a", None],
    {"a": [1, {"b": 2}]},
    [[[[]]]],
]
RAW_POOL = ["1" * 5000, "[" * 100_000 + "]" * 100_000, "NaN", "-Infinity", "1e999", '"\\ud800"', "tru"]
# Raw text that JSON cannot hold (a number past Python's digit limit, nesting past the recursion limit).
ALWAYS_BAD_RAW = {RAW_POOL[0], RAW_POOL[1], "tru"}


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@dataclass
class Mutant:
    line: int  # 1-based line number in the log
    text: str
    surely_bad: bool


@pytest.fixture(scope="module")
def real_log(one_rank: OneRank) -> list[str]:  # noqa: F811
    """The event log of test_report's run: a trip, a rollback and a spike among healthy steps."""
    lines = (one_rank.run_dir / "events-rank0.jsonl").read_text().splitlines()
    kinds = {json.loads(line)["kind"] for line in lines}
    assert {"start", "step", "trip", "rollback", "spike", "end"} <= kinds, kinds
    return lines


# --------------------------------------------------------------------------- mutations


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path into a JSON value (not the root)."""
    found: list[tuple[Any, ...]] = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for key, value in items:
        found.append((*prefix, key))
        found += _paths(value, (*prefix, key))
    return found


def _set(event: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    node: Any = event
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _get(event: dict[str, Any], path: tuple[Any, ...]) -> Any:
    node: Any = event
    for key in path:
        node = node[key]
    return node


def _swapped(value: Any) -> Any:
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, list):
        return {str(i): v for i, v in enumerate(value)}
    if isinstance(value, str):
        return len(value)
    return str(value)


def _mutate(kind: str, event: dict[str, Any], rng: random.Random) -> tuple[str, bool]:
    """The mutated line's text, and whether it cannot be a valid event."""
    paths = _paths(event)
    path = rng.choice(paths)
    if kind == "field":
        _set(event, path, rng.choice(POOL))
    elif kind == "raw":
        raw = rng.choice(RAW_POOL)
        _set(event, path, RAW)
        return json.dumps(event).replace(json.dumps(RAW), raw), raw in ALWAYS_BAD_RAW
    elif kind == "drop":
        parent = _get(event, path[:-1]) if len(path) > 1 else event
        del parent[path[-1]]
    elif kind == "swap":
        _set(event, path, _swapped(_get(event, path)))
    elif kind == "kind":
        event["kind"] = rng.choice(sorted(KNOWN_KINDS - {event["kind"]}))
    elif kind == "truncate":
        text = json.dumps(event, separators=(",", ":"))
        return text[: rng.randrange(1, len(text))], True
    return json.dumps(event, separators=(",", ":")), False


def _mutants(lines: list[str], kind: str, count: int, seed: int) -> list[Mutant]:
    rng = random.Random(seed)
    others = [i for i, line in enumerate(lines) if json.loads(line)["kind"] != "step"]
    mutants = []
    for _ in range(count):
        # Most mutants hit the few rich lines (trip, rollback, spike); some the plain step lines.
        index = rng.choice(others) if rng.random() < 0.75 else rng.randrange(len(lines))
        text, bad = _mutate(kind, json.loads(lines[index]), rng)
        mutants.append(Mutant(index + 1, text, bad))
    return mutants


def _report(run_dir: Path, variant: int) -> tuple[int, str, str]:
    out = FakeTTY() if variant % 3 == 2 else io.StringIO()
    err = io.StringIO()
    code = run_report(run_dir, as_json=variant % 3 == 1, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


BLAMED = re.compile(r"events-rank0\.jsonl:(\d+):")


@pytest.mark.parametrize("kind", ["field", "raw", "drop", "swap", "kind", "truncate"])
def test_no_mutant_crashes_the_report(kind: str, real_log: list[str], tmp_path: Path) -> None:
    seed = ["field", "raw", "drop", "swap", "kind", "truncate"].index(kind)
    log = tmp_path / "events-rank0.jsonl"
    for n, mutant in enumerate(_mutants(real_log, kind, MUTANTS_PER_KIND, seed)):
        lines = list(real_log)
        lines[mutant.line - 1] = mutant.text
        log.write_text("\n".join(lines) + "\n", encoding="utf-8")
        code, out, err = _report(tmp_path, n)
        context = f"mutant {n} of line {mutant.line}: {mutant.text[:200]!r}\n{err[-2000:]}"
        assert code == 0, context
        blamed = {int(m) for m in BLAMED.findall(err)}
        assert blamed <= {mutant.line}, context
        if mutant.surely_bad:
            assert blamed == {mutant.line}, context
        assert "\x1b]" not in out and "\x07" not in out, context
        if n % 3 == 1:
            assert json.loads(out)["steps_run"] >= STEPS - 1, context


def test_each_of_several_bad_lines_is_named_and_the_rest_reported(real_log: list[str], tmp_path: Path) -> None:
    lines = list(real_log)
    trip = next(i for i, line in enumerate(lines) if json.loads(line)["kind"] == "trip")
    rollback = next(i for i, line in enumerate(lines) if json.loads(line)["kind"] == "rollback")
    event = json.loads(lines[trip])
    event["ranks"] = 5
    lines[trip] = json.dumps(event)
    event = json.loads(lines[rollback])
    event["restored_step"] = []
    lines[rollback] = json.dumps(event)
    lines.append('{"kind":"step","step":' + "9" * 5000 + "}")
    lines.append('{"kind":"skip","step":1,"reason":' + "[" * 100_000 + "]" * 100_000 + "}")
    evidence_list = json.loads(real_log[trip])
    evidence_list["diagnosis"]["evidence"] = [1, 2]
    lines.append(json.dumps(evidence_list))
    (tmp_path / "events-rank0.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out, err = io.StringIO(), io.StringIO()
    assert run_report(tmp_path, as_json=True, out=out, err=err) == 0
    blamed = sorted(int(m) for m in BLAMED.findall(err.getvalue()))
    n = len(real_log)
    assert blamed == [trip + 1, rollback + 1, n + 1, n + 2, n + 3], err.getvalue()
    data = json.loads(out.getvalue())
    assert data["steps_run"] >= STEPS - 1, data
    spikes = sum(1 for line in real_log if json.loads(line)["kind"] == "spike")
    assert data["counts"]["spikes"] == spikes >= 1
    # The last trip line is kept, without its unreadable diagnosis.
    assert data["counts"]["trips"] == 1 and data["trips"][0]["diagnosis"] is None, data["trips"]


# --------------------------------------------------------------------------- terminal injection


def _with_trip_field(lines: list[str], path: tuple[str, ...], value: Any) -> list[str]:
    out = []
    for line in lines:
        event = json.loads(line)
        if event["kind"] == "trip":
            _set(event, path, value)
        out.append(json.dumps(event))
    return out


@pytest.mark.parametrize("tty", [True, False])
def test_markup_and_escape_sequences_from_a_log_are_shown_as_text(
    real_log: list[str], tmp_path: Path, tty: bool
) -> None:
    evil = "blocks.0[/]\x1b]8;;http://x\x07[bold]\x1b[2J\x9b31m.attn"
    lines = _with_trip_field(real_log, ("diagnosis", "module"), evil)
    lines = _with_trip_field(lines, ("diagnosis", "evidence", "why"), "why [/red] \x1b[31mred")
    (tmp_path / "events-rank0.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out: io.StringIO = FakeTTY() if tty else io.StringIO()
    err = io.StringIO()
    assert run_report(tmp_path, out=out, err=err) == 0, err.getvalue()
    text = out.getvalue()
    plain = re.sub(r"\x1b\[[0-9;]*m", "", text)  # the colours rich itself writes on a TTY
    assert "blocks.0[/][bold].attn" in "".join(plain.split()), plain  # markup shown literally
    assert "why [/red] red" in plain
    assert "\x1b]" not in text and "\x07" not in text and "\x1b[2J" not in text and "\x9b" not in text


@pytest.mark.parametrize(
    "write",
    [
        lambda c, s: c.line(s),
        lambda c, s: c.title(s),
        lambda c, s: c.group(s, s),
        lambda c, s: c.table(["col"], [[s]], title=s),
    ],
)
def test_console_never_interprets_what_it_is_given(write: Callable[[Console, str], None]) -> None:
    for file in (FakeTTY(), io.StringIO()):
        console = Console(file)
        write(console, "a[/]b\x1b]0;title\x07c\x1b[5md")
        text = re.sub(r"\x1b\[[0-9;]*m", "", file.getvalue()) if isinstance(file, FakeTTY) else file.getvalue()
        assert "a[/]bcd" in text and "\x1b]" not in file.getvalue() and "\x1b[5m" not in file.getvalue()


def test_a_run_dir_path_with_markup_is_printed_as_is(
    real_log: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    run_dir = Path("run[bold]x")
    run_dir.mkdir()
    (run_dir / "events-rank0.jsonl").write_text("\n".join(real_log) + "\n", encoding="utf-8")
    out = FakeTTY()
    assert run_report(run_dir, out=out, err=io.StringIO()) == 0
    assert "run[bold]x" in out.getvalue()


def test_copying_the_real_log_keeps_it_readable(real_log: list[str], tmp_path: Path) -> None:
    """The unmutated log reports without a warning: the fuzz starts from a clean baseline."""
    (tmp_path / "events-rank0.jsonl").write_text("\n".join(real_log) + "\n", encoding="utf-8")
    out, err = io.StringIO(), io.StringIO()
    assert run_report(tmp_path, as_json=True, out=out, err=err) == 0
    assert err.getvalue() == ""
    assert json.loads(out.getvalue())["steps_run"] == STEPS
