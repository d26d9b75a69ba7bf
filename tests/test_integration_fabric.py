"""FabricGuard on real Lightning Fabric: a litgpt-style loop (no_backward_sync, fabric.backward,
fabric.clip_gradients, optimizer.step), one process and 2 gloo ranks through Fabric's DDP strategy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

import nanguard as ng
from nanguard.integrations.fabric import FabricGuard

ACCUM = 2
STEPS = 4
BAD = (1, 1)  # (optimizer step, micro-batch): the NaN sample


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x), y)


def _batch(step: int, micro: int, bad: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * 10 + micro)
    x = torch.randn(4, 8, generator=gen)
    y = x.sum(1, keepdim=True)
    if (step, micro) == bad:
        x[0, 3] = float("nan")
    return x, y


def _fabric() -> L.Fabric:
    return L.Fabric(accelerator="cpu", devices=1)


def _loop(fabric, model, optimizer, bad=BAD, scheduler=None, max_norm=1.0) -> list[float]:
    """A litgpt-style loop: one batch per iteration, accumulation under no_backward_sync."""
    lrs = []
    for it in range(STEPS * ACCUM):
        step, micro = divmod(it, ACCUM)
        accumulating = micro != ACCUM - 1
        x, y = _batch(step, micro, bad)
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = model(x, y)
            fabric.backward(loss / ACCUM)
        if not accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=max_norm)
            optimizer.step()
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()
            lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def _setup(fabric: L.Fabric, lr: float = 1e-2):
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return (model, *fabric.setup(model, optimizer))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_healthy_loop_is_bit_identical_to_the_unguarded_one(tmp_path: Path) -> None:
    fabric = _fabric()
    plain, model, optimizer = _setup(fabric)
    _loop(fabric, model, optimizer, bad=None)
    guarded_fabric = _fabric()
    user, model, optimizer = _setup(guarded_fabric)
    with FabricGuard(guarded_fabric, model, optimizer, policy="raise", run_dir=tmp_path) as guard:
        _loop(guarded_fabric, model, optimizer, bad=None)
    assert guard.guard is not None and guard.guard.step_count == STEPS and guard.skipped == 0
    for key, value in plain.state_dict().items():
        assert torch.equal(user.state_dict()[key], value), key
    # Closed: the loop runs unguarded again.
    assert "backward" not in vars(guarded_fabric) and "step" not in vars(optimizer)


def test_a_nan_micro_batch_is_skipped_diagnosed_and_named_as_in_the_users_model(tmp_path: Path) -> None:
    fabric = _fabric()
    user, model, optimizer = _setup(fabric)
    states = []
    original_step = optimizer.step

    with FabricGuard(fabric, model, optimizer, policy="skip", run_dir=tmp_path) as guard:
        real_step = optimizer.step

        def watched_step(*args, **kwargs):
            states.append(_state(user))
            out = real_step(*args, **kwargs)
            states.append(_state(user))
            return out

        optimizer.step = watched_step
        _loop(fabric, model, optimizer)
        optimizer.step = real_step
    assert optimizer.step == original_step
    assert guard.skipped == 1 and guard.trips == 1
    diag = guard.last_diagnosis
    assert diag is not None
    assert (diag.cause, diag.phase, diag.module, diag.step) == ("data.nonfinite", "data", "net.0", BAD[0])
    assert diag.evidence["origin"]["path"] == "batch[1]['x']"  # the step's second micro-batch
    skipped_before, skipped_after = states[2 * BAD[0]], states[2 * BAD[0] + 1]
    for key, value in skipped_before.items():  # weights and BatchNorm running stats as before the step
        assert torch.equal(skipped_after[key], value), key
    assert int(optimizer.state[user.net[0].weight]["step"]) == STEPS - 1
    assert all(bool(torch.isfinite(v).all()) for v in user.state_dict().values() if v.is_floating_point())
    assert "data.nonfinite" in (tmp_path / "events-rank0.jsonl").read_text()


def test_the_check_comes_before_fabrics_clip_so_it_never_raises() -> None:
    fabric = _fabric()
    _, model, optimizer = _setup(fabric)
    with pytest.raises(RuntimeError, match="non-finite"):  # unguarded: the clip kills the run
        _loop(fabric, model, optimizer)
    fabric = _fabric()
    _, model, optimizer = _setup(fabric)
    with FabricGuard(fabric, model, optimizer, policy="raise") as guard, pytest.raises(ng.NonFiniteError) as info:
        _loop(fabric, model, optimizer)
    assert info.value.diagnosis.cause == "data.nonfinite" and info.value.diagnosis.step == BAD[0]
    assert guard.trips == 1


def test_a_skip_leaves_the_schedulers_step_undone() -> None:
    fabric = _fabric()
    _, model, optimizer = _setup(fabric, lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    with FabricGuard(fabric, model, optimizer, scheduler=scheduler) as guard:
        lrs = _loop(fabric, model, optimizer, scheduler=scheduler)
    assert guard.skipped == 1
    assert lrs == pytest.approx([0.05, 0.05, 0.025, 0.0125])  # the skipped step did not advance the schedule
    assert scheduler.last_epoch == STEPS - 1


class Head(nn.Module):
    """Returns the prediction; the loss (a log of it) is computed outside the model."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x))


