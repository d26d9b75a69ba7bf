"""The guard on real training loops: detection, policies, history rules, scaler, events, resume."""

import copy
import json

import pytest
import torch
from torch import nn

import nanguard as ng
from nanguard.events import read_events
from nanguard.zoo import GPT, GPTConfig, build, get, synthetic_batch, train_step

HEALTHY = get("healthy_padding_mask")


def _nan_batch(batch):
    return {**batch, "pixel_values": torch.full((8, 4, 16), float("nan"))}


def _vision_run(seed=0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vision_dim=16))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _batch(model, step, bad=False):
    batch = synthetic_batch(model.config, torch.Generator().manual_seed(step))
    return _nan_batch(batch) if bad else batch


def _step(guard, model, step, bad=False):
    """A realistic loop body: the batch comes from the loader, the closure captures it."""
    batch = _batch(model, step, bad)
    return guard.step(lambda: train_step(model, batch), batch=batch)


def _state(model, optimizer):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())


def _assert_same(a, b):
    (ma, oa), (mb, ob) = a, b
    assert all(torch.equal(ma[k], mb[k]) for k in ma)
    assert oa["state"].keys() == ob["state"].keys()
    for k in oa["state"]:
        for name, value in oa["state"][k].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(ob["state"][k][name])), (k, name)


def test_guarded_healthy_run_is_bit_identical_to_unguarded() -> None:
    def train(guarded):
        run = build(HEALTHY)
        guard = ng.Guard(run.model, run.optimizer) if guarded else None
        for _, batch in run.batches(6):
            if guard:
                assert guard.step(lambda b=batch: train_step(run.model, b)) is not None
            else:
                train_step(run.model, batch)
                run.optimizer.step()
        assert guard is None or (guard.skipped == 0 and guard.last_diagnosis is None)
        return run.model

    a, b = train(True), train(False)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_skip_leaves_parameters_and_optimizer_state_bit_identical() -> None:
    model, opt = _vision_run()
    guard = ng.Guard(model, opt, policy="skip")
    for step in range(3):
        _step(guard, model, step)
    before = _state(model, opt)
    bad = _batch(model, 3, bad=True)
    assert guard.step(lambda: train_step(model, bad), batch=bad) is None
    _assert_same(before, _state(model, opt))
    assert guard.skipped == 1 and guard.last_action == "skip"
    diag = guard.last_diagnosis
    assert (diag.cause, diag.step, diag.module) == ("data.nonfinite", 3, "vis_proj")
    assert _step(guard, model, 4) is not None
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_skip_restores_batchnorm_running_stats() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ng.Guard(model, opt)
    x = torch.randn(8, 4)

    def closure(x):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    guard.step(lambda: closure(x))
    stats = copy.deepcopy(model[1].state_dict())
    bad = x.clone()
    bad[0, 0] = float("nan")
    guard.step(lambda: closure(bad))
    assert guard.skipped == 1
    assert all(torch.equal(stats[k], v) for k, v in model[1].state_dict().items())


def test_too_many_consecutive_skips_raise() -> None:
    model, opt = _vision_run()
    guard = ng.Guard(model, opt, max_consecutive_skips=2)
    _step(guard, model, 0, bad=True)
    with pytest.raises(ng.NonFiniteError, match="2 steps skipped in a row") as err:
        _step(guard, model, 1, bad=True)
    assert err.value.diagnosis.cause == "data.nonfinite"


def test_raise_carries_the_diagnosis_and_reads_it() -> None:
    model, opt = _vision_run()
    guard = ng.Guard(model, opt, policy="raise")
    with pytest.raises(ng.NonFiniteError) as err:
        _step(guard, model, 0, bad=True)
    assert err.value.diagnosis is guard.last_diagnosis
    assert err.value.diagnosis.cause == "data.nonfinite"
    assert "pixel_values" in str(err.value) and "data.nonfinite" in str(err.value)


def test_rollback_restores_the_snapshot_exactly_and_drops_the_next_batches() -> None:
    model, opt = _vision_run()
    guard = ng.Guard(model, opt, policy="rollback", snapshot_every=2, rollback_skip_batches=2)
    saved = None
    for step in range(5):
        _step(guard, model, step)
        if step == 3:  # good steps 2 and 4 take snapshots: the last one is after step 3
            saved = _state(model, opt)
    assert _step(guard, model, 5, bad=True) is None
    assert guard.last_action == "rollback" and guard.rollbacks == 1
    _assert_same(saved, _state(model, opt))
    calls = []
    for step in (6, 7):
        assert guard.step(lambda step=step: calls.append(step)) is None
        assert guard.last_action == "drop_batch"
    assert calls == []
    assert _step(guard, model, 8) is not None and guard.last_action == "step"


