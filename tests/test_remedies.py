import io
import json
import logging
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, SequentialSampler

import nanguard as ng
from nanguard.events import read_events
from nanguard.report.html import render_html
from nanguard.report.load import load_run
from nanguard.report.main import print_summary
from nanguard.report.terminal import Console
from nanguard.sampler import add_quarantined, read_quarantined
from nanguard.zoo.remedy_scenarios import Attention


class Net(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.attn = Attention(8, scale)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(self.inp(x))).mean(dim=(1, 2))


def _autocast_run(policy: str, steps: int, tmp_path, scale: float = 1e5, **options):
    torch.manual_seed(0)
    model = Net(scale)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = ng.Guard(model, opt, policy=policy, run_dir=tmp_path, **options)
    try:
        losses = _autocast_steps(guard, model, opt, steps)
    finally:
        guard.close()
    return guard, model, losses


def _autocast_steps(guard: ng.Guard, model: Net, opt: torch.optim.Optimizer, steps: int) -> list[float | None]:
    x, y = torch.randn(4, 6, 8) * 3, torch.randn(4)
    losses = []
    for _ in range(steps):

        def closure():
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ((model(x).float() - y) ** 2).mean()
            loss.backward()
            return loss

        loss = guard.step(closure, batch=x)
        losses.append(None if loss is None else float(loss.detach()))
    return losses


def test_auto_upcasts_an_overflowing_autocast_module_and_training_goes_on(tmp_path) -> None:
    guard, model, losses = _autocast_run("auto", 6, tmp_path)
    assert [(r["cause"], r["action"], r["target"]) for r in guard.remedies] == [
        ("precision.overflow", "upcast", "attn")
    ]
    assert losses[0] is None and all(v is not None and math.isfinite(v) for v in losses[1:])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    events = [e for e in read_events(tmp_path / "events-rank0.jsonl") if e["kind"] == "remedy"]
    assert [(e["action"], e["target"]) for e in events] == [("upcast", "attn")]
    # The upcast list survives a resume: a fresh guard on a fresh model upcasts the same module.
    fresh = Net(1e5)
    resumed = ng.Guard(fresh, torch.optim.SGD(fresh.parameters(), lr=1e-3), policy="auto")
    resumed.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    with torch.autocast("cpu", dtype=torch.float16):
        out = fresh.attn(torch.randn(2, 6, 8) * 3)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_skip_cannot_fix_a_repeating_overflow_and_raises_after_the_skips(tmp_path) -> None:
    with pytest.raises(ng.NonFiniteError, match="max_consecutive_skips"):
        _autocast_run("skip", 6, tmp_path, max_consecutive_skips=4)


def test_auto_raises_when_an_upcast_module_overflows_again(tmp_path) -> None:
    # At this scale even float32 scores overflow... but then the cause is not precision.overflow.
    # Upcast off keeps the module in float16, so the second overflow of the same module is
    # skipped; the budget stops the run.
    with pytest.raises(ng.NonFiniteError, match="remedy_budget=2"):
        _autocast_run("auto", 5, tmp_path, upcast=False, remedy_budget=2)


class Rows(Dataset):
    """Rows of a regression task; the rows in ``bad`` hold a NaN. Items carry their index."""

    def __init__(self, n: int, bad: set[int]) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)
        for i in bad:
            self.x[i, 2] = math.nan

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


