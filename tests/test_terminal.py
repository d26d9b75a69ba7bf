"""The terminal diagnosis panel, plain output when piped, tables and progress."""

from __future__ import annotations

import io
import re
from dataclasses import replace

import pytest
from rich.console import Console as RichConsole

from nanguard.findings import Diagnosis
from nanguard.report.terminal import Console, diagnosis_panel, diagnosis_text
from nanguard.text import where_lines
from nanguard.tracer import locate
from nanguard.zoo import build, get, train_step
from nanguard.zoo.demo import run_demo

ANSI = re.compile(r"\x1b\[[0-9;?]*[a-zA-Z]")


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def diag() -> Diagnosis:
    run = build(get("padding_fully_masked"), seed=0)
    batch = run.batch(3)
    found = locate(lambda batch=batch: train_step(run.model, batch), model=run.model)
    assert found is not None
    return replace(found, step=3)


def _squash(text: str) -> str:
    return " ".join(ANSI.sub("", text).replace("│", " ").split())


def test_panel_shows_cause_created_where_evidence_and_fixes(diag: Diagnosis) -> None:
    console = RichConsole(file=io.StringIO(), width=200, record=True)
    console.print(diagnosis_panel(diag))
    text = _squash(console.export_text())
    assert "nanguard: NaN at step 3" in text
    assert f"cause {diag.cause} {diag.meaning}" in text and "created NaN" in text
    for label, value in where_lines(diag):
        assert f"{label} {value}" in text
    assert "your code" in text and "gpt.py:" in text and "phase forward" in text and "step 3" in text
    assert f"why {diag.evidence['why']}" in text
    assert "op output float32 [8, 4, 32, 32]" in text and "4096 NaN" in text  # the evidence in words
    first, second = (step["op"].split(".")[1] for step in diag.evidence["after"][:2])
    assert f"then {first} -> {second}" in text  # the path from the origin onward
    assert f"try 1. {diag.fixes[0]}" in text and f"2. {diag.fixes[1]}" in text


def test_plain_console_prints_text_without_ansi_or_boxes(diag: Diagnosis) -> None:
    out = io.StringIO()
    console = Console(out)
    assert not console.tty
    console.title("nanguard report: runs/a", "subtitle here")
    console.diagnosis(diag)
    console.diagnosis(None)
    text = out.getvalue()
    assert "\x1b[" not in text and "╭" not in text and "─" not in text
    assert text.startswith("== nanguard report: runs/a ==\nsubtitle here\n")
    assert diagnosis_text(diag) in text
    # Everything the one-paragraph explanation says is in the plain diagnosis too.
    squashed = _squash(text)
    for line in str(diag).splitlines():
        assert " ".join(line.split()) in squashed, line


def test_tty_console_draws_the_panel_and_a_bar(diag: Diagnosis) -> None:
    out = FakeTTY()
    console = Console(out)
    assert console.tty
    console.title("demo")
    with console.progress(3, "training") as advance:
        for i in range(3):
            advance(f"step {i} ok")
    console.diagnosis(diag)
    raw = out.getvalue()
    assert "╭" in raw and "nanguard: NaN at step 3" in raw
    text = _squash(raw)
    assert "step 2 ok" in text and "3/3" in text and diag.fixes[0][:40] in text


def test_progress_plain_lines_and_quiet_mode() -> None:
    out = io.StringIO()
    console = Console(out)
    with console.progress(2, "work") as advance:
        advance("first")
        advance("second")
    with console.progress(2, "reading", echo=False) as advance:
        advance("hidden")
    assert out.getvalue() == "first\nsecond\n"

    tty = FakeTTY()
    with Console(tty).progress(2, "reading", echo=False) as advance:
        advance("file a")
        advance("file b")
    text = _squash(tty.getvalue())
    assert "reading: file b" in text and "2/2" in text
    assert "\nfile a" not in ANSI.sub("", tty.getvalue())  # a label on the bar, not a printed line


def test_plain_table_aligns_columns() -> None:
    out = io.StringIO()
    Console(out).table(["rank", "steps"], [["rank 0", "12"], ["rank 10", "3"]], title="ranks")
    assert out.getvalue().splitlines() == ["ranks", "rank     steps", "rank 0   12", "rank 10  3"]


def test_demo_prints_the_diagnosis_plainly_when_piped(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_demo("padding_fully_masked", steps=5) == 0
    out = capsys.readouterr().out
    assert "== nanguard demo: padding_fully_masked ==" in out
    assert "nanguard: NaN created - op.masked_softmax" in out and "blocks.0.attn (Attention)" in out
    assert "op output" in out and "try" in out
    assert "\x1b[" not in out and "╭" not in out
