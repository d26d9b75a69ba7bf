import json
from pathlib import Path

import pytest

from nanguard.errors import EventLogError
from nanguard.events import EventLog, read_events


def test_events_round_trip_with_nonfinite_values(tmp_path) -> None:
    log = EventLog(tmp_path, rank=1)
    log.write("step", 0, loss=2.5, grad_norm=float("nan"), skipped=False, scale=None)
    log.write("trip", 1, action="skip", ranks=[1], diagnosis={"cause": "data.nonfinite"})
    log.close()
    events = list(read_events(tmp_path / "events-rank1.jsonl"))
    assert [e["kind"] for e in events] == ["step", "trip"]
    assert events[0]["grad_norm"] == "nan" and events[0]["rank"] == 1
    assert events[1]["diagnosis"]["cause"] == "data.nonfinite"


def test_truncated_and_unknown_lines_warn_with_file_and_line(tmp_path) -> None:
    path = tmp_path / "events-rank0.jsonl"
    good = json.dumps({"kind": "step", "step": 0, "rank": 0, "loss": 1.0})
    odd = json.dumps({"kind": "mystery", "step": 1, "rank": 0})
    path.write_text(good + "\n" + odd + "\n" + good[:15])
    with pytest.warns(UserWarning) as record:
        events = list(read_events(path))
    assert len(events) == 1
    messages = [str(w.message) for w in record]
    assert any(f"{path}:2" in m and "unknown event kind" in m for m in messages)
    assert any(f"{path}:3" in m and "unreadable" in m for m in messages)


def test_missing_file_names_it(tmp_path) -> None:
    with pytest.raises(EventLogError, match=r"events-rank7\.jsonl"):
        list(read_events(tmp_path / "events-rank7.jsonl"))


def test_atomic_write_leaves_no_partial_or_temporary_file(tmp_path) -> None:
    from nanguard._io import atomic_write_text

    target = tmp_path / "out" / "report.html"
    atomic_write_text(target, "old")

    with pytest.raises(TypeError):
        atomic_write_text(target, 42)  # type: ignore[arg-type]
    assert target.read_text() == "old"
    assert [p.name for p in target.parent.iterdir()] == ["report.html"]
    atomic_write_text(target, "new")
    assert target.read_text() == "new"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
def test_a_log_that_cannot_be_opened_or_written_warns_once_and_never_raises(tmp_path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.warns(UserWarning, match="event log disabled") as record:
        unopenable = EventLog(blocker / "run", rank=0)  # its directory cannot be made
    unopenable.write("step", 0, loss=1.0)
    unopenable.close()
    assert len(record) == 1 and not unopenable.enabled

    (tmp_path / "events-rank0.jsonl").symlink_to("/dev/full")
    full = EventLog(tmp_path, rank=0)
    assert full.enabled
    with pytest.warns(UserWarning, match="No space left") as record:
        for step in range(3):
            full.write("step", step, loss=1.0)
        full.close()
    assert len(record) == 1 and not full.enabled


def test_the_schema_is_what_the_recorder_writes_and_the_docstring_names() -> None:
    # One owner of the event format: every field each recorder method writes is in events.SCHEMA,
    # passes the reader's checks, and is named in the events module's prose; no kind goes unwritten.
    import math

    from nanguard import events
    from nanguard.findings import Diagnosis
    from nanguard.guard.history import Forecast
    from nanguard.guard.recorder import NullRecorder
    from nanguard.spikes import Spike
    from nanguard.tracer.headroom import Headroom

    written: list[dict] = []
    rec = NullRecorder()
    rec.listener = written.append
    diag = Diagnosis(cause="unknown", step=1)
    rec.start({"policy": "skip"}, 1, "host")
    rec.step(1, loss=1.0, grad_norm=math.nan, scale=None, skipped=False)
    rec.trip(1, action="skip", ranks=[0], diagnosis=diag, where={"host": "h"}, module_stats={})
    rec.skip(1, "a reason")
    rec.rollback(1, restored_step=0, skip_batches=2, reason="unknown", why="the last snapshot")
    rec.spike(1, Spike(metric="loss", value=9.0, median=1.0, score=7.0))
    rec.forecast(1, Forecast("loss", 9.0, 2.0, 40))
    warned = {"signal": "loss", "module": None, "value": 90.0, "trend": 9.0, "steps_left": 36, "fix": "lower the LR"}
    rec.warning(1, **warned, lr=1.0, level=4.0)
    rec.overflow(1, scale=2.0**16, new_scale=2.0**15, streak=1)
    rec.remedy(step=1, cause="unknown", action="skip", target=None, reason="")
    rec.headroom(1, Headroom(module="m", dtype="torch.float16", absmax=6e4, limit=65504.0))
    drill = {"fault": "inf_loss@step=1,rank=0", "fault_kind": "inf_loss", "fault_rank": 0, "planted_here": True}
    rec.drill(1, **drill, action="skip", detected=True, cause="unknown", seconds=0.1)
    rec.end(2, skipped=1, rollbacks=1)
    assert {e["kind"] for e in written} == set(events.SCHEMA) == events.KNOWN_KINDS
    doc = events.__doc__ or ""
    for event in written:
        names = {f.name for f in events.SCHEMA[event["kind"]]}
        fields = {k: v for k, v in event.items() if k not in ("kind", "step")}
        assert set(fields) <= names, (event["kind"], set(fields) - names)
        assert events.field_error(event["kind"], fields) is None, event
        for name in names:
            assert f"``{name}``" in doc, f"events.py's prose does not name {event['kind']}.{name}"
    assert events.field_error("step", {"skipped": "yes"}) == ("skipped", "true or false")


def test_on_event_dicts_start_as_the_log_lines_do(tmp_path) -> None:
    """A listener's dict carries the rank and the run id the log's line carries, so events sent to
    TensorBoard/W&B from runs that share a run_dir stay apart."""
    import torch
    from torch import nn

    import nanguard as ng
    from nanguard.events import event_path, read_events

    for run_dir in (tmp_path / "run", None):
        heard: list[dict] = []
        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        guard = ng.Guard(model, opt, run_dir=run_dir, on_event=heard.append)
        guard.step(lambda model=model: model(torch.ones(1, 2)).sum())
        guard.close()
        assert heard and all(e["rank"] == 0 for e in heard)
        if run_dir is None:
            assert all("run" not in e for e in heard)  # no run_dir, no id
            continue
        logged = list(read_events(event_path(run_dir, 0)))
        assert [e["kind"] for e in heard] == [e["kind"] for e in logged]
        assert {e["run"] for e in heard} == {e["run"] for e in logged} == {guard.run_id}
