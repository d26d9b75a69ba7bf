"""``nanguard bisect`` / ``ng.bisect``: an unguarded run with a planted fault writes checkpoints, and
bisect names its first bad step and the cause, from the last finite checkpoint before it."""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import nanguard as ng
from nanguard.cli import main
from nanguard.errors import NanguardError
from nanguard.zoo.spawn import spawn_ranks

# The user's training script: an unguarded run (train) that checkpoints every EVERY steps with
# torch.save, and the setup function bisect calls. FAULT plants the fault at BAD_STEP.
RUN = '''
import os
import torch
from torch import nn

STEPS, EVERY, BAD_STEP, BAD_ROW, FAULT, BAD_RANK = {steps}, {every}, {bad_step}, 2, {fault!r}, {bad_rank}


def rank():
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def batch_at(step):
    g = torch.Generator().manual_seed(1000 * rank() + step)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    if step == BAD_STEP and FAULT != "diverge" and BAD_RANK in (None, rank()):
        x[BAD_ROW, 3] = float("nan") if FAULT == "nan_input" else 100.0
    return {{"x": x, "y": y}}


def lr_at(step):
    return 1.0 if FAULT != "diverge" or step < BAD_STEP else 60.0


def build():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    model = net
    if torch.distributed.is_initialized():
        model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)

    def closure(batch):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
        if FAULT == "log_domain" and bool(batch["x"][:, 3].max() > 50):  # a bug on a rare input
            loss = loss + torch.log(model(batch["x"]).mean() - 1000.0)
        loss.backward()
        return loss

    return net, model, opt, sched, closure


def train(folder):
    """The run that had no guard: it checkpoints, steps, and goes NaN at BAD_STEP."""
    net, model, opt, sched, closure = build()
    first_nonfinite = None
    for step in range(STEPS):
        if step % EVERY == 0 and rank() == 0:
            state = {{"model": net.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}}
            torch.save({{**state, "step": step}}, os.path.join(folder, f"ckpt-{{step}}.pt"))
        loss = closure(batch_at(step))
        if first_nonfinite is None and not bool(loss.isfinite()):
            first_nonfinite = step
        opt.step()
        sched.step()
    return first_nonfinite


def setup():
    net, model, opt, sched, closure = build()

    def load(path):
        state = torch.load(path, weights_only=True)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        return state["step"]

    def batches(start):
        return (batch_at(step) for step in range(start, STEPS))

    parts = {{"model": model, "optimizer": opt, "scheduler": sched}}
    return {{**parts, "load": load, "batches": batches, "closure": closure}}
'''


def _run_module(tmp_path: Path, name: str, **params: Any) -> ModuleType:
    values = {"steps": 24, "every": 5, "bad_step": 13, "fault": "nan_input", "bad_rank": None, **params}
    (tmp_path / f"{name}.py").write_text(RUN.format(**values))
    if str(tmp_path) not in sys.path:
        sys.path.insert(0, str(tmp_path))
    return importlib.import_module(name)


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("bisect_run")]:
        del sys.modules[name]
    if str(tmp_path) in sys.path:
        sys.path.remove(str(tmp_path))


def test_names_the_first_bad_step_from_the_last_finite_checkpoint(run_dir: Path) -> None:
    run = _run_module(run_dir, "bisect_run_a")
    assert run.train(run_dir / "ckpt") == 13  # the unguarded run went NaN at step 13
    (run_dir / "ckpt" / "notes.txt").write_text("not a checkpoint")
    shown: list[tuple[str, int, list[str]]] = []

    @contextlib.contextmanager
    def progress(total: int, label: str) -> Iterator[Callable[[str], None]]:
        shown.append((label, total, []))
        yield shown[-1][2].append

    found = ng.bisect(run.setup, run_dir / "ckpt", progress=progress)
    # progress: every entry checked (6 of 6), then each replayed step
    assert [(label, total, len(lines)) for label, total, lines in shown] == [
        ("checking checkpoints", 6, 6),
        ("replaying from step 10", 0, 4),
    ]
    assert shown[0][2][2] == "ckpt-10.pt: step 10, finite" and shown[1][2][-1] == "step 13: data.nonfinite"
    assert found.first_bad_step == 13
    assert found.checkpoint_step == 10 and found.checkpoint.endswith("ckpt-10.pt")
    assert found.steps_replayed == 4  # 10, 11, 12 finite; 13 trips
    diag = found.diagnosis
    assert diag is not None and diag.cause == "data.nonfinite" and diag.phase == "data" and diag.step == 13
    assert diag.module == "0"  # the first Linear read the bad input
    assert found.rows == [2] == diag.evidence["rows"]
    table = {Path(c.path).name: c for c in found.checkpoints}
    assert [table[f"ckpt-{s}.pt"].finite for s in (0, 5, 10, 15, 20)] == [True, True, True, False, False]
    assert "NaN" in (table["ckpt-15.pt"].nonfinite or "")
    assert table["notes.txt"].step is None and table["notes.txt"].refused
    assert [r["step"] for r in found.recent] == [10, 11, 12]


