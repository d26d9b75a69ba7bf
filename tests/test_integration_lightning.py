"""The Lightning callback on real Lightning: skip, raise, accumulation, and 2-process DDP."""

from __future__ import annotations

import csv
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import nanguard as ng
from nanguard.integrations.lightning import NanGuard

BATCH = 4
STEPS = 8
BAD = 3


class Regression(Dataset):
    """x -> sum(x); the first sample of batch ``bad`` holds a NaN."""

    def __init__(self, bad: int | None = BAD) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(BATCH * STEPS, 8, generator=gen)
        self.y = self.x.sum(1, keepdim=True)
        if bad is not None:
            self.x[BATCH * bad, 3] = float("nan")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Snapshots(L.Callback):
    """The module's state dict before and after each training batch."""

    def __init__(self) -> None:
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.before[batch_idx] = {k: v.clone() for k, v in pl_module.state_dict().items()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.after[batch_idx] = {k: v.clone() for k, v in pl_module.state_dict().items()}


def _trainer(tmp_path: Path, callbacks: list[L.Callback], **kwargs) -> L.Trainer:
    kwargs.setdefault("logger", False)
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        callbacks=callbacks,
        default_root_dir=tmp_path,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _params_finite(module: nn.Module) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in module.state_dict().values() if t.is_floating_point())


def test_nan_batch_is_skipped_diagnosed_and_logged(tmp_path: Path) -> None:
    model = Net()
    guard_cb, snaps = NanGuard(policy="skip", run_dir=tmp_path / "run"), Snapshots()
    logger = L.pytorch.loggers.CSVLogger(tmp_path, name="csv")
    trainer = _trainer(tmp_path, [guard_cb, snaps], logger=logger)
    trainer.fit(model, DataLoader(Regression(), batch_size=BATCH))

    assert trainer.state.finished and trainer.global_step == STEPS
    assert guard_cb.skipped == 1 and guard_cb.trips == 1
    diag = guard_cb.last_diagnosis
    assert diag is not None
    assert (diag.cause, diag.phase, diag.module, diag.step) == ("data.nonfinite", "data", "net.0", BAD)
    assert diag.evidence["origin"]["path"] == "batch[0]"
    assert _params_finite(model)
    # The skipped step changed nothing: weights and BatchNorm running stats are as before it.
    for key, value in snaps.before[BAD].items():
        assert torch.equal(snaps.after[BAD][key], value), key
    assert not torch.equal(snaps.after[BAD + 1]["net.0.weight"], snaps.before[BAD + 1]["net.0.weight"])
    state = trainer.optimizers[0].state[model.net[0].weight]
    assert int(state["step"]) == STEPS - 1

    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("nanguard/skipped")]
    assert [(int(r["step"]), float(r["nanguard/skipped"]), float(r["nanguard/trips"])) for r in rows] == [
        (BAD, 1.0, 1.0)
    ]
    events = (tmp_path / "run" / "events-rank0.jsonl").read_text()
    assert '"trip"' in events and "data.nonfinite" in events


class ScheduledNet(Net):
    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_skip_holds_the_lr_schedule_and_counters_reach_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    guard_cb = NanGuard(policy="skip")
    logger = L.pytorch.loggers.TensorBoardLogger(tmp_path, name="tb")
    trainer = _trainer(tmp_path, [guard_cb], logger=logger, log_every_n_steps=1)
    trainer.fit(ScheduledNet(), DataLoader(Regression(), batch_size=BATCH))

    assert guard_cb.skipped == 1
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == STEPS - 1  # the skipped step did not advance the schedule
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.9 ** (STEPS - 1))
    assert (Path(logger.log_dir) / "nanguard" / "events-rank0.jsonl").exists()  # run_dir under the log dir

    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    skipped = [(e.step, e.value) for e in acc.Scalars("nanguard/skipped")]
    trips = [(e.step, e.value) for e in acc.Scalars("nanguard/trips")]
    assert skipped == [(BAD, 1.0)] and trips == [(BAD, 1.0)]