def test_auto_quarantines_bad_rows_and_the_next_epoch_never_sees_them(tmp_path) -> None:
    bad = {5, 13, 14}
    data = Rows(24, bad)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = ng.Guard(model, opt, policy="auto", run_dir=tmp_path)
    loader = DataLoader(data, batch_size=4, sampler=ng.QuarantineSampler(SequentialSampler(data), tmp_path))
    seen: list[list[int]] = []
    losses: list[list[float | None]] = []
    for _ in range(2):
        seen.append([])
        losses.append([])
        for ids, x, y in loader:
            seen[-1] += ids.tolist()

            def closure(x=x, y=y):
                opt.zero_grad()
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                return loss

            loss = guard.step(closure, batch=(x, y), sample_ids=ids)
            losses[-1].append(None if loss is None else float(loss.detach()))
    assert read_quarantined(tmp_path) == bad
    assert set(seen[0]) == set(range(24)) and not bad & set(seen[1])
    assert losses[0].count(None) == 2  # the two batches with bad rows
    assert all(v is not None and math.isfinite(v) for v in losses[1])
    assert [(r["cause"], r["action"], r["target"]) for r in guard.remedies] == [
        ("data.nonfinite", "quarantine", [5]),
        ("data.nonfinite", "quarantine", [13, 14]),
    ]
    assert guard.last_diagnosis is not None and guard.last_diagnosis.evidence["rows"] == [1, 2]
    guard.close()
    out = io.StringIO()
    report = load_run(tmp_path)
    print_summary(report, Console(out))
    assert "Remedies" in out.getvalue() and "quarantine" in out.getvalue()
    page = render_html(report)
    assert 'id="remedies"' in page and "ids 13, 14" in page  # the quarantined ids, worded as in the terminal


def test_quarantine_scope_previous_takes_the_batch_before_too(tmp_path) -> None:
    data = Rows(8, {6})
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = ng.Guard(model, opt, policy="auto", run_dir=tmp_path, quarantine="previous")
    for ids, x, y in DataLoader(data, batch_size=4):

        def closure(x=x, y=y):
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            return loss

        guard.step(closure, batch=(x, y), sample_ids=ids)
    guard.close()
    assert read_quarantined(tmp_path) == {0, 1, 2, 3, 6}


def _regression(lr: float, policy: str, steps: int, **options):
    torch.manual_seed(0)
    w_true = torch.randn(4, 1)
    model = nn.Linear(4, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    guard = ng.Guard(model, opt, policy=policy, scheduler=sched, **options)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 4)

        def closure(x=x):
            opt.zero_grad()
            loss = ((model(x) - x @ w_true) ** 2).mean()
            loss.backward()
            return loss

        loss = guard.step(closure, batch=x)
        if loss is not None:
            sched.step()
        losses.append(None if loss is None else float(loss.detach()))
    return guard, model, opt, losses


def test_auto_rolls_back_a_divergence_and_lowers_the_lr_with_the_scheduler() -> None:
    # lr 3.0 on a unit-curvature quadratic multiplies the error by ~5 per step: far too high.
    guard, model, opt, losses = _regression(3.0, "auto", 150)
    actions = [(r["cause"], r["action"]) for r in guard.remedies]
    assert actions and set(actions) == {("optimizer.divergence", "rollback")}
    assert opt.param_groups[0]["lr"] < 1.0  # stable below 1 on this problem
    assert opt.param_groups[0]["lr"] == pytest.approx(3.0 * 0.5 ** len(actions))
    assert all(v is not None and math.isfinite(v) for v in losses[-20:])
    assert losses[-1] < 1e-3 and torch.isfinite(model.weight).all()
    assert guard.state_dict()["remedies"]["lr_factor"] == pytest.approx(0.5 ** len(actions))


def test_the_scheduler_given_to_the_guard_keeps_the_lowered_lr() -> None:
    # Guard(scheduler=...) reaches the remedies: LambdaLR recomputes the LR from base_lrs each
    # step, so unscaled base_lrs would undo every lowering and the budget would run out.
    guard, _, opt, losses = _regression(3.0, "auto", 150)
    lowered = 3.0 * 0.5 ** len(guard.remedies)
    assert guard.scheduler.base_lrs == [pytest.approx(lowered)]
    assert opt.param_groups[0]["lr"] == pytest.approx(lowered) and math.isfinite(losses[-1])


