"""Guard in real training loops: clipping after the check, a GradScaler unscaled once, nanoGPT's loop."""

import sys
from pathlib import Path

import pytest
import torch

import nanguard as ng

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from nanogpt_guarded import train


def _regression() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    x = torch.randn(16, 8) * 10
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), x, x.sum(1, keepdim=True)


def test_clip_grad_norm_clips_after_the_check_and_the_history_keeps_the_raw_norm() -> None:
    model, optimizer, x, y = _regression()
    guard = ng.Guard(model, optimizer, clip_grad_norm=0.5)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    guard.step(closure)
    raw = guard.history.tail()["grad_norm_tail"][-1]
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
    assert raw > 50 and clipped == pytest.approx(0.5, rel=1e-3)


@pytest.mark.parametrize("value", [0, -1.0, "1", True])
def test_clip_grad_norm_rejects_bad_values(value) -> None:
    model, optimizer, _, _ = _regression()
    with pytest.raises(ValueError, match="clip_grad_norm must be None or a number > 0"):
        ng.Guard(model, optimizer, clip_grad_norm=value)


def test_a_loop_that_unscaled_already_is_not_unscaled_twice() -> None:
    model, optimizer, x, y = _regression()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    guard = ng.Guard(model, optimizer, scaler=scaler)
    before = model.weight.detach().clone()

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # the user's own unscale, e.g. to clip
        return loss

    assert guard.step(closure) is not None and guard.last_action == "step"
    assert guard.history.tail()["grad_norm_tail"][-1] < 1e4  # measured unscaled: the scale (16) is not in it
    assert not torch.equal(model.weight, before)


def test_nanogpt_loop_with_accumulation_scaler_clipping_and_compile_catches_micro_batch_0() -> None:
    guard = train(3, bad_step=1, accumulation=2, compile_backend="eager")
    assert guard.skipped == 1 and guard.step_count == 3
    diag = guard.last_diagnosis
    assert (diag.cause, diag.step) == ("data.nonfinite", 1)
    assert diag.evidence["origin"]["path"] == "batch[0]['pixel_values']"  # the first micro-batch, not the last


def test_on_event_sends_scalars_and_trips_to_a_real_summary_writer(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from nanguard.integrations.scalars import to_tensorboard

    model, optimizer, x, y = _regression()
    writers = {"plain": SummaryWriter(str(tmp_path / "plain")), "curves": SummaryWriter(str(tmp_path / "curves"))}
    plain, curves = to_tensorboard(writers["plain"]), to_tensorboard(writers["curves"], curves=True)
    guard = ng.Guard(model, optimizer, on_event=lambda e: (plain(e), curves(e)))
    for step in range(4):
        bad = x.clone()
        if step == 2:
            bad[0, 0] = float("nan")

        def closure(bad=bad) -> torch.Tensor:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(bad), y)
            loss.backward()
            return loss

        guard.step(closure)
    guard.close()
    for writer in writers.values():
        writer.close()
    acc = {}
    for name in writers:
        acc[name] = EventAccumulator(str(tmp_path / name), size_guidance={"scalars": 0, "tensors": 0})
        acc[name].Reload()
    # The loss and grad norm are the loop's own curves: only with curves=True.
    assert "nanguard/loss" not in acc["plain"].Tags()["scalars"]
    assert [e.step for e in acc["curves"].Scalars("nanguard/loss")] == [0, 1, 3]
    # Trips and skips: a step function from a zero baseline, one value at least per step.
    for tag in ("nanguard/trips", "nanguard/skips"):
        series = {e.step: e.value for e in acc["plain"].Scalars(tag)}
        assert series == {0: 0.0, 1: 0.0, 2: 1.0, 3: 1.0}, tag
    assert "nanguard/rollbacks" not in acc["plain"].Tags()["scalars"]
    assert [e.step for e in acc["plain"].Tensors("nanguard/cause/text_summary")] == [2]


def test_a_failing_on_event_warns_once_and_training_goes_on() -> None:
    model, optimizer, x, y = _regression()

    def broken(event):
        raise KeyError("oops")

    with pytest.warns(UserWarning, match="on_event failed on a start event"):
        guard = ng.Guard(model, optimizer, on_event=broken)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    assert guard.step(closure) is not None and guard.step(closure) is not None and guard.step_count == 2


def test_on_event_must_be_callable() -> None:
    model, optimizer, _, _ = _regression()
    with pytest.raises(ValueError, match="on_event must be None or a callable"):
        ng.Guard(model, optimizer, on_event="tensorboard")


def test_a_closure_that_unscales_itself_is_still_diagnosed_on_a_trip() -> None:
    model, optimizer, x, y = _regression()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    guard = ng.Guard(model, optimizer, scaler=scaler)
    bad = x.clone()
    bad[3, 2] = float("nan")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(bad), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # to clip: the replay runs this again
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return loss

    assert guard.step(closure, batch={"x": bad}) is None
    diag = guard.last_diagnosis
    assert (diag.cause, diag.evidence["origin"]["path"]) == ("data.nonfinite", "batch['x']")