def test_raise_policy_stops_fit_before_the_bad_update(tmp_path: Path) -> None:
    model = Net()
    snaps = Snapshots()
    trainer = _trainer(tmp_path, [NanGuard(policy="raise"), snaps])
    with pytest.raises(ng.NonFiniteError) as info:
        trainer.fit(model, DataLoader(Regression(), batch_size=BATCH))
    assert info.value.diagnosis.cause == "data.nonfinite"
    assert info.value.diagnosis.step == BAD
    assert _params_finite(model)
    assert torch.equal(model.net[0].weight, snaps.before[BAD]["net.0.weight"])


def test_rollback_restores_the_snapshot_and_drops_the_next_batch(tmp_path: Path) -> None:
    model = Net()
    guard_cb, snaps = NanGuard(policy="rollback", snapshot_every=2, rollback_skip_batches=1), Snapshots()
    trainer = _trainer(tmp_path, [guard_cb, snaps])
    trainer.fit(model, DataLoader(Regression(), batch_size=BATCH))
    guard = guard_cb.guard
    assert guard.rollbacks == 1 and guard_cb.trips == 1 and guard.step_count == STEPS
    # Snapshot after 2 good updates (batch 1); batch 2 updated, batch 3 tripped, batch 4 was dropped.
    for key, value in snaps.after[1].items():
        assert torch.equal(snaps.after[BAD + 1][key], value), key
    assert int(trainer.optimizers[0].state[model.net[0].weight]["step"]) == 2 + (STEPS - BAD - 2)
    assert _params_finite(model)


def test_gradient_accumulation_replays_every_micro_batch(tmp_path: Path) -> None:
    # Batch BAD (the 2nd micro-batch of optimizer step 1) holds the NaN.
    guard_cb = NanGuard(policy="skip")
    trainer = _trainer(tmp_path, [guard_cb], accumulate_grad_batches=2)
    trainer.fit(Net(), DataLoader(Regression(), batch_size=BATCH))
    assert trainer.global_step == STEPS // 2
    assert guard_cb.skipped == 1
    diag = guard_cb.last_diagnosis
    assert (diag.cause, diag.step) == ("data.nonfinite", BAD // 2)
    assert diag.evidence["origin"]["path"] == "batch[1][0]"


def test_a_clean_run_never_trips(tmp_path: Path) -> None:
    guard_cb = NanGuard(policy="raise")
    trainer = _trainer(tmp_path, [guard_cb])
    trainer.fit(Net(), DataLoader(Regression(bad=None), batch_size=BATCH))
    assert guard_cb.guard is not None and guard_cb.guard.step_count == STEPS
    assert guard_cb.skipped == 0 and guard_cb.last_diagnosis is None
    assert len(guard_cb.guard.history) == STEPS


def test_manual_optimization_and_bad_options_are_rejected(tmp_path: Path) -> None:
    class Manual(Net):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(ValueError, match="automatic optimization"):
        _trainer(tmp_path, [NanGuard()]).fit(Manual(), DataLoader(Regression(), batch_size=BATCH))
    with pytest.raises(ValueError, match="unknown Guard option"):
        NanGuard(max_skips=3)
    with pytest.raises(ValueError, match="policy"):
        NanGuard(policy="ignore")


def test_missing_lightning_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("lightning", "lightning.pytorch", "nanguard.integrations.lightning"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "nanguard.integrations.lightning")
    with pytest.raises(ImportError, match=r"pip install nanguard\[lightning\]"):
        importlib.import_module("nanguard.integrations.lightning")


@pytest.mark.dist
def test_ddp_two_cpu_ranks_fault_on_rank_1_only(tmp_path: Path) -> None:
    script = Path(__file__).with_name("_lightning_ddp_script.py")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, rep in enumerate(reports):
        assert rep["rank"] == rank and rep["world_size"] == 2
        assert rep["finished"] and rep["global_step"] == 5
        # Both ranks agreed to skip the one bad step, and the replay pinned it on rank 1's data.
        assert rep["skipped"] == 1 and rep["adam_steps"] == 4
        assert (rep["cause"], rep["diag_rank"], rep["diag_ranks"], rep["diag_step"]) == ("data.nonfinite", 1, [1], 2)
        assert rep["finite"]
    assert reports[0]["fingerprint"] == reports[1]["fingerprint"]