def test_a_divergence_rolls_back_to_a_snapshot_from_before_the_growth(tmp_path) -> None:
    # SGD at lr=1.0 on a small MLP: the loss grows ~100x a step while every step is still finite.
    # Snapshots refreshed during that growth would hold diverged weights; they are held instead,
    # so each rollback lands on weights from before it and the lowered LR can take hold.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    guard = ng.Guard(model, opt, policy="auto", snapshot_every=2, run_dir=tmp_path)
    w = torch.randn(8, 1)
    losses = []
    for _ in range(220):
        x = torch.randn(64, 8)

        def closure(x=x):
            opt.zero_grad()
            loss = ((model(x) - x @ w) ** 2).mean()
            loss.backward()
            return loss

        loss = guard.step(closure)
        losses.append(None if loss is None else float(loss.detach()))
    guard.close()
    events = list(read_events(tmp_path / "events-rank0.jsonl"))
    rollbacks = [e for e in events if e["kind"] == "rollback"]
    first_growth = next(e["step"] for e in events if e["kind"] == "spike" and "predicted_overflow_in" in e)
    assert rollbacks and all(r["restored_step"] <= first_growth for r in rollbacks)
    assert all("before the loss or grad norm began to grow" in r["why"] for r in rollbacks)
    assert losses[0] is not None and all(v is not None and v < losses[0] for v in losses[-10:])
    assert opt.param_groups[0]["lr"] < 1.0 and torch.isfinite(model[0].weight).all()


def test_skip_cannot_survive_the_same_divergence() -> None:
    with pytest.raises(ng.NonFiniteError):
        _regression(3.0, "skip", 150)


def test_without_a_snapshot_divergence_resets_the_moments_and_lowers_the_lr() -> None:
    # A loss that grows 100x a step for three steps, overflows once, then calms down.
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    guard = ng.Guard(model, opt, policy="auto")
    guard.recovery.snapshot = None  # as when the snapshot could not be taken
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    losses = []
    for i in range(20):

        def closure(i=i):
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean() * (100.0 ** (i - 3) if 3 < i < 7 else 1.0)
            if i == 7:
                loss = loss * 1e30 * 1e30
            loss.backward()
            return loss

        loss = guard.step(closure)
        losses.append(None if loss is None else float(loss.detach()))
    assert [(r["step"], r["cause"], r["action"]) for r in guard.remedies] == [(7, "optimizer.divergence", "lower_lr")]
    assert "optimizer state of 2 parameters reset" in guard.remedies[0]["reason"]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.005)
    assert losses[7] is None and all(v is not None and math.isfinite(v) for v in losses[8:])


def _poisoned(policy: str):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = ng.Guard(model, opt, policy=policy, param_check_every=0)
    x = torch.randn(8, 4)

    def closure():
        opt.zero_grad()
        loss = (model(x) ** 2).mean()
        loss.backward()
        return loss

    for _ in range(3):
        guard.step(closure)
    with torch.no_grad():
        model.weight[0, 1] = math.nan
    return guard, model, closure


def test_nonfinite_parameters_under_skip_raise_at_once_naming_the_policy_that_helps() -> None:
    guard, _, closure = _poisoned("skip")
    with pytest.raises(ng.NonFiniteError, match=r"skipping cannot help.*policy='rollback'") as err:
        guard.step(closure)
    assert err.value.diagnosis.cause == "parameters.nonfinite" and guard.skipped == 0
    assert guard.remedies[-1]["action"] == "raise"


def test_nonfinite_parameters_under_auto_roll_back_and_training_goes_on() -> None:
    guard, model, closure = _poisoned("auto")
    assert guard.step(closure) is None
    assert [(r["cause"], r["action"]) for r in guard.remedies] == [("parameters.nonfinite", "rollback")]
    losses = [guard.step(closure) for _ in range(3)]
    assert all(v is not None and torch.isfinite(v) for v in losses[1:])  # the first drops its batch
    assert torch.isfinite(model.weight).all()