def test_a_loss_outside_the_model_is_replayed_through_micro_step() -> None:
    fabric = _fabric()
    head = Head()
    model, optimizer = fabric.setup(head, torch.optim.SGD(head.parameters(), lr=1e-2))
    with FabricGuard(fabric, model, optimizer) as guard:

        @guard.micro_step
        def loss_of(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return (torch.log(model(x)) - target).pow(2).mean()  # log of a negative prediction: NaN

        for step in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            with torch.no_grad():
                shift = 0.0 if step == 0 else -100.0  # step 1: every prediction negative
                head.out.bias.fill_(10.0 + shift)
            for micro in range(ACCUM):
                with fabric.no_backward_sync(model, enabled=micro != ACCUM - 1):
                    fabric.backward(loss_of(x, torch.zeros(4, 1)) / ACCUM)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
    diag = guard.last_diagnosis
    assert guard.skipped == 1 and diag is not None
    assert (diag.cause, diag.op, diag.phase, diag.step) == ("op.log_domain", "aten.log.default", "forward", 1)


def test_wrong_arguments_name_what_fabric_setup_returns() -> None:
    fabric = _fabric()
    plain = Net()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    model, optimizer = fabric.setup(Net(), torch.optim.SGD(Net().parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"model must be the module fabric\.setup"):
        FabricGuard(fabric, plain, optimizer)
    with pytest.raises(ValueError, match=r"optimizer must be the optimizer fabric\.setup"):
        FabricGuard(fabric, model, opt)
    with pytest.raises(ValueError, match="fabric must be"):
        FabricGuard(object(), model, optimizer)
    with pytest.raises(ValueError, match="mean must be"):
        FabricGuard(fabric, model, optimizer, mean="yes")
    with pytest.raises(ValueError, match="unknown Guard option"):
        FabricGuard(fabric, model, optimizer, max_skips=3)


@pytest.mark.dist
@pytest.mark.parametrize("bad_rank", [1, 0])
def test_fabric_ddp_two_cpu_ranks_fault_on_one_rank(tmp_path: Path, bad_rank: int) -> None:
    script = Path(__file__).with_name("_fabric_ddp_script.py")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(bad_rank)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, rep in enumerate(reports):
        assert rep["rank"] == rank and rep["world_size"] == 2
        # Both ranks skipped the one bad step; the replay, communication off, pinned it on bad_rank's forward.
        assert rep["skipped"] == 1 and rep["adam_steps"] == rep["steps"] - 1, rep
        assert (rep["cause"], rep["op"], rep["module"]) == ("op.log_domain", "aten.log.default", "block.act"), rep
        assert (rep["diag_rank"], rep["diag_ranks"], rep["diag_step"]) == (bad_rank, [bad_rank], 1), rep
        assert rep["finite"]
    assert reports[0]["fingerprint"] == reports[1]["fingerprint"]


def test_the_litgpt_style_example_runs_and_names_the_planted_fault(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    try:
        import fabric_pretrain
    finally:
        sys.path.pop(0)
    guard = fabric_pretrain.train(_fabric(), 6, bad_step=3, run_dir=str(tmp_path))
    diag = guard.last_diagnosis
    assert guard.skipped == 1 and guard.guard is not None and guard.guard.step_count == 6
    assert (diag.cause, diag.module, diag.step) == ("data.nonfinite", "vis_proj", 3)
    assert diag.evidence["origin"]["path"] == "batch[1]['pixel_values']"


def test_missing_lightning_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    for name in ("lightning", "lightning.fabric"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "nanguard.integrations.fabric")
    with pytest.raises(ImportError, match=r"needs Lightning Fabric.*pip install nanguard\[lightning\]"):
        importlib.import_module("nanguard.integrations.fabric")
