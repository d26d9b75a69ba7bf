"""The bulk reader of step lines agrees with reading each line as JSON, and still names bad lines."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from nanguard import stepline
from nanguard.events import EventLog
from nanguard.guard.recorder import Recorder
from nanguard.report.load import load_run
from nanguard.report.stream import MAX_POINTS, read_rank_log

LINES = 3 * MAX_POINTS + 123  # enough for the series to be thinned


def _write(run_dir: Path, steps: list[int], rng: random.Random, scaler: bool) -> None:
    log = EventLog(run_dir, rank=0)
    log.write("start", 0, config={}, world_size=1, path=str(run_dir))
    for step in steps:
        roll = rng.random()
        loss: float | None = rng.uniform(0.1, 9.0) * 10 ** rng.randint(-12, 12)
        grad: float | None = rng.random()
        if roll < 0.002:
            loss = None
        elif roll < 0.004:
            grad = rng.choice([math.nan, math.inf, -math.inf])
        elif roll < 0.006:
            loss = math.nan
        scale = rng.choice([2.0**16, 1024.0, None]) if scaler else None
        log.write("step", step, loss=loss, grad_norm=grad, skipped=roll < 0.01, scale=scale)
        if step % 997 == 0:
            log.write("spike", step, metric="loss", value=1.0, median=0.5, score=7.0)
    log.close()


def _by_json(path: Path) -> list[dict]:
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == "step"]


def _value(raw: object) -> float | None:
    return None if raw is None else float(raw)  # "nan", "inf", "-inf" are strings in the log


def _same(got: float | None, want: float | None) -> bool:
    if got is None or want is None:
        return got is want
    return got == want or (math.isnan(got) and math.isnan(want))


@pytest.mark.parametrize("scaler", [False, True])
def test_bulk_reading_matches_json_line_by_line(tmp_path: Path, scaler: bool) -> None:
    _write(tmp_path, list(range(1, LINES + 1)), random.Random(1), scaler)
    path = tmp_path / "events-rank0.jsonl"
    expected = _by_json(path)
    notes: list[str] = []
    series = read_rank_log(path, 0, notes).steps
    assert notes == []
    assert series.count == len(expected) and series.ordered and list(series.numbers) == [e["step"] for e in expected]
    assert series.stride > 1 and len(series.points) < len(expected) // 2  # thinned

    by_step = {e["step"]: e for e in expected}
    for point in series.points:  # every kept point carries the values of its line
        line = by_step[point.step]
        for got, raw in (
            (point.loss, line["loss"]),
            (point.grad_norm, line["grad_norm"]),
            (point.scale, line["scale"]),
        ):
            assert _same(got, _value(raw)), (point, line)
        assert point.skipped == line["skipped"]

    bad = {e["step"]: n for e in expected if (n := sum(1 for k in ("loss", "grad_norm") if isinstance(e[k], str)))}
    assert series.nonfinite == bad and bad
    assert series.skipped == {e["step"] for e in expected if e["skipped"]}
    kept = {p.step for p in series.points}
    assert set(bad) | series.skipped <= kept  # every bad or skipped step survives the thinning
    applied = [e for e in expected if not e["skipped"]][-1]
    assert series.last_applied.step == applied["step"] and series.last_applied.loss == _value(applied["loss"])
    assert series.latest.step == expected[-1]["step"]


# A value of number characters only ("1.5.2") is parsed where the report uses it (here: a skipped step,
# always kept); on the other lines only its characters are checked.
@pytest.mark.parametrize(
    ("bad_value", "skipped"),
    [
        ('"step":-1', False),
        ('"step":99999999999999999999', False),
        ('"loss":1.2x3', False),
        ('"loss":', False),
        ('"loss":"1.5"', False),
        ('"loss":nul', False),
        ('"loss":true', False),
        ('"loss":"nanx"', False),
        ('"loss":1.5.2', True),
    ],
)
def test_a_bad_value_deep_in_a_large_log_is_named_by_line(tmp_path: Path, bad_value: str, skipped: bool) -> None:
    _write(tmp_path, list(range(1, LINES + 1)), random.Random(2), scaler=False)
    path = tmp_path / "events-rank0.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    target = next(i for i in range(LINES // 2, len(lines)) if '"skipped":false' in lines[i] and i % 7 != 0)
    field = bad_value.partition(":")[0] + ":"
    head, _, rest = lines[target].partition(field)
    lines[target] = head + bad_value + "," + rest.partition(",")[2]
    if skipped:
        lines[target] = lines[target].replace('"skipped":false', '"skipped":true')
    path.write_text("".join(lines))
    with pytest.warns(UserWarning) as caught:
        report = load_run(tmp_path)
    messages = [str(w.message) for w in caught]
    assert any(m.startswith(f"{path}:{target + 1}:") for m in messages), messages
    assert report.ranks[0].steps_logged == LINES - 1  # the rest of the file is read


def test_steps_union_over_ranks_restarts_and_events(tmp_path: Path) -> None:
    rng = random.Random(3)
    _write(tmp_path, [*range(0, 50), *range(40, 60)], rng, scaler=False)  # resumed from step 40
    log = EventLog(tmp_path, rank=1)
    for step in range(10, 70, 2):
        log.write("step", step, loss=1.0, grad_norm=1.0, skipped=False, scale=None)
    log.write("rollback", 75, restored_step=70, skip_batches=1, reason="test")  # a step no step line has
    log.close()
    with pytest.warns(UserWarning, match="end at different steps"):
        report = load_run(tmp_path)
    assert not report.ranks[0].series.ordered and report.ranks[1].series.ordered
    assert list(report.steps) == sorted({*range(0, 60), *range(10, 70, 2), 75})


def test_the_writer_writes_the_layout_the_fast_reader_splits(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path, rank=3, max_bundle_bytes=0)
    recorder.step(7, loss=2.5, grad_norm=math.inf, scale=None, skipped=True)
    recorder.step(8, loss=None, grad_norm=0.25, scale=1024.0, skipped=False)
    recorder.close()
    lines = [ln for ln in (tmp_path / "events-rank3.jsonl").read_bytes().splitlines(keepends=True) if b'"step"' in ln]
    assert [tuple(json.loads(ln)) for ln in lines] == [stepline.KEYS] * 2
    run = b"".join(lines)
    columns = stepline.split_run(run, lines=2, rank=3)
    assert columns is not None and columns.loss == [b'"loss":2.5', b'"loss":null']
    assert columns.scale == [b'"scale":null', b'"scale":1024.0'] and columns.skipped[0] == b'"skipped":true'
    assert stepline.split_run(run, lines=2, rank=0) is None  # another rank's lines are not this rank's
    assert [m[:5] for m in stepline.LINE.findall(run)[:2]] == [
        (b"7", b"2.5", b'"inf"', b"true", b"null"),
        (b"8", b"null", b"0.25", b"false", b"1024.0"),
    ]
    swapped = run.replace(b'"loss":2.5,"grad_norm":"inf"', b'"grad_norm":"inf","loss":2.5')
    cut = stepline.split_run(swapped, lines=2, rank=3)  # cut by position: the keys tell it is not the layout
    assert cut is not None and not all(c.startswith(stepline.cell("loss")) for c in cut.loss)