def test_a_nonfinite_update_under_auto_is_rolled_back_until_its_budget_is_spent() -> None:
    model = nn.Linear(4, 1)
    unused = nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([*model.parameters(), unused], lr=0.01, eps=0.0)  # 0/0 for a zero gradient
    guard = ng.Guard(model, opt, policy="auto", rollback_skip_batches=0, max_consecutive_skips=50)
    x = torch.randn(8, 4)

    def closure():
        opt.zero_grad()
        loss = (model(x) ** 2).mean() + 0.0 * unused.sum()
        loss.backward()
        return loss

    with pytest.raises(ng.NonFiniteError, match="remedy_budget=3"):
        for _ in range(10):
            guard.step(closure)
    # The first NaN update is caught by the parameter check; the later ones by the next step's replay.
    actions = [r["action"] for r in guard.remedies]
    assert actions[-1] == "raise" and set(actions[:-1]) == {"rollback"} and len(actions) >= 4
    assert {r["cause"] for r in guard.remedies} <= {"optimizer.nonfinite_update", "parameters.nonfinite"}


def test_auto_resets_a_collapsed_loss_scale_once_then_training_goes_on() -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    guard = ng.Guard(model, opt, policy="auto", scaler=scaler, max_overflow_streak=3)
    x = torch.randn(8, 4)
    losses = []
    for i in range(8):

        def closure(i=i):
            opt.zero_grad()
            loss = (model(x) ** 2).mean()
            scaler.scale(loss * (math.inf if i < 4 else 1.0)).backward()
            return loss

        losses.append(guard.step(closure))
    assert [(r["cause"], r["action"]) for r in guard.remedies] == [("precision.loss_scale", "skip")]
    assert "reset" in guard.remedies[0]["reason"]
    assert all(v is not None and torch.isfinite(v) for v in losses[4:])


def test_a_second_loss_scale_collapse_raises() -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    guard = ng.Guard(model, opt, policy="auto", scaler=scaler, max_overflow_streak=2)
    x = torch.randn(8, 4)

    def closure():
        opt.zero_grad()
        loss = (model(x) ** 2).mean()
        scaler.scale(loss * math.inf).backward()
        return loss

    with pytest.raises(ng.NonFiniteError):
        for _ in range(6):
            guard.step(closure)
    assert [r["action"] for r in guard.remedies] == ["skip", "raise"]


def test_headroom_sees_op_outputs_inside_a_module_and_warns(tmp_path, caplog) -> None:
    # Scores of 8 * 56**2 = 25088 fit float16 (65504) but are within 8x of it; the module's output is small.
    model = Net(1.0)
    with torch.no_grad():
        model.inp.weight.copy_(torch.eye(8))
        model.attn.q.weight.copy_(torch.eye(8) * 56)
        model.inp.bias.zero_()
        model.attn.q.bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    guard = ng.Guard(model, opt, run_dir=tmp_path, headroom_every=2)
    x = torch.ones(1, 2, 8)

    def closure():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().mean()
        loss.backward()
        return loss

    with caplog.at_level(logging.WARNING, logger="nanguard"):
        for _ in range(3):
            guard.step(closure)
    guard.close()
    events = [e for e in read_events(tmp_path / "events-rank0.jsonl") if e["kind"] == "headroom"]
    assert {e["step"] for e in events} == {0, 2}
    attn = next(e for e in events if e["module"] == "attn" and e["step"] == 0)
    assert attn["dtype"] == "float16" and attn["limit"] == 65504.0 and attn["close"]
    assert 65504.0 / 8 < attn["absmax"] < 65504.0
    with torch.autocast("cpu", dtype=torch.float16):
        assert model.attn(model.inp(x)).abs().max() <= 56  # only op outputs inside show the danger
    out = next(e for e in events if e["module"] == "out" and e["step"] == 0)
    assert not out["close"]
    assert any("module 'attn'" in r.getMessage() for r in caplog.records)


