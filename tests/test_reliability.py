"""What nanguard guarantees a training run: a full disk, an interrupt, a bad closure or a
failure of nanguard's own never kills the run or leaves the step half-done; a skip and a
rollback restore exactly what the README says they do."""

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import nanguard as ng
from nanguard.bundle import replay
from nanguard.events import read_events
from nanguard.guard.diagnoser import Diagnoser


def _model(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(dropout), nn.ReLU(), nn.Linear(8, 1))


def _batch(i: int, bad: bool = False) -> torch.Tensor:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(i))
    if bad:
        x[3, 1] = float("nan")
    return x


def _closure(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor):
    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    return closure


def _guard(model: nn.Module, policy: str = "skip", **options) -> tuple[ng.Guard, torch.optim.Optimizer]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return ng.Guard(model, opt, policy=policy, module_stats=False, **options), opt


def _train(guard: ng.Guard, model: nn.Module, opt: torch.optim.Optimizer, batches: list[tuple[int, bool]]) -> None:
    for i, bad in batches:
        x = _batch(i, bad)
        guard.step(_closure(model, opt, x), batch={"x": x})


def _buffers(model: nn.Module) -> list[torch.Tensor]:
    return [b.clone() for b in model.buffers()]


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# -- 1. a full disk -------------------------------------------------------------------------
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
def test_an_event_log_on_a_full_device_warns_once_and_training_goes_on(tmp_path: Path) -> None:
    (tmp_path / "events-rank0.jsonl").symlink_to("/dev/full")
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard, opt = _guard(model, run_dir=tmp_path)  # its start event already hits the full device
        _train(guard, model, opt, [(0, False), (1, True), (2, False)])
        guard.close()
    disabled = [w for w in caught if "event log disabled" in str(w.message)]
    assert len(disabled) == 1 and "No space left" in str(disabled[0].message)
    assert guard.skipped == 1 and guard.step_count == 3 and guard.last_action == "step"
    assert guard.last_diagnosis is not None and guard.last_diagnosis.cause.startswith("data.")


_FULL_TMPFS_RUN = """
import json, os, sys, warnings
import torch
sys.path.insert(0, {tests!r})
from test_reliability import _batch, _closure, _guard, _model
mount = {mount!r}
filler = os.open(os.path.join(mount, "filler"), os.O_WRONLY | os.O_CREAT)
try:
    while True:
        os.write(filler, b"x" * 4096)
except OSError:
    os.close(filler)
model = _model()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    guard, opt = _guard(model, run_dir=os.path.join(mount, "run"))
    for i in range(6):
        x = _batch(i, bad=i in (2, 4))
        guard.step(_closure(model, opt, x), batch={{"x": x}})
    guard.close()
print(json.dumps({{"warnings": [str(w.message) for w in caught], "skipped": guard.skipped,
                  "steps": guard.step_count}}))
"""


