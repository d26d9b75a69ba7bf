"""The fire drill (``nanguard.inject``): each fault is planted through its real path, diagnosed like a
real one and marked injected; the chaos soak on gloo ranks holds the guard to every promise."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import nanguard as ng
from nanguard.events import read_events
from nanguard.inject import FAULTS, Fault, parse
from nanguard.report.load import load_run
from nanguard.zoo.drill import chaos_faults, check_drill, drill_rank, standard_drill


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)) for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _run(inject, tmp_path: Path | None, steps: int = 14, policy: str = "auto", **options):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = ng.Guard(
        model, opt, policy=policy, run_dir=tmp_path, inject=inject, skip_spikes=True, snapshot_every=1, **options
    )
    actions = []
    for i in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))

        def closure(x=x):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss

        guard.step(closure, batch={"x": x})
        actions.append(guard.last_action)
    guard.close()
    return guard, model, actions


def _drills(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir / "events-rank0.jsonl") if e["kind"] == "drill"]


def test_parse_reads_every_kind_and_writes_it_back() -> None:
    spec = "nan_grad@step=100,rank=3; inf_loss@step=200 ;nan_param@step=300,module=blocks.2.mlp;"
    spec += "spike_loss@step=400,factor=1e4;corrupt_allreduce@step=500;stall@step=600,rank=1,seconds=5"
    faults = parse(spec)
    assert [f.kind for f in faults] == list(FAULTS)
    assert faults[0] == Fault("nan_grad", step=100, rank=3)
    assert faults[2].module == "blocks.2.mlp" and faults[3].factor == 1e4 and faults[5].seconds == 5
    assert parse(";".join(f.spec for f in faults)) == faults
    assert parse(None) == [] and parse("") == []


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("nan_gradient@step=3", "KIND"),
        ("nan_grad", "KIND"),
        ("nan_grad@rank=1", "step=N"),
        ("inf_loss@step=3,module=head", "takes the keys"),
        ("stall@step=x", "must be a number"),
        ("nan_grad@step=-1", "step must be an int >= 0"),
        ("spike_loss@step=3,factor=0", "factor must be"),
        ("stall@step=3,seconds=1e9", "seconds must be"),
    ],
)
def test_a_bad_spec_is_a_value_error_naming_what_is_wrong(spec: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        parse(spec)


def test_a_fault_outside_the_model_or_the_world_is_refused() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"module must name a module of the model.*'blocks.9'"):
        ng.Guard(model, opt, inject="nan_param@step=1,module=blocks.9")
    with pytest.raises(ValueError, match="names rank 2, but the world has 1 rank"):
        ng.Guard(model, opt, inject="nan_grad@step=1,rank=2")
    with pytest.raises(ValueError, match="inject must be a spec string"):
        ng.Guard(model, opt, inject=[3])


def test_nan_grad_is_written_by_a_gradient_hook_and_diagnosed_where_it_was_planted(tmp_path: Path) -> None:
    guard, _, actions = _run("nan_grad@step=6,module=blocks.1", tmp_path)
    diag = guard.last_diagnosis
    assert actions[6] == "skip" and actions.count("skip") == 1
    # The hook's own write is the origin: the tracer saw it in the backward of that module.
    assert (diag.cause, diag.phase, diag.module, diag.step) == ("op.nan_write", "backward", "blocks.1.0", 6)
    assert diag.evidence["injected"] == [
        {"fault": "nan_grad@step=6,rank=0,module=blocks.1", "kind": "nan_grad", "step": 6, "rank": 0}
    ]
    assert "a fire drill (NANGUARD_INJECT)" in str(diag)
    (drill,) = _drills(tmp_path)
    assert drill["step"] == 6 and drill["action"] == "skip" and drill["detected"] and drill["cause"] == "op.nan_write"


def test_inf_loss_reaches_the_loss_backward_runs_on_and_the_closure_returns(tmp_path: Path) -> None:
    guard, _, actions = _run("inf_loss@step=5", tmp_path)
    assert actions[5] == "skip"
    assert guard.last_diagnosis.kind == "inf" and guard.last_diagnosis.phase == "forward"
    step = next(e for e in read_events(tmp_path / "events-rank0.jsonl") if e["kind"] == "step" and e["step"] == 5)
    assert step["loss"] == "inf" and step["skipped"]


def test_nan_param_is_rolled_back_and_a_healthy_step_follows(tmp_path: Path) -> None:
    guard, model, actions = _run("nan_param@step=5,module=blocks.1", tmp_path)
    assert actions[5] == "rollback" and actions[6] == "drop_batch" and actions[7:] == ["step"] * 7
    diag = guard.last_diagnosis
    assert diag.cause == "parameters.nonfinite" and diag.module == "blocks.1.0"
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_spike_loss_scales_the_loss_and_its_gradients_and_is_skipped(tmp_path: Path) -> None:
    guard, _, actions = _run("spike_loss@step=12,factor=1e4", tmp_path, steps=14)
    assert actions[12] == "skip" and actions.count("skip") == 1 and guard.spikes >= 1
    assert guard.last_diagnosis is None  # a spike is no trip
    spikes = [e for e in read_events(tmp_path / "events-rank0.jsonl") if e["kind"] == "spike" and e["step"] == 12]
    assert {s["metric"] for s in spikes} == {"loss", "grad_norm"}  # the gradients were scaled too
    assert _drills(tmp_path)[0]["cause"] == "spike"


def test_corrupt_allreduce_is_transient_the_replay_is_clean(tmp_path: Path) -> None:
    guard, _, actions = _run("corrupt_allreduce@step=6", tmp_path)
    assert actions[6] == "skip"
    assert guard.last_diagnosis.cause == "step.not_reproduced"


def test_a_stall_delays_the_step_and_changes_nothing(tmp_path: Path) -> None:
    _, stalled, actions = _run("stall@step=3,seconds=0.2", tmp_path, steps=6)
    _, plain, _ = _run(None, None, steps=6)
    assert actions == ["step"] * 6
    assert all(torch.equal(a, b) for a, b in zip(stalled.parameters(), plain.parameters(), strict=True))
    (drill,) = _drills(tmp_path)
    assert drill["seconds"] >= 0.2 and drill["detected"] is None


def test_nanguard_inject_in_the_environment_plants_the_faults(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NANGUARD_INJECT", "nan_grad@step=2;inf_loss@step=4")
    _, _, actions = _run(None, tmp_path, steps=6)
    assert actions == ["step", "step", "skip", "step", "skip", "step"]
    assert [d["fault"] for d in _drills(tmp_path)] == ["nan_grad@step=2,rank=0", "inf_loss@step=4,rank=0"]
    monkeypatch.setenv("NANGUARD_DISABLE", "1")
    _, _, actions = _run(None, None, steps=6)
    assert actions == ["step"] * 6


def test_check_takes_the_loss_faults_and_the_loops_backward_gets_the_gradient_hook() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ng.Guard(model, opt, inject="nan_grad@step=1;inf_loss@step=3", module_stats=False)
    verdicts = []
    for i in range(5):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        ok = guard.check(loss)
        verdicts.append(ok)
        if ok:
            opt.step()
            guard.after_step()
    assert verdicts == [True, False, True, False, True]
    assert guard.last_diagnosis.evidence["injected"][0]["kind"] == "inf_loss"


def test_a_trip_of_a_real_fault_carries_no_injected_mark(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ng.Guard(model, opt, run_dir=tmp_path, inject="stall@step=0,seconds=0")
    x = torch.full((4, 8), math.nan)

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    guard.step(closure, batch={"x": x})
    guard.close()
    assert guard.last_diagnosis.cause == "data.nonfinite" and "injected" not in guard.last_diagnosis.evidence
    report = load_run(tmp_path)
    assert report.to_dict()["trips"][0]["injected"] is False


def test_a_snapshot_never_copies_a_nan_the_forward_does_not_read() -> None:
    # A NaN in an embedding row no batch uses reaches no loss or gradient: only the parameter
    # check after the update sees it, with the next step. A snapshot taken after that update
    # would hold the NaN, and every rollback would restore it (the old code rolled back until
    # max_consecutive_skips stopped the run).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ng.Guard(model, opt, policy="rollback", snapshot_every=1, max_consecutive_skips=3, module_stats=False)
    actions = []
    for i in range(8):
        ids = torch.randint(1, 10, (6,), generator=torch.Generator().manual_seed(i))
        if i == 3:
            with torch.no_grad():
                model[0].weight[0, 0] = math.nan  # row 0: never looked up

        def closure(ids=ids):
            opt.zero_grad()
            loss = model(ids).pow(2).mean()
            loss.backward()
            return loss

        guard.step(closure)
        actions.append(guard.last_action)
    assert actions[4] == "rollback" and actions.count("rollback") == 1, actions
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_drill_on_one_process_passes(tmp_path: Path) -> None:
    faults = standard_drill(1)
    dicts = [
        {"kind": f.kind, "step": f.step, "rank": f.rank, "module": f.module, "factor": f.factor, "seconds": 0.05}
        for f in faults
    ]
    result = drill_rank(0, 1, dicts, 60, str(tmp_path))
    assert check_drill(faults, [result]) == []
    assert result["actions"][faults[2].step] == "rollback" and result["applied"] < 60
    report = load_run(tmp_path)
    drills = {d.kind: d for d in report.drills}
    assert set(drills) == set(FAULTS)
    assert all(d.detected and d.agreed for d in drills.values())
    assert drills["nan_param"].cause == "parameters.nonfinite" and drills["nan_param"].actions == {0: "rollback"}
    trips = report.to_dict()["trips"]
    assert trips and all(t["injected"] for t in trips)
    # Drill trips are never counted as the hardware's.
    (row,) = report.to_dict()["hardware"]
    assert row["injected"] == len(trips) and row["trips"] == 0


def _soak(world: int, steps: int, seed: int, tmp_path: Path) -> None:
    from nanguard.zoo.spawn import spawn_ranks

    faults = chaos_faults(seed, steps=steps, world=world)
    assert {f.kind for f in faults} == set(FAULTS)
    assert {f.rank for f in faults} >= {0, world // 2}
    dicts = [
        {"kind": f.kind, "step": f.step, "rank": f.rank, "module": f.module, "factor": f.factor, "seconds": f.seconds}
        for f in faults
    ]
    results = spawn_ranks(drill_rank, dicts, steps, str(tmp_path), world=world, timeout=600)
    assert check_drill(faults, results) == []
    rollbacks = sum(a == "rollback" for a in results[0]["actions"])
    skips = sum(a == "skip" for a in results[0]["actions"])
    assert rollbacks >= 1 and skips >= 1 and results[0]["applied"] < steps
    report = load_run(tmp_path)
    assert len(report.drills) == len(faults) and all(d.agreed and d.detected for d in report.drills)
    assert all(d.actions.keys() == set(range(world)) for d in report.drills)
    # Every rank appended its own record of every trip to the one tracker, each marked a drill.
    assert {r["rank"] for r in report.hardware} == set(range(world)) and all(r["injected"] for r in report.hardware)
    assert len(report.hardware) == world * len(report.trips)
    (tmp_path / "soak.json").write_text(json.dumps({"faults": len(faults), "steps": steps}))


@pytest.mark.dist
def test_chaos_soak_on_two_ranks(tmp_path: Path) -> None:
    _soak(world=2, steps=100, seed=1, tmp_path=tmp_path)


@pytest.mark.dist
@pytest.mark.slow
def test_chaos_soak_long_on_three_ranks(tmp_path: Path) -> None:
    _soak(world=3, steps=1500, seed=2, tmp_path=tmp_path)


@pytest.mark.dist
def test_the_soak_checks_a_rollback_to_a_snapshot_older_than_any_window(tmp_path: Path) -> None:
    # A rollback may restore a snapshot from any step back: refreshes are held while the run grows
    # (the 1500-step soak once restored one 16 steps old, past its 16-state window), or they are
    # far apart. The soak's checker kept the last states only, and called an exact rollback broken.
    from nanguard.zoo.spawn import spawn_ranks

    fault = {"kind": "nan_param", "step": 66, "rank": 0, "module": "blocks.0.mlp", "factor": 1e4, "seconds": 0.2}
    results = spawn_ranks(drill_rank, [fault], 68, None, {"snapshot_every": 100}, world=2)
    assert [r["actions"][66] for r in results] == ["rollback", "rollback"]
    assert check_drill([Fault(**fault)], results) == []
    # Back to the snapshot the guard took as it was built: no update before the fault survived.
    assert [r["applied"] for r in results] == [0, 0]


def test_a_planted_fault_logs_where_and_what(caplog, tmp_path: Path) -> None:
    with caplog.at_level(logging.WARNING, logger="nanguard"):
        _run("nan_grad@step=2", tmp_path, steps=3)
    assert "drill: planting nan_grad@step=2,rank=0" in caplog.text


def test_a_skipped_spike_does_not_hide_the_next_one(tmp_path: Path) -> None:
    # The skipped step's values stay out of the detector's window, as in a run that never saw
    # the batch: the old window kept the first spike, and the second (no larger than twice the
    # first) passed as normal.
    guard, _, actions = _run("spike_loss@step=12,factor=1e4;spike_loss@step=20,factor=1e4", tmp_path, steps=22)
    assert actions[12] == "skip" and actions[20] == "skip" and actions.count("skip") == 2
    assert max(guard.loss_spikes.values) < 100


def _transient(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, runs: list[int]):
    """A closure whose first run gets a NaN gradient from outside the code (as a faulty device would)."""

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        runs.append(1)
        if len(runs) == 1:
            with torch.no_grad():
                next(model.parameters()).grad[0, 0] = math.nan
        return loss

    return closure


def _trip_once(run_dir: Path) -> ng.Guard:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ng.Guard(model, opt, run_dir=run_dir, module_stats=False)
    guard.step(_transient(model, opt, torch.randn(4, 8), []))
    guard.close()
    return guard


def test_every_trip_says_where_it_ran_and_the_tracker_survives_restarts(caplog, tmp_path: Path) -> None:
    import socket

    first = _trip_once(tmp_path)
    where = first.last_diagnosis.evidence["where"]
    assert first.last_diagnosis.cause == "step.not_reproduced"
    assert where["host"] == socket.gethostname() and where["device"] == "cpu" and where["local_rank"] == 0
    assert re.search(rf"\n  host +{re.escape(socket.gethostname())} local rank 0, cpu\n", str(first.last_diagnosis))
    trip = next(e for e in read_events(tmp_path / "events-rank0.jsonl") if e["kind"] == "trip")
    assert trip["where"]["host"] == socket.gethostname()
    with caplog.at_level(logging.WARNING, logger="nanguard"):
        second = _trip_once(tmp_path)  # a restart into the same run_dir
    assert "2 trips flagged here did not reproduce" in caplog.text and socket.gethostname() in caplog.text
    assert second.last_diagnosis.evidence["suspect_device"]["transient_trips"] == 2
    lines = (tmp_path / "hardware.jsonl").read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["reproduced"] is False for line in lines)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nanguard"):
        model = Net()
        ng.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), run_dir=tmp_path).close()  # read back on start
    assert "had 2 trips that did not reproduce in this run_dir before this start" in caplog.text


def test_report_takes_several_run_dirs_and_tables_trips_per_device(tmp_path: Path, capsys) -> None:
    from nanguard.cli import main

    for name in ("job", "restart"):
        _trip_once(tmp_path / name)
    with (tmp_path / "restart" / "hardware.jsonl").open("a") as f:
        f.write('{"torn line\n')
    assert main(["report", str(tmp_path / "job"), str(tmp_path / "restart"), "--json"]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert len(data["runs"]) == 2
    (row,) = data["hardware"]
    assert row["trips"] == 2 and row["transient"] == 2 and row["causes"] == {"step.not_reproduced": 2}
    assert "hardware.jsonl:2: skipping unreadable tracker line" in err
    assert main(["report", str(tmp_path / "job"), str(tmp_path / "restart")]) == 0
    out, _ = capsys.readouterr()
    assert "Trips per host and device (2 runs)" in out and "step.not_reproduced x2" in out
    assert main(["report", str(tmp_path / "job"), str(tmp_path / "restart"), "--html", str(tmp_path / "x.html")]) == 2


def test_a_trip_after_a_skipped_spike_is_not_divergence(tmp_path: Path) -> None:
    # The skipped spike never reached the weights: the NaN three steps later is its own fault (the old
    # history kept the spike as the "spike before the trip" and named optimizer.divergence).
    faults = [{"kind": "spike_loss", "step": 12, "rank": 0}, {"kind": "nan_grad", "step": 15, "rank": 0}]
    result = drill_rank(0, 1, faults, 17, str(tmp_path))
    assert result["actions"][12] == "skip" and result["actions"][15] == "skip" and result["broken"] == []
    (trip,) = [e for e in read_events(tmp_path / "events-rank0.jsonl") if e["kind"] == "trip"]
    assert trip["step"] == 15 and trip["diagnosis"]["cause"] == "op.nan_write"
