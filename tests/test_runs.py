"""One run, one record: a run_dir written to by several runs keeps them apart. Every event carries its
run's id; ``nanguard report`` shows one run (the latest, any by id, or lists them); old logs without ids
read as one run; ``hardware.jsonl`` counts each trip once and says which trips are earlier runs'."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import nanguard as ng
from nanguard import stepline
from nanguard.errors import EventLogError
from nanguard.events import new_run_id
from nanguard.hardware import Tracker, device_rows, read_tracker, where
from nanguard.report.load import load_run
from nanguard.report.main import run_report
from nanguard.report.stream import run_spans


def _train(run_dir: Path, steps: int, bad: int | None = None) -> ng.Guard:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ng.Guard(model, opt, run_dir=run_dir)
    for i in range(steps):
        x = torch.randn(8, 4)
        if i == bad:
            x[0, 0] = float("nan")

        def closure(x=x) -> torch.Tensor:
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss

        guard.step(closure, batch={"x": x})
    guard.close()
    return guard


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events-rank0.jsonl").read_text().splitlines()]


def test_every_event_carries_its_runs_id_and_a_reused_run_dir_reports_the_latest_run(tmp_path: Path) -> None:
    first = _train(tmp_path, 6, bad=2)
    second = _train(tmp_path, 4)
    assert first.run_id != second.run_id
    events = _lines(tmp_path)
    assert {e["run"] for e in events} == {first.run_id, second.run_id}
    ids = [e["run"] for e in events]
    assert ids == [first.run_id] * ids.count(first.run_id) + [second.run_id] * ids.count(second.run_id)
    assert {e["kind"] for e in events} >= {"start", "step", "trip", "skip", "end"}

    latest = load_run(tmp_path)
    assert latest.run == second.run_id and [r.run for r in latest.runs] == [first.run_id, second.run_id]
    assert latest.steps_run == 4 and not latest.trips and not latest.skips and not latest.bundles
    earlier = load_run(tmp_path, run=first.run_id)
    assert earlier.steps_run == 6 and [t.step for t in earlier.trips] == [2] and len(earlier.bundles) == 1
    with pytest.raises(EventLogError, match=rf"no run 'nope'.*{first.run_id}, {second.run_id}"):
        load_run(tmp_path, run="nope")


def test_the_cli_shows_one_run_lists_them_and_names_a_missing_one(tmp_path: Path) -> None:
    first = _train(tmp_path, 5, bad=1)
    second = _train(tmp_path, 3)
    out, err = io.StringIO(), io.StringIO()
    assert run_report([str(tmp_path)], out=out, err=err) == 0
    text = out.getvalue()
    assert f"run {second.run_id}, one of 2" in text and "3 steps run" in text and "trips 0" in text
    out = io.StringIO()
    assert run_report([str(tmp_path)], run=first.run_id, out=out, err=err) == 0
    assert "5 steps run" in out.getvalue() and "trips 1" in out.getvalue()
    out = io.StringIO()
    assert run_report([str(tmp_path)], list_runs=True, out=out, err=err) == 0
    assert out.getvalue().index(first.run_id) < out.getvalue().index(second.run_id)
    out = io.StringIO()
    assert run_report([str(tmp_path)], list_runs=True, as_json=True, out=out, err=err) == 0
    listed = json.loads(out.getvalue())["runs"]
    assert [(r["run"], r["ranks"]) for r in listed] == [(first.run_id, [0]), (second.run_id, [0])]
    err = io.StringIO()
    assert run_report([str(tmp_path)], run="nope", out=io.StringIO(), err=err) == 1
    assert "no run 'nope'" in err.getvalue() and second.run_id in err.getvalue()
    assert run_report([str(tmp_path), str(tmp_path)], run=first.run_id, out=io.StringIO(), err=io.StringIO()) == 2


def test_a_log_from_before_run_ids_reads_as_one_run_and_a_new_run_after_it_apart(tmp_path: Path) -> None:
    _train(tmp_path, 4, bad=1)
    _train(tmp_path, 3)
    old = [{k: v for k, v in e.items() if k != "run"} for e in _lines(tmp_path)]  # as written before run ids
    text = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in old)
    (tmp_path / "events-rank0.jsonl").write_text(text)
    legacy = load_run(tmp_path)
    assert legacy.run is None and len(legacy.runs) == 1 and legacy.steps_run == 4  # steps 0-3 of both runs
    assert [t.step for t in legacy.trips] == [1]
    new = _train(tmp_path, 2)
    report = load_run(tmp_path)
    assert report.run == new.run_id and report.steps_run == 2 and not report.trips
    assert [r.run for r in report.runs] == [None, new.run_id]
    spans = run_spans(tmp_path / "events-rank0.jsonl")  # the old runs' two starts: one run, from line 1
    assert [(s.run, s.lineno) for s in spans] == [(None, 1), (new.run_id, len(old) + 1)]
    assert load_run(tmp_path, run="-").trips[0].step == 1


def test_a_truncated_or_corrupt_log_is_named_with_what_is_wrong(tmp_path: Path) -> None:
    _train(tmp_path, 3)
    path = tmp_path / "events-rank0.jsonl"
    data = path.read_bytes()
    path.write_bytes(data[:-7])  # the end event cut short
    with pytest.warns(UserWarning, match=r"events-rank0\.jsonl:\d+: the log's last line is cut short"):
        report = load_run(tmp_path)
    assert report.steps_run == 3
    lines = data.decode().splitlines()
    lines[0] = lines[0][:20]  # the start line itself unreadable: the run is still read, the line named
    path.write_text("\n".join(lines) + "\n")
    with pytest.warns(UserWarning, match=r"events-rank0\.jsonl:1: "):
        report = load_run(tmp_path)
    assert report.steps_run == 3 and len(report.runs) == 1
    path.write_bytes(b"\x00\xff garbage\n")
    with pytest.warns(UserWarning, match=r"events-rank0\.jsonl:1: "), pytest.raises(EventLogError, match="no readable"):
        load_run(tmp_path)


def test_step_lines_are_read_by_columns_with_and_without_a_run_cell() -> None:
    new = b'{"kind":"step","step":%d,"rank":0,"run":"r1","loss":2.5,"grad_norm":0.5,"skipped":false,"scale":null}\n'
    old = b'{"kind":"step","step":%d,"rank":0,"loss":2.5,"grad_norm":0.5,"skipped":false,"scale":null}\n'
    for line in (new, old):
        columns = stepline.split_run(line % 1 + line % 2, lines=2, rank=0)
        assert columns is not None and columns.step == [b'"step":1', b'"step":2'] and columns.scale is None
        assert columns.loss == [b'"loss":2.5'] * 2 and columns.skipped == [b'"skipped":false'] * 2
        assert stepline.LINE.match(line % 7).group(1, 2, 4) == (b"7", b"2.5", b"false")
    mixed = new % 1 + new.replace(b'"r1"', b'"r2"') % 2
    assert stepline.split_run(mixed, lines=2, rank=0) is None  # two runs' lines: read line by line


def _trip(tracker: Tracker, step: int) -> dict:
    diag = ng.Diagnosis(cause="step.not_reproduced", kind="nan", phase="backward", step=step)
    return tracker.trip(diag, step, injected=False)


def test_the_hardware_warning_counts_each_trip_once_and_says_which_runs_they_came_from(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    here = where()
    earlier = Tracker(tmp_path, here=here, warn_after=4, run=new_run_id())
    _trip(earlier, 3)
    _trip(earlier, 9)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nanguard"):
        tracker = Tracker(tmp_path, here=here, warn_after=4, run=new_run_id())
        assert "none of this run's yet" not in caplog.text  # 2 earlier trips: under warn_after
        assert "suspect_device" not in _trip(tracker, 4)
        # The same trip recorded twice (a second record of step 4 in this run) counts once.
        tracker.records.append(dict(tracker.records[-1]))
        assert "suspect_device" not in _trip(tracker, 4)
        assert "drain this node" not in caplog.text
        found = _trip(tracker, 5)
        assert found["suspect_device"]["transient_trips"] == 4
        assert (found["suspect_device"]["this_run"], found["suspect_device"]["earlier_runs"]) == (2, 2)
        assert "4 trips flagged here did not reproduce on replay (2 in this run, 2 in earlier runs" in caplog.text
        caplog.clear()
        Tracker(tmp_path, here=here, warn_after=4, run=new_run_id())
        assert "had 4 trips that did not reproduce in this run_dir before this start" in caplog.text
        assert "none of this run's yet" in caplog.text
    records = read_tracker(tmp_path / "hardware.jsonl")
    assert len({r["run"] for r in records}) == 2
    assert device_rows(records)[0]["transient"] == 4  # the repeated step 4 once


def test_the_report_counts_the_shown_runs_hardware_and_says_what_it_left_out(tmp_path: Path) -> None:
    first = _train(tmp_path, 4, bad=1)
    _train(tmp_path, 4, bad=2)
    report = load_run(tmp_path)
    assert [r["step"] for r in report.hardware] == [2] and report.hardware_elsewhere == 1
    out = io.StringIO()
    assert run_report([str(tmp_path)], out=out, err=io.StringIO()) == 0
    assert "1 more trip record(s) from other runs" in out.getvalue()
    assert [r["step"] for r in load_run(tmp_path, run=first.run_id).hardware] == [1]


def _ranks_run_ids(rank: int, world: int, run_dir: str) -> list:
    ids = []
    for only_rank_0 in (False, True):  # a run_dir on every rank, then on rank 0 alone: no rank waits
        model = nn.Linear(2, 1)
        on_me = run_dir if not only_rank_0 or rank == 0 else None
        guard = ng.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), run_dir=on_me)
        ids.append(guard.run_id)
        guard.close()
    return ids


@pytest.mark.dist
def test_every_rank_of_a_run_writes_the_same_run_id(tmp_path: Path) -> None:
    from nanguard.zoo.spawn import spawn_ranks

    (zero, one) = spawn_ranks(_ranks_run_ids, str(tmp_path), world=2, timeout=120)
    assert zero[0] == one[0] is not None and one[1] is None and zero[1] not in (None, zero[0])
    report = load_run(tmp_path, run=zero[0])
    assert sorted(report.ranks) == [0, 1] and [r.run for r in report.runs] == [zero[0], zero[1]]
    with pytest.warns(UserWarning, match=r"world_size is 2 but there is no event log for rank\(s\) 1"):
        assert sorted(load_run(tmp_path).ranks) == [0]  # the latest run: rank 0's alone


def _host(n: int) -> dict:
    return {"host": f"node{n}", "device": "cuda:0", "local_rank": 0, "uuid": f"GPU-{n}"}


@pytest.mark.parametrize(
    ("cause", "rank", "flagged", "injected", "origin", "flagged_where", "mine_flagged", "reproduced"),
    [
        ("op.log_domain", 0, [0, 2], False, 0, [0, 2], False, False),  # the diagnosis names its rank
        ("op.log_domain", None, [2, "x", 7], False, 2, [2], False, False),  # else the first flagged one
        ("op.log_domain", None, None, False, 1, None, False, False),  # else this rank
        ("op.log_domain", 5, [1], True, 1, [1], True, False),  # a rank past the world: the flagged one
        ("step.not_reproduced", None, [1], False, 1, [1], True, False),
        ("hardware.faulty_device", 1, [1], False, 1, [1], True, False),
    ],
)
def test_a_trip_on_a_middle_rank_of_three_records_where_it_started(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    cause: str,
    rank: int | None,
    flagged: list | None,
    injected: bool,
    origin: int,
    flagged_where: list[int] | None,
    mine_flagged: bool,
    reproduced: bool,
) -> None:
    """Hand-built: rank 1 of 3 (the ranks' ``where`` already gathered) records a trip."""
    import nanguard.hardware as hardware

    monkeypatch.setattr(hardware.dist, "is_distributed", lambda: True)
    monkeypatch.setattr(hardware.dist, "rank", lambda: 1)
    tracker = Tracker(tmp_path, here=_host(1), warn_after=1, run="r1")
    tracker._everyone = [_host(0), _host(1), _host(2)]
    evidence = {} if flagged is None else {"flagged_ranks": flagged}
    diag = ng.Diagnosis(cause=cause, kind="nan", phase="forward", step=3, rank=rank, ranks=[2], evidence=evidence)
    with caplog.at_level(logging.WARNING, logger="nanguard"):
        found = tracker.trip(diag, 3, injected=injected)
    want: dict = {"where": _host(origin)}
    if flagged_where is not None:
        want["flagged_where"] = {str(r): _host(r) for r in flagged_where}
    suspect = mine_flagged and not reproduced and not injected
    if suspect:
        want["suspect_device"] = {**_host(1), "transient_trips": 1, "this_run": 1, "earlier_runs": 0}
    assert found == want
    (record,) = read_tracker(tmp_path / "hardware.jsonl")
    assert {k: v for k, v in record.items() if k != "time"} == {
        **_host(1),
        "run": "r1",
        "step": 3,
        "cause": cause,
        "flagged": mine_flagged,
        "reproduced": reproduced,
        "injected": injected,
    }
    assert ("proven faulty at step 3" in caplog.text) == (cause == "hardware.faulty_device")
    assert ("drain this node or run its diagnostics" in caplog.text) == suspect
