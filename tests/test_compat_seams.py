"""The seams behind ``nanguard.compat`` that the integrations and the replay use: DDP's sync
attribute, and the Lightning, Fabric and transformers internals; each test fails loudly when
the installed package changes one."""

from __future__ import annotations

import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import lightning as L
import pytest
import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from nanguard import compat
from nanguard.zoo.spawn import spawn_ranks


def _pinned(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    ddp = DDP(model)
    x = torch.full((2, 4), float(rank + 1))
    with compat.ddp_sync_pinned_off(ddp):
        ddp.require_backward_grad_sync = True  # the loop's own write, as nanoGPT's
        read_inside = ddp.require_backward_grad_sync
        ddp(x).sum().backward()
    grad = model.weight.grad.clone()
    others = [torch.zeros_like(grad) for _ in range(world)]
    tdist.all_gather(others, grad)
    model.zero_grad()
    ddp(x).sum().backward()  # after the block: DDP all-reduces again
    return {
        "inside": read_inside,
        "after": ddp.require_backward_grad_sync,
        "type": type(ddp) is DDP,
        "local_grads_differ": not torch.equal(others[0], others[1]),
        "synced_grad": model.weight.grad[0, 0].item(),
    }


@pytest.mark.dist
def test_ddp_sync_pinned_off_keeps_the_backward_local_whatever_the_loop_sets() -> None:
    results = spawn_ranks(_pinned, timeout=120)
    for r in results:
        assert r["inside"] is False and r["after"] is True and r["type"], r
        assert r["local_grads_differ"], r
    assert results[0]["synced_grad"] == results[1]["synced_grad"] == pytest.approx(3.0)  # mean of 2*1 and 2*2


def test_lightning_step_context_is_the_precision_plugins_autocast(tmp_path: Path) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", default_root_dir=tmp_path, logger=False)
    assert not torch.is_autocast_enabled("cpu")
    with compat.lightning_step_context(trainer):
        assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")


def test_lightning_logging_off_shadows_log_for_the_block() -> None:
    class Module(L.LightningModule):
        pass

    module = Module()
    with compat.lightning_logging_off(module):
        assert module.log("x", 1.0) is None and module.log_dict({"x": 1.0}) is None
        assert "log" in vars(module)
    assert "log" not in vars(module) and module.log.__func__ is L.LightningModule.log


def test_fabric_modules_and_inner_optimizer() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1)
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, optimizer = fabric.setup(net, opt)
    assert compat.fabric_modules(model) == (net, net)
    assert compat.fabric_modules(net) == (net, net)
    assert compat.fabric_inner_optimizer(optimizer) is opt
    assert compat.fabric_inner_optimizer(opt) is opt


def test_hf_trainer_internals_are_where_the_callback_reads_them(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    seen: dict = {}

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen["trainer"] = compat.hf_trainer_of(self)

        def on_step_end(self, args, state, control, **kwargs):
            trainer = seen["trainer"]
            seen["loss_sum"] = compat.hf_loss_sum(trainer)
            seen["initial"] = compat.hf_initial_step(trainer)
            seen["callbacks"] = compat.hf_callbacks(trainer)

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8, bos_token_id=0, eos_token_id=0)
    data = [{"input_ids": torch.arange(8) % 32, "labels": torch.arange(8) % 32} for _ in range(4)]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    probe = Probe()
    trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=data, callbacks=[probe])
    trainer.train()
    assert seen["trainer"] is trainer
    assert isinstance(seen["loss_sum"], torch.Tensor) and seen["loss_sum"].numel() == 1
    assert seen["initial"] == 0
    assert any(c is probe for c in seen["callbacks"])
    compat.hf_set_initial_step(trainer, 3)
    assert compat.hf_initial_step(trainer) == 3
    assert compat.hf_trainer_of(probe) is None  # outside the Trainer's loop


def test_accelerates_optimizer_is_recognized_and_says_a_skip_through_step_was_skipped() -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(net, opt)
    assert compat.accelerate_optimizer(optimizer) and not compat.accelerate_optimizer(opt)
    assert optimizer.optimizer is opt
    with accelerator.accumulate(model):  # the first of 2 micro-batches: accelerate steps nothing
        assert not compat.accelerate_syncing(optimizer)
    with accelerator.accumulate(model):
        assert compat.accelerate_syncing(optimizer)
    compat.accelerate_set_skipped(optimizer, True)
    assert optimizer.step_was_skipped and accelerator.optimizer_step_was_skipped
    compat.accelerate_set_skipped(optimizer, False)
    assert not accelerator.optimizer_step_was_skipped