def test_lr_too_high_is_divergence_with_the_op_origin_kept() -> None:
    model = GPT(GPTConfig())
    opt = torch.optim.SGD(model.parameters(), lr=50.0)
    guard = ng.Guard(model, opt, policy="raise")
    with pytest.raises(ng.NonFiniteError) as err:
        for step in range(30):
            _step(guard, model, step)
    diag = err.value.diagnosis
    assert diag.cause == "optimizer.divergence"
    history = diag.evidence["history"]
    assert history["diverging"] and history["growth"] >= 10
    assert diag.evidence["origin"]["op"] and diag.evidence["op_cause"] != "optimizer.divergence"
    assert any("learning rate" in fix for fix in diag.fixes)


def test_adam_with_zero_eps_is_a_nonfinite_update() -> None:
    model = GPT(GPTConfig())  # the padding row of wte gets an all-zero gradient
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0)
    guard = ng.Guard(model, opt, policy="raise")
    with pytest.raises(ng.NonFiniteError) as err:
        for step in range(3):
            _step(guard, model, step)
    diag = err.value.diagnosis
    assert (diag.cause, diag.phase, diag.step, diag.module) == ("optimizer.nonfinite_update", "optimizer", 0, "wte")
    assert "wte.weight" in diag.evidence["parameters"]
    assert any("eps is 0.0" in fix for fix in diag.fixes)


def test_nonfinite_update_under_rollback_restores_finite_weights() -> None:
    model = GPT(GPTConfig())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0)
    guard = ng.Guard(model, opt, policy="rollback", max_consecutive_skips=100)
    _step(guard, model, 0)
    _step(guard, model, 1)
    assert guard.last_action == "rollback" and guard.last_diagnosis.cause == "optimizer.nonfinite_update"
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _amp_setup(loss_factor: float):
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    x = torch.randn(16, 8)

    def closure():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = out.float().pow(2).mean() * loss_factor
        scaler.scale(loss).backward()
        return loss

    return model, opt, scaler, closure


def test_gradscaler_overflow_steps_are_counted_not_diagnosed() -> None:
    model, opt, scaler, closure = _amp_setup(1.0)
    guard = ng.Guard(model, opt, scaler=scaler)
    for _ in range(12):
        guard.step(closure)
    assert guard.overflows >= 1 and guard.last_diagnosis is None and guard.skipped == 0
    assert scaler.get_scale() < 2.0**24
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_gradscaler_collapse_is_precision_loss_scale() -> None:
    model, opt, scaler, closure = _amp_setup(1e6)  # gradients overflow float16 at any scale
    guard = ng.Guard(model, opt, scaler=scaler, max_overflow_streak=5)
    with pytest.raises(ng.NonFiniteError) as err:
        for _ in range(20):
            guard.step(closure)
    diag = err.value.diagnosis
    assert diag.cause == "precision.loss_scale" and diag.evidence["overflow_streak"] == 5
    assert guard.overflows == 5


def test_fused_optimizer_skips_on_the_device() -> None:
    model, _ = _vision_run()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = ng.Guard(model, opt)
    calls = []
    step = opt.step
    opt.step = lambda *a, **k: (calls.append(getattr(opt, "found_inf", None)), step(*a, **k))[1]
    _step(guard, model, 0)
    before = _state(model, opt)
    _step(guard, model, 1, bad=True)
    assert guard.skipped == 1
    _assert_same(before, _state(model, opt))
    # The device path: the optimizer ran on both steps and was handed the agreed flag.
    assert [float(f) for f in calls] == [0.0, 1.0]


def test_gradscaler_keeps_working_after_a_trip() -> None:
    model, opt, scaler, closure = _amp_setup(1.0)
    guard = ng.Guard(model, opt, scaler=scaler)
    x_bad = torch.full((16, 8), float("nan"))

    def bad_closure():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x_bad)
        loss = out.float().pow(2).mean()
        scaler.scale(loss).backward()
        return loss

    for _ in range(12):
        guard.step(closure)
    assert guard.step(bad_closure) is None and guard.last_diagnosis.cause == "data.nonfinite"
    before = [p.detach().clone() for p in model.parameters()]
    assert guard.step(closure) is not None and guard.last_action == "step"
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_index_error_becomes_a_data_diagnosis_and_the_run_goes_on() -> None:
    run = build(get("token_id_out_of_range"))
    guard = ng.Guard(run.model, run.optimizer)
    for _, batch in run.batches(5):
        guard.step(lambda b=batch: train_step(run.model, b))
    assert guard.skipped == 1 and guard.last_diagnosis.cause == "data.index_out_of_range"
    assert guard.last_diagnosis.module == "wte"


