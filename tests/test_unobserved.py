"""No hardware blame without proof, in every entry point: a finite replay that could not run what was
trained says what it could not see (``unknown`` with ``evidence["unobserved"]``), never
``step.not_reproduced`` or advice to suspect the hardware. Each entry point is tried with a fault in code
its replay does not run: a norm penalty added outside what the replay computes (the gradient of a
hand-written ``sqrt(sum(w**2))`` at a zero-initialized adapter: NaN, its value finite), a callback that
writes into the gradients, a loss computed outside the model.
(The Hugging Face Trainer's own case, a ``training_step`` of the user's, is in test_integration_hf.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import nanguard as ng
from nanguard.guard.fidelity import loss_differs, watched

HARDWARE = {"step.not_reproduced", "distributed.transient", "hardware.faulty_device"}


class Adapted(nn.Module):
    """A regression net with a zero-initialized adapter (LoRA's B) on its output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.adapter = nn.Parameter(torch.zeros(1, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net[1](self.net[0](x))
        return self.net[2](h) + h @ self.adapter.t()


def penalty(model: Adapted) -> torch.Tensor:
    """Pull the adapter's norm towards 1, the norm written by hand: its gradient at zero is NaN."""
    return 0.1 * (model.adapter.pow(2).sum().sqrt() - 1) ** 2


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(4, 8, generator=gen)
    return x, x.sum(1, keepdim=True)


def _blind(diag: ng.Diagnosis | None, *seen: str) -> None:
    assert diag is not None and diag.cause == "unknown", diag
    gaps = " ".join(diag.evidence["unobserved"])
    assert all(s in gaps for s in seen), gaps
    assert not any("hardware" in fix or "drain" in fix for fix in diag.fixes)


@pytest.mark.parametrize("replay_runs", ["the model's loss only", "the forward only"])
def test_check_with_a_replay_that_is_not_the_step(tmp_path: Path, replay_runs: str) -> None:
    model = Adapted()
    guard = ng.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="skip", run_dir=tmp_path)
    x, y = _batch(0)
    loss = nn.functional.mse_loss(model(x), y) + penalty(model)
    loss.backward()

    def replay() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        out = nn.functional.mse_loss(model(x), y)
        if replay_runs == "the model's loss only":
            out.backward()
        return out

    assert not guard.check(loss, replay=replay, batch=(x, y))
    if replay_runs == "the model's loss only":
        _blind(guard.last_diagnosis, "the loss the step trained")
    else:
        _blind(guard.last_diagnosis, "the loss the step trained", "the gradients of 5 parameter(s)")
    guard.close()
    records = [json.loads(line) for line in (tmp_path / "hardware.jsonl").read_text().splitlines()]
    assert records and all(r["reproduced"] for r in records)  # never counted against the device


def test_a_faithful_check_replay_still_finds_the_penalty() -> None:
    """The control: the same fault, replayed with the penalty, is named where it is made."""
    model = Adapted()
    guard = ng.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="skip")
    x, y = _batch(0)

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y) + penalty(model)
        loss.backward()
        return loss

    assert not guard.check(step(), replay=step, batch=(x, y))
    diag = guard.last_diagnosis
    assert diag is not None and (diag.cause, diag.phase) == ("op.sqrt_domain", "backward")


def test_loopguard_with_the_loss_outside_the_model_and_no_micro_step() -> None:
    from nanguard.integrations.loop import LoopGuard

    model = Adapted()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with LoopGuard(model, optimizer, policy="skip") as guard:
        for step in range(2):
            x, y = _batch(step)
            loss = nn.functional.mse_loss(model(x), y) + (penalty(model) if step == 0 else 0.0)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert guard.skipped == 1
    _blind(guard.last_diagnosis, "the loss and the backward", "the gradients of")


def test_fabric_given_more_than_the_recorded_loss() -> None:
    pytest.importorskip("lightning")
    import lightning as L

    from nanguard.integrations.fabric import FabricGuard

    class WithLoss(Adapted):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return nn.functional.mse_loss(super().forward(x), y)

    fabric = L.Fabric(accelerator="cpu", devices=1)
    plain = WithLoss()
    model, optimizer = fabric.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    with FabricGuard(fabric, model, optimizer, policy="skip") as guard:
        for step in range(2):
            x, y = _batch(step)
            loss = model(x, y)  # recorded: the model's loss
            fabric.backward(loss + penalty(plain) if step == 0 else loss)  # the penalty, outside it
            optimizer.step()
            optimizer.zero_grad()
    assert guard.skipped == 1
    _blind(guard.last_diagnosis, "what fabric.backward was given")


def test_lightning_with_a_callback_writing_into_the_gradients(tmp_path: Path) -> None:
    L = pytest.importorskip("lightning")
    from torch.utils.data import DataLoader, TensorDataset

    from nanguard.integrations.lightning import NanGuard

    class Net(L.LightningModule):
        def __init__(self, own_hook: bool) -> None:
            super().__init__()
            self.model = Adapted()
            self.own_hook = own_hook

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.model(x), y)

        def on_after_backward(self) -> None:
            if self.own_hook and self.trainer.global_step == 1:
                self.model.adapter.grad.div_(self.model.adapter.grad.sum() * 0)  # 0/0 on purpose

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class GradNoise(L.Callback):
        def on_after_backward(self, trainer, pl_module):
            if trainer.global_step == 1:
                pl_module.model.adapter.grad.fill_(float("nan"))

    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)

    def fit(own_hook: bool, callbacks: list) -> NanGuard:
        guard_cb = NanGuard(policy="skip")
        trainer = L.Trainer(
            default_root_dir=tmp_path,
            max_epochs=1,
            callbacks=[guard_cb, *callbacks],
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Net(own_hook), loader)
        return guard_cb

    blind = fit(False, [GradNoise()])
    assert blind.skipped == 1
    _blind(blind.last_diagnosis, "GradNoise's on_after_backward")
    # The module's own on_after_backward is part of the step the replay runs: named where it divides.
    seen = fit(True, [])
    assert seen.skipped == 1 and seen.last_diagnosis is not None
    assert seen.last_diagnosis.cause not in HARDWARE | {"unknown"}
    assert seen.last_diagnosis.op == "aten.div_.Tensor"


def test_the_fidelity_checks_say_what_differs() -> None:
    from nanguard import dist

    with dist.observing() as gaps:
        assert loss_differs(torch.tensor(2.0), torch.tensor(1.0), " (micro-batch 1)")
        assert not loss_differs(torch.tensor(2.0), torch.tensor(2.0 + 1e-7))
        assert not loss_differs(torch.tensor(float("nan")), torch.tensor(1.0))  # the question a replay answers
        assert not loss_differs(None, torch.tensor(1.0))
    assert gaps == ["the loss the step trained (micro-batch 1) (2; the replay computes 1)"]

    model = Adapted()
    model(torch.randn(2, 8)).sum().backward()
    with dist.observing() as gaps:
        watched(lambda: model.zero_grad(set_to_none=True), model, None)()
    assert gaps == ["the gradients of 5 parameter(s) the step trained (adapter, net.0.weight, net.0.bias and 2 more)"]