def test_a_real_full_file_system_warns_once_per_kind_and_training_goes_on(tmp_path: Path) -> None:
    """A 256 KiB tmpfs, filled before the guard starts: events and bundles both fail."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) to mount a private tmpfs")
    mount = tmp_path / "mnt"
    mount.mkdir()
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", f"mount -t tmpfs -o size=256k tmpfs {mount}"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {probe.stderr.strip()}")
    script = _FULL_TMPFS_RUN.format(tests=str(Path(__file__).parent), mount=str(mount))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run(
        [
            "unshare",
            "--user",
            "--map-root-user",
            "--mount",
            "sh",
            "-c",
            'mount -t tmpfs -o size=256k tmpfs "$0" && exec "$1" -c "$2"',
            str(mount),
            sys.executable,
            script,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["steps"] == 6 and result["skipped"] == 2
    messages = result["warnings"]
    assert sum("event log disabled" in m for m in messages) == 1
    assert sum("could not write the bundle" in m for m in messages) == 1


# -- 2. an exception or interrupt inside the step ----------------------------------------------
@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_error_inside_the_closure_leaves_no_trace(error: type[BaseException]) -> None:
    model = _model(dropout=0.3)
    guard, opt = _guard(model)
    _train(guard, model, opt, [(0, False)])
    buffers, params, rng = _buffers(model), _params(model), torch.get_rng_state()

    def closure() -> torch.Tensor:
        opt.zero_grad()
        model(_batch(1)).pow(2).mean().backward()  # BatchNorm stats, RNG and gradients all move
        raise error("stop")

    with pytest.raises(error):
        guard.step(closure)
    assert _equal(_buffers(model), buffers)  # running stats and num_batches_tracked
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert _equal(_params(model), params) and guard.step_count == 1
    _train(guard, model, opt, [(2, False)])
    assert guard.step_count == 2 and guard.last_action == "step"


def test_an_interrupt_during_the_replay_leaves_no_trace() -> None:
    model = _model(dropout=0.3)
    guard, opt = _guard(model)
    _train(guard, model, opt, [(0, False)])
    buffers, params, rng = _buffers(model), _params(model), torch.get_rng_state()
    calls = []

    def closure() -> torch.Tensor:
        calls.append(1)
        if len(calls) > 1:
            model(_batch(1))  # the replay moves the BatchNorm stats, then the user presses Ctrl-C
            raise KeyboardInterrupt
        return _closure(model, opt, _batch(1, bad=True))()

    with pytest.raises(KeyboardInterrupt):
        guard.step(closure, batch={"x": _batch(1, bad=True)})
    assert len(calls) == 2
    assert _equal(_buffers(model), buffers) and _equal(_params(model), params)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert guard.step_count == 1 and guard.skipped == 0
    _train(guard, model, opt, [(2, False)])
    assert guard.last_action == "step"


# -- 3. the closure's return value ---------------------------------------------------------
@pytest.mark.parametrize(("returned", "error"), [(None, TypeError), ("0.5", TypeError), (torch.tensor([]), ValueError)])
def test_a_closure_that_returns_no_loss_is_an_error_and_no_update(returned: object, error: type) -> None:
    model = _model()
    guard, opt = _guard(model)
    params, buffers = _params(model), _buffers(model)

    def closure() -> object:
        opt.zero_grad()
        model(_batch(0)).pow(2).mean().backward()
        return returned

    with pytest.raises(error, match="closure's return value"):
        guard.step(closure)
    assert _equal(_params(model), params) and _equal(_buffers(model), buffers)
    assert guard.step_count == 0 and guard.skipped == 0 and not opt.state


def test_a_multi_element_loss_is_non_finite_when_any_element_is() -> None:
    model = _model()
    guard, opt = _guard(model, locate=False)
    params = _params(model)

    def closure(bad: bool) -> torch.Tensor:
        opt.zero_grad()
        per_sample = model(_batch(0)).pow(2).squeeze(1)
        per_sample.mean().backward()
        return torch.cat([per_sample.detach()[1:], torch.tensor([float("nan") if bad else 1.0])])

    assert guard.step(lambda: closure(bad=True)) is None
    assert guard.skipped == 1 and _equal(_params(model), params)
    assert guard.step(lambda: closure(bad=False)) is not None
    assert guard.last_action == "step" and not _equal(_params(model), params)


# -- 4. rollback and the LR scheduler -------------------------------------------------------
def test_a_rollback_restores_the_scheduler_with_the_optimizer() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    guard = ng.Guard(model, opt, policy="rollback", scheduler=sched, snapshot_every=2, rollback_skip_batches=0)
    for i, bad in [(0, False), (1, False), (2, False), (3, True)]:
        x = _batch(i, bad)
        if guard.step(_closure(model, opt, x)) is not None:  # the README's loop: step it after an update
            sched.step()
    # The snapshot after the second update holds the scheduler as that iteration's step left it (recorded
    # at the guard's next call): the LR the run had for its next update, not one step behind.
    assert guard.last_action == "rollback" and sched.last_epoch == 2
    assert opt.param_groups[0]["lr"] == pytest.approx(sched.get_last_lr()[0]) == pytest.approx(0.1 * 0.5**2)
    guard.step(_closure(model, opt, _batch(4)))
    sched.step()
    assert sched.last_epoch == 3 and opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


# -- 5. a skip is exact with dropout --------------------------------------------------------
def test_a_skipped_batch_leaves_the_run_identical_to_one_that_never_saw_it() -> None:
    def run(batches: list[tuple[int, bool]]) -> list[torch.Tensor]:
        model = _model(dropout=0.5)
        guard, opt = _guard(model)
        torch.manual_seed(123)
        _train(guard, model, opt, batches)
        assert guard.skipped == sum(bad for _, bad in batches)
        return [*_params(model), *_buffers(model), torch.get_rng_state()]

    with_skip = run([(0, False), (1, True), (2, False), (3, False)])
    never_seen = run([(0, False), (2, False), (3, False)])
    assert _equal(with_skip, never_seen)


# -- 8. arguments ---------------------------------------------------------------------------
def test_bad_arguments_are_errors_naming_them(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for kwargs, name in [
        ({"scaler": "x"}, "scaler"),
        ({"scheduler": "x"}, "scheduler"),
        ({"run_dir": 123}, "run_dir"),
        ({"run_dir": a_file}, "run_dir"),
    ]:
        with pytest.raises(ValueError, match=name):
            ng.Guard(model, opt, **kwargs)
    guard = ng.Guard(model, opt)
    with pytest.raises(ValueError, match="replay"):
        guard.check(torch.tensor(1.0), replay="x")
    with pytest.raises(ValueError, match="rng"):
        guard.check(torch.tensor(1.0), rng="x")
    with pytest.raises(TypeError, match="loss"):
        guard.check("x")
    with pytest.raises(ValueError, match="bundle"):
        replay("x", model)


@pytest.mark.parametrize(
    ("state", "name"),
    [({"step_count": 5, "skipped": "x"}, "skipped"), ({"step_count": 5, "history": [[1, 2]]}, "guard state")],
)
def test_a_bad_state_is_not_half_applied(state: dict, name: str) -> None:
    model = _model()
    guard, opt = _guard(model)
    _train(guard, model, opt, [(0, False), (1, True), (2, False)])
    before = guard.state_dict()
    with pytest.raises(ValueError, match=name):
        guard.load_state_dict(state)
    assert guard.state_dict() == before


# -- 9. nanguard's own failures during a trip -----------------------------------------------
def test_a_failing_diagnosis_is_a_warning_and_an_unknown_diagnosis(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("diagnose bug")

    monkeypatch.setattr(Diagnoser, "tripped", broken)
    model = _model()
    guard, opt = _guard(model)
    with pytest.warns(UserWarning, match="diagnose bug"):
        _train(guard, model, opt, [(0, True)])
    assert guard.skipped == 1 and guard.last_diagnosis is not None and guard.last_diagnosis.cause == "unknown"
    _train(guard, model, opt, [(1, False)])
    assert guard.last_action == "step"


def test_a_failing_trip_record_is_a_warning(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from nanguard.guard.recorder import Recorder

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("recorder bug")

    monkeypatch.setattr(Recorder, "trip", broken)
    model = _model()
    guard, opt = _guard(model, run_dir=tmp_path)
    with pytest.warns(UserWarning, match="recorder bug"):
        _train(guard, model, opt, [(0, True), (1, False)])
    guard.close()
    assert guard.skipped == 1 and guard.last_action == "step"
    kinds = [e["kind"] for e in read_events(tmp_path / "events-rank0.jsonl")]
    assert "trip" not in kinds and kinds.count("skip") == 1  # the rest of the trip is still recorded


# -- 11. the rollback snapshot is refreshed in place ----------------------------------------
def test_a_snapshot_refresh_reuses_the_snapshot_memory() -> None:
    model = _model()
    # One snapshot kept: each refresh replaces it (several: each slot's refresh replaces that slot's).
    guard, opt = _guard(model, policy="rollback", snapshot_every=1, snapshots=1)
    _train(guard, model, opt, [(0, False)])  # Adam's state exists from here on

    def tensors() -> list[torch.Tensor]:
        snap = guard.recovery.snapshot
        assert snap is not None
        state = snap["optimizer"]["state"]
        return [*snap["model"].values(), *(v for s in state.values() for v in s.values())]

    first = tensors()
    _train(guard, model, opt, [(1, False)])
    second = tensors()
    assert [t.data_ptr() for t in first] == [t.data_ptr() for t in second]
    assert _equal(list(guard.recovery.snapshot["model"].values()), [*_params_and_buffers(model)])
    assert _equal(
        [opt.state[p]["exp_avg"] for p in model.parameters()],
        [s["exp_avg"] for s in guard.recovery.snapshot["optimizer"]["state"].values()],
    )


def _params_and_buffers(model: nn.Module) -> list[torch.Tensor]:
    return [v.detach() for v in model.state_dict().values()]


def test_close_removes_the_guards_hooks_and_lets_its_snapshots_go() -> None:
    """A run that ends leaves the model and optimizer with the hooks they had before the guard (a new guard
    on the same model, as a notebook or a sweep makes, does not pile them up, each holding the old guard's
    parts) and holds no snapshot; what it counted stays readable."""
    from nanguard.zoo import GPT, GPTConfig, synthetic_batch, train_step

    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = synthetic_batch(cfg, torch.Generator().manual_seed(0))

    def hooks() -> list[int]:
        held = [model._load_state_dict_post_hooks, model._forward_pre_hooks, model._forward_hooks]
        return [len(h) for h in [*held, opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks]]

    before = hooks()
    for _ in range(2):  # two guards in turn on the same model
        guard = ng.Guard(model, opt, policy="rollback", snapshot_every=1, precursor_every=1)
        for _ in range(3):
            guard.step(lambda: train_step(model, batch))
        assert guard.recovery.snapshots and hooks() != before  # held while the run goes
        guard.close()
        assert hooks() == before
        assert guard.recovery.snapshots == [] and guard.step_count == 3