def test_check_batch_stops_a_bad_batch_before_the_forward() -> None:
    run = build(get("token_id_out_of_range"))
    guard = ng.Guard(run.model, run.optimizer, check_batch=True)
    calls = []
    batch = run.batch(run.scenario.fault_step)
    assert guard.step(lambda: calls.append(1), batch=batch) is None
    assert calls == [] and guard.last_diagnosis.cause == "data.index_out_of_range"
    assert guard.last_diagnosis.phase == "data"


def test_spike_skip_option() -> None:
    w = nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([w], lr=0.1)
    model = nn.Module()
    model.w = w
    guard = ng.Guard(model, opt, skip_spikes=True, spike_warmup=5, spike_window=20)

    def closure(target):
        opt.zero_grad()
        loss = ((w - target) ** 2).sum() + 1.0
        loss.backward()
        return loss

    for i in range(12):
        guard.step(lambda i=i: closure(torch.full((4,), 0.01 * (i % 2))))
    assert guard.spikes == 0
    before = w.detach().clone()
    assert guard.step(lambda: closure(torch.full((4,), 100.0))) is None
    assert guard.spikes >= 1 and guard.skipped == 1 and torch.equal(w, before)


def test_events_are_written_compactly_and_parse_back(tmp_path) -> None:
    model, opt = _vision_run()
    guard = ng.Guard(model, opt, run_dir=tmp_path)
    for step in range(6):
        _step(guard, model, step, bad=step == 3)
    guard.close()
    path = tmp_path / "events-rank0.jsonl"
    events = list(read_events(path))
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "end"
    assert kinds.count("trip") == 1 and kinds.count("skip") == 1 and kinds.count("step") == 6
    trip = next(e for e in events if e["kind"] == "trip")
    assert trip["step"] == 3 and trip["diagnosis"]["cause"] == "data.nonfinite" and trip["action"] == "skip"
    step_lines = [line for line in path.read_text().splitlines() if '"kind":"step"' in line]
    # The run id every event carries (DESIGN.md's contract) is ~30 of these bytes.
    assert max(len(line) for line in step_lines) < 160
    assert (tmp_path / "bundles" / "step-00000003-rank-0" / "meta.json").exists()


def test_resume_from_state_dict_keeps_history_and_counters() -> None:
    model, opt = _vision_run()
    guard = ng.Guard(model, opt)
    for step in range(5):
        _step(guard, model, step, bad=step == 2)
    state = json.loads(json.dumps(guard.state_dict()))
    resumed = ng.Guard(model, opt)
    resumed.load_state_dict(state)
    assert (resumed.step_count, resumed.skipped) == (5, 1)
    assert list(resumed.history) == list(guard.history)
    assert list(resumed.loss_spikes.values) == list(guard.loss_spikes.values)
    assert resumed.last_diagnosis.cause == "data.nonfinite"


def test_a_crash_inside_locate_does_not_kill_training(monkeypatch) -> None:
    import nanguard.guard.diagnoser as guard_mod

    def broken(*args, **kwargs):
        raise RuntimeError("tracer bug")

    monkeypatch.setattr(guard_mod, "trace", broken)
    model, opt = _vision_run()
    guard = ng.Guard(model, opt)
    with pytest.warns(UserWarning, match="locate failed"):
        _step(guard, model, 0, bad=True)
    assert guard.skipped == 1 and guard.last_diagnosis.cause == "unknown"
    assert _step(guard, model, 1) is not None


def test_rollbacks_in_a_row_are_bounded_too() -> None:
    model, opt = _vision_run()
    guard = ng.Guard(model, opt, policy="rollback", rollback_skip_batches=0, max_consecutive_skips=3)
    _step(guard, model, 0)
    _step(guard, model, 1, bad=True)
    _step(guard, model, 2, bad=True)
    assert guard.rollbacks == 2
    with pytest.raises(ng.NonFiniteError, match="3 steps skipped in a row"):
        _step(guard, model, 3, bad=True)


def test_a_spike_skip_writes_the_step_like_every_other_skip(tmp_path) -> None:
    """Without a GradScaler a skipped step's event has no scale (it said 1.0 for spike skips only)."""
    w = nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([w], lr=0.1)
    model = nn.Module()
    model.w = w
    guard = ng.Guard(model, opt, skip_spikes=True, spike_warmup=5, spike_window=20, run_dir=tmp_path)

    def closure(target):
        opt.zero_grad()
        loss = ((w - target) ** 2).sum() + 1.0
        loss.backward()
        return loss

    for i in range(12):
        guard.step(lambda i=i: closure(torch.full((4,), 0.01 * (i % 2))))
    assert guard.step(lambda: closure(torch.full((4,), 100.0))) is None
    guard.close()
    steps = [e for e in read_events(tmp_path / "events-rank0.jsonl") if e["kind"] == "step"]
    assert len(steps) == 13 and steps[-1]["skipped"] and steps[-1]["loss"] > 1000.0
    assert {e["scale"] for e in steps} == {None}
