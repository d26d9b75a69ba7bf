"""Guard in loops written with Hugging Face Accelerate: prepare, backward, accumulate, mixed precision."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nanguard as ng

GA, STEPS, BAD_STEP = 2, 4, 2


def _fresh_accelerator(**kwargs) -> Accelerator:
    # Accelerate keeps its state in process-wide singletons: each run starts from a clean one.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(gradient_accumulation_steps=GA, **kwargs)


def _parts(accelerator: Accelerator, scaler: torch.amp.GradScaler | None, bad: bool):
    """A prepared model, optimizer and loader; ``scaler`` stands in for the CUDA float16 scaler
    accelerate builds itself, on a machine without CUDA."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    x, y = torch.randn(STEPS * GA * 4, 8), torch.randn(STEPS * GA * 4, 1)
    if bad:
        x[BAD_STEP * GA * 4 + 1, 3] = float("nan")  # micro-batch 0 of BAD_STEP
    if scaler is not None:
        accelerator.scaler = scaler
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    return accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9), loader)


def _unguarded(accelerator: Accelerator, scaler=None) -> nn.Module:
    """Accelerate's own loop, skipping BAD_STEP's micro-batches (as a skip would)."""
    model, optimizer, loader = _parts(accelerator, scaler, bad=True)
    for i, (x, y) in enumerate(loader):
        if i // GA == BAD_STEP:
            continue
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x).float(), y))
            optimizer.step()
            optimizer.zero_grad()
    return model


def _guarded(accelerator: Accelerator, scaler=None, unscale: bool = False) -> tuple[nn.Module, ng.Guard]:
    """The README's recipe; ``unscale`` unscales in the closure as ``accelerator.clip_grad_norm_`` does."""
    model, optimizer, loader = _parts(accelerator, scaler, bad=True)
    guard = ng.Guard(model, optimizer)
    for micro in zip(*[iter(loader)] * GA, strict=False):  # the README's recipe

        def closure(micro=micro) -> torch.Tensor:
            optimizer.zero_grad()
            total = 0.0
            for x, y in micro:
                with accelerator.accumulate(model):
                    loss = nn.functional.mse_loss(model(x).float(), y)
                    accelerator.backward(loss)
                total += loss.detach() / len(micro)
            if unscale:
                accelerator.scaler.unscale_(optimizer.optimizer)
            return total

        guard.step(closure, batch=list(micro))
    guard.close()
    return model, guard


def _check(guarded: nn.Module, guard: ng.Guard, unguarded: nn.Module) -> None:
    assert guard.step_count == STEPS and guard.skipped == 1
    diag = guard.last_diagnosis
    assert (diag.cause, diag.step, diag.evidence["origin"]["path"]) == ("data.nonfinite", BAD_STEP, "batch[0][0]")
    for p, q in zip(guarded.parameters(), unguarded.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_an_accelerate_loop_skips_a_fault_and_otherwise_matches_accelerates_own_loop(mixed_precision) -> None:
    reference = _unguarded(_fresh_accelerator(cpu=True, mixed_precision=mixed_precision))
    model, guard = _guarded(_fresh_accelerator(cpu=True, mixed_precision=mixed_precision))
    assert guard.scaler is None
    _check(model, guard, reference)


@pytest.mark.parametrize("unscale", [False, True])
def test_accelerates_grad_scaler_is_found_and_unscales_once(unscale) -> None:
    def scaler() -> torch.amp.GradScaler:
        return torch.amp.GradScaler("cpu", init_scale=2.0**10)

    ref_scaler, guard_scaler = scaler(), scaler()
    reference = _unguarded(_fresh_accelerator(cpu=True), ref_scaler)
    model, guard = _guarded(_fresh_accelerator(cpu=True), guard_scaler, unscale=unscale)
    assert guard.scaler is guard_scaler  # found on the prepared optimizer, not passed in
    _check(model, guard, reference)  # unscaled twice, the updates would be 1024x too small


def test_another_scaler_than_accelerates_is_rejected() -> None:
    accelerator = _fresh_accelerator(cpu=True)
    model, optimizer, _ = _parts(accelerator, torch.amp.GradScaler("cpu"), bad=False)
    with pytest.raises(ValueError, match="scaler must be None or the GradScaler the optimizer already carries"):
        ng.Guard(model, optimizer, scaler=torch.amp.GradScaler("cpu"))
    assert ng.Guard(model, optimizer, scaler=accelerator.scaler).scaler is accelerator.scaler


@pytest.mark.skipif(not torch.cuda.is_available(), reason="accelerate's float16 GradScaler needs CUDA")
def test_float16_on_cuda_with_accelerates_own_scaler() -> None:
    reference = _unguarded(_fresh_accelerator(mixed_precision="fp16"))
    model, guard = _guarded(_fresh_accelerator(mixed_precision="fp16"))
    assert guard.scaler is not None
    _check(model, guard, reference)