def test_the_json_holds_the_keys_and_the_fault_after_every_checkpoint(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run_module(run_dir, "bisect_run_b", bad_step=22, fault="log_domain")
    run.train(run_dir / "ckpt")
    assert main(["bisect", "bisect_run_b:setup", "--checkpoints", "ckpt", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["first_bad_step"] == 22 and out["checkpoint_step"] == 20 and out["steps_replayed"] == 3
    assert out["diagnosis"]["cause"] == "op.log_domain" and out["diagnosis"]["op"] == "aten.log.default"
    assert all(c["finite"] for c in out["checkpoints"])

    # up to --until the run is finite: first_bad_step null, exit 1
    assert main(["bisect", "bisect_run_b:setup", "--checkpoints", "ckpt", "--json", "--until", "21"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["first_bad_step"] is None and out["diagnosis"] is None
    assert out["steps_replayed"] == 2 and out["last_step"] == 21

    # the readable form names the step, the checkpoint and the cause
    assert main(["bisect", "bisect_run_b:setup", "--checkpoints", "ckpt"]) == 0
    text = capsys.readouterr().out
    assert "first bad step: 22 (op.log_domain)" in text and "ckpt-20.pt" in text


def test_a_run_already_diverging_at_its_checkpoint_trips_on_the_divergence(run_dir: Path) -> None:
    run = _run_module(run_dir, "bisect_run_c", steps=60, every=10, bad_step=20, fault="diverge")
    went_nan = run.train(run_dir / "ckpt")
    assert went_nan is not None and went_nan > 30
    found = ng.bisect(run.setup, run_dir / "ckpt")
    assert found.diagnosis is not None and found.diagnosis.cause == "optimizer.divergence"
    # ckpt-30 is finite but its loss already huge: its replay trips at once, so bisect goes back to
    # ckpt-20 (where the LR jumped: too few steps to warm the detectors before it trips), then ckpt-10,
    # whose warm detectors see the loss take off after step 20 and trip early
    assert found.stepped_back == [30, 20] and found.checkpoint_step == 10
    assert found.first_bad_step is not None and 20 < found.first_bad_step < 30 < went_nan
    assert found.spikes and found.spikes[0]["step"] < found.first_bad_step  # the early warning came first


def test_only_non_finite_checkpoints_and_wrong_setups_are_one_line_errors(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run_module(run_dir, "bisect_run_d", bad_step=2)
    run.train(run_dir / "ckpt")
    (run_dir / "ckpt" / "ckpt-0.pt").unlink()  # 5, 10, ...: written after the NaN at step 2
    with pytest.raises(NanguardError, match=r"every checkpoint is non-finite, the earliest too \(.*ckpt-5.pt, step 5"):
        ng.bisect(run.setup, run_dir / "ckpt")
    assert main(["bisect", "bisect_run_d:setup", "--checkpoints", "ckpt"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("nanguard bisect: error: every checkpoint is non-finite")

    junk = run_dir / "junk"
    junk.mkdir()
    (junk / "a.txt").write_text("x")
    with pytest.raises(ValueError, match=r"load accepts no entry of .*junk.* \(1 tried; a.txt: "):
        ng.bisect(run.setup, junk)
    with pytest.raises(ValueError, match="returned a list, not a dict with model, optimizer, load"):
        ng.bisect(lambda: [1], run_dir / "ckpt")
    with pytest.raises(ValueError, match="lacks closure"):
        ng.bisect({k: v for k, v in run.setup().items() if k != "closure"}, run_dir / "ckpt")
    with pytest.raises(ValueError, match="no such directory"):
        ng.bisect(run.setup, run_dir / "missing")
    with pytest.raises(ValueError, match="until must be an int >= 0"):
        ng.bisect(run.setup, run_dir / "ckpt", until=-1)
    with pytest.raises(SystemExit) as exit_:
        main(["bisect", "bisect_run_nope:setup", "--checkpoints", "ckpt"])
    assert exit_.value.code == 2
    assert (
        capsys.readouterr().err.strip()
        == "nanguard bisect: error: FUNCTION: no module named 'bisect_run_nope' (in 'bisect_run_nope:setup')"
    )


def _bisect_rank(rank: int, world: int, folder: str, name: str) -> dict[str, Any]:
    sys.path.insert(0, folder)
    run = importlib.import_module(name)
    run.train(str(Path(folder, "ckpt")))  # rank 0 writes the checkpoints: DDP keeps the replicas equal
    torch.distributed.barrier()
    return ng.bisect(run.setup, Path(folder, "ckpt")).to_dict()


def test_every_rank_agrees_under_ddp(run_dir: Path) -> None:
    _run_module(run_dir, "bisect_run_e", bad_step=13, bad_rank=1)
    results = spawn_ranks(_bisect_rank, str(run_dir), "bisect_run_e", world=2, timeout=240)
    assert results[0] == results[1]
    found = results[0]
    assert found["first_bad_step"] == 13 and found["checkpoint_step"] == 10
    assert found["diagnosis"]["cause"] == "data.nonfinite" and found["diagnosis"]["rank"] == 1
    assert found["rows"] == [2]


def _good_setup() -> dict[str, Any]:
    model = torch.nn.Linear(2, 1)
    return {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "load": lambda path: 0,
        "batches": lambda step: None,
        "closure": lambda batch: None,
    }


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"model": 3}, "FUNCTION: setup: 'model' is a int, not a torch.nn.Module"),
        ({"optimizer": None}, "FUNCTION: setup: 'optimizer' is a NoneType, not a torch.optim.Optimizer"),
        ({"load": "ckpt"}, "FUNCTION: setup: 'load' is a str, not a function"),
        ({"batches": [1]}, "FUNCTION: setup: 'batches' is a list, not a function"),
        ({"closure": 1.0}, "FUNCTION: setup: 'closure' is a float, not a function"),
        (
            {"extra": 1, "other": 2},
            "FUNCTION: setup returned a dict that has unknown key(s) extra, other; expected a dict with model, "
            "optimizer, load, batches, closure (and optionally scheduler, scaler)",
        ),
    ],
)
def test_each_wrong_part_of_a_setup_is_named_with_what_it_must_be(change: dict[str, Any], problem: str) -> None:
    from nanguard.bisection import _parts

    with pytest.raises(ValueError) as info:
        _parts({**_good_setup(), **change})
    assert str(info.value) == problem
    made = {**_good_setup(), **change}

    def named_setup() -> dict[str, Any]:
        return made

    with pytest.raises(ValueError) as info:
        _parts(named_setup)  # a function is called and named by its qualified name
    assert str(info.value) == problem.replace("setup", f"{named_setup.__qualname__}", 1)
    assert _parts(_good_setup).scheduler is None


@pytest.mark.parametrize(
    ("mine", "rows", "want"),
    [
        ((5, None), [[1, 5, 0], [1, 5, 0]], (5, None, None)),
        ((5, None), [[1, 5, 0], [0, -1, 0], [0, -1, 0]], (None, None, "rank(s) [1, 2] could not load it")),
        ((None, None), [[0, -1, 0], [1, 5, 0]], (None, None, "refused here")),
        ((5, None), [[1, 5, 0], [1, 5, 1]], (5, "non-finite on rank(s) [1]", None)),
        ((5, "weight holds NaN"), [[1, 5, 1], [1, 5, 1]], (5, "weight holds NaN (rank(s) [0, 1])", None)),
    ],
)
def test_a_checkpoint_is_what_every_rank_saw_of_it(
    mine: tuple[int | None, str | None], rows: list[list[int]], want: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks' views of one checkpoint (as the all-gather hands them over) folded into one entry."""
    import nanguard.bisection as bisection

    monkeypatch.setattr(bisection.dist, "is_distributed", lambda: True)
    monkeypatch.setattr(bisection, "_gather", lambda values: rows)
    entry = bisection.Checkpoint("ckpt-5", mine[0], mine[1], refused=None if mine[0] is not None else "refused here")
    got = bisection._agreed(entry)
    assert (got.step, got.nonfinite, got.refused) == want


def test_ranks_whose_load_returns_different_steps_are_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import nanguard.bisection as bisection

    monkeypatch.setattr(bisection.dist, "is_distributed", lambda: True)
    monkeypatch.setattr(bisection, "_gather", lambda values: [[1, 5, 0], [1, 6, 0]])
    with pytest.raises(ValueError, match=r"returned different steps on the ranks \(rank 0: 5, rank 1: 6\)"):
        bisection._agreed(bisection.Checkpoint("ckpt-5", 5))