def test_headroom_off_writes_no_events(tmp_path) -> None:
    _autocast_run("auto", 2, tmp_path, scale=1.0, headroom_every=0)
    assert not [e for e in read_events(tmp_path / "events-rank0.jsonl") if e["kind"] == "headroom"]


def test_quarantine_sampler_rereads_the_file_every_epoch(tmp_path) -> None:
    sampler = ng.QuarantineSampler(range(6), tmp_path)
    assert list(sampler) == [0, 1, 2, 3, 4, 5]
    assert add_quarantined(tmp_path, [4, 1, 4], step=3, cause="data.nonfinite") == [1, 4]
    assert add_quarantined(tmp_path, [1], step=4, cause="data.nonfinite") == []
    assert list(sampler) == [0, 2, 3, 5] and len(sampler) == 4
    assert json.loads((tmp_path / "quarantine.json").read_text())["ids"] == [1, 4]


def test_sample_ids_must_be_ids() -> None:
    model = nn.Linear(2, 1)
    guard = ng.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="auto")
    with pytest.raises(ValueError, match="sample_ids"):
        guard.step(lambda: model(torch.ones(1, 2)).sum(), sample_ids="abc")


def test_zoo_remedy_scenarios_auto_finishes_where_skip_cannot() -> None:
    from nanguard.zoo.remedy_scenarios import REMEDY_SCENARIOS, run_remedy_scenario

    by_name = {s.name: s for s in REMEDY_SCENARIOS}
    for name in ("nan_weight", "loss_scale_collapse"):
        skip = run_remedy_scenario(by_name[name], "skip")
        auto = run_remedy_scenario(by_name[name], "auto")
        assert not skip["finished"] and skip["stopped_by"]
        assert auto["ok"] and math.isfinite(auto["final_loss"]) and auto["remedies"]


def test_a_repeating_overflow_is_recognized_without_a_second_full_replay(tmp_path, monkeypatch) -> None:
    import nanguard.guard.diagnoser as diagnoser

    traced = []
    real_trace = diagnoser.trace
    monkeypatch.setattr(diagnoser, "trace", lambda *a, **k: traced.append(1) or real_trace(*a, **k))
    torch.manual_seed(0)
    model = Net(1e5)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = ng.Guard(model, opt, policy="skip", run_dir=tmp_path, max_consecutive_skips=100)
    x, y = torch.randn(4, 6, 8) * 3, torch.randn(4)
    diagnoses, calls = [], []
    for step in range(5):
        batch = x.clone()
        if step == 3:
            batch[1, 2, 0] = math.nan  # a different fault: the input, not the module, is non-finite

        def closure(batch=batch):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ((model(batch).float() - y) ** 2).mean()
            loss.backward()
            return loss

        assert guard.step(closure, batch=batch) is None
        diagnoses.append(guard.last_diagnosis)
        calls.append(len(traced))
    guard.close()
    causes = [(d.cause, d.module) for d in diagnoses]
    assert causes[:3] == [("precision.overflow", "attn")] * 3
    assert calls == [1, 1, 1, 2, 3]  # full replays: the first trip, the new fault, and the trip after it
    assert "repeat_of" not in diagnoses[0].evidence
    assert [d.evidence.get("repeat_of") for d in diagnoses[1:3]] == [0, 1]
    assert [d.step for d in diagnoses[:3]] == [0, 1, 2]
    assert diagnoses[3].cause == "data.nonfinite" and "repeat_of" not in diagnoses[3].evidence
    assert diagnoses[4].cause == "precision.overflow" and "repeat_of" not in diagnoses[4].evidence
    trips = [e for e in read_events(tmp_path / "events-rank0.jsonl") if e["kind"] == "trip"]
    assert [t["diagnosis"]["evidence"].get("repeat_of") for t in trips] == [None, 0, 1, None, None]
