"""Guard.step_accumulated: gradient accumulation as one guarded step (every micro-batch checked and replayed)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nanguard as ng
from nanguard.zoo.spawn import spawn_ranks

MICRO = 4


def _model(positive: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    if positive:  # every hidden unit sums its inputs: a large input overflows float16 in the first Linear
        with torch.no_grad():
            model[0].weight.abs_()
    return model


def _micro_batches(step: int, n: int = MICRO) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(step)
    return [{"x": torch.randn(4, 8, generator=gen), "y": torch.randn(4, 1, generator=gen)} for _ in range(n)]


def _loss(model: nn.Module, batch: dict[str, torch.Tensor], amp: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
        out = model(batch["x"])
    return nn.functional.mse_loss(out.float(), batch["y"])


def test_a_forward_overflow_in_micro_batch_0_of_4_is_found_under_a_gradscaler() -> None:
    model = _model(positive=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    guard = ng.Guard(model, opt, scaler=scaler)
    micro = _micro_batches(0)
    micro[0]["x"][1] = 6e4  # finite in float16 (max 65504); the first Linear's sums are not
    before = [p.detach().clone() for p in model.parameters()]

    assert guard.step_accumulated(micro, lambda b: _loss(model, b, amp=True)) is None
    assert guard.skipped == 1 and guard.overflows == 0
    diag = guard.last_diagnosis
    assert (diag.cause, diag.module, diag.phase, diag.step) == ("precision.overflow", "0", "forward", 0)
    assert diag.op.startswith(("aten.addmm", "aten.linear", "aten.mm")), diag.op
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))

    # The loop that checks only the last micro-batch's loss takes the same step for a scaler overflow.
    last_only = ng.Guard(model, opt, scaler=scaler)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        for batch in micro:
            loss = _loss(model, batch, amp=True) / MICRO
            scaler.scale(loss).backward()
        return loss

    last_only.step(closure)
    assert last_only.overflows == 1 and last_only.last_diagnosis is None


@pytest.mark.parametrize("amp", [False, True])
def test_a_healthy_run_is_bit_identical_to_a_hand_written_accumulation_loop(amp) -> None:
    steps = 3
    guarded, by_hand = _model(), _model()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (guarded, by_hand)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled=amp) for _ in range(2)]
    guard = ng.Guard(guarded, opts[0], scaler=scalers[0])
    opt, scaler = opts[1], scalers[1]
    for step in range(steps):
        micro = _micro_batches(step)
        summed = guard.step_accumulated(micro, lambda b: _loss(guarded, b, amp))
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for batch in micro:
            loss = _loss(by_hand, batch, amp) / MICRO
            scaler.scale(loss).backward()
            total += loss.item()
        scaler.step(opt)
        scaler.update()
        assert summed.item() == pytest.approx(total, rel=1e-6)
    assert guard.step_count == steps and guard.skipped == 0
    for p, q in zip(guarded.parameters(), by_hand.parameters(), strict=True):
        assert torch.equal(p, q)


def test_mean_false_sums_the_losses_as_they_are() -> None:
    model = _model()
    guard = ng.Guard(model, torch.optim.SGD(model.parameters(), lr=0.0))
    micro = _micro_batches(0, n=2)
    summed = guard.step_accumulated(micro, lambda b: _loss(model, b, False), mean=False)
    with torch.no_grad():
        expected = sum(_loss(model, b, False) for b in micro)
    assert summed.item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize(
    ("micro_batches", "loss_fn", "mean", "match"),
    [
        ([], lambda b: b, True, "micro_batches must hold at least one"),
        (torch.zeros(3), lambda b: b, True, "micro_batches must be a list"),
        ([1], "loss", True, "loss_fn must be callable"),
        ([1], lambda b: b, 1, "mean must be True"),
    ],
)
def test_bad_arguments_are_rejected(micro_batches, loss_fn, mean, match) -> None:
    model = _model()
    guard = ng.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=match):
        guard.step_accumulated(micro_batches, loss_fn, mean=mean)


def _ddp_accumulation(rank: int, world: int, bad_step: int) -> dict:
    """Each rank trains the guarded DDP model and a hand-written DDP accumulation loop side by side;
    rank 1's micro-batch 0 of ``bad_step`` holds a NaN."""
    guarded, by_hand = DDP(_model()), DDP(_model())
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (guarded, by_hand)]
    guard = ng.Guard(guarded, opts[0])
    synced: list[bool] = []

    def loss_fn(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        synced.append(guarded.require_backward_grad_sync)
        return _loss(guarded, batch, amp=False)

    for step in range(4):
        micro = _micro_batches(10 * step + rank)
        if step == bad_step and rank == 1:
            micro[0]["x"][0, 0] = float("nan")
        guard.step_accumulated(micro, loss_fn)
        if step == bad_step:
            continue  # the hand-written loop never sees the bad step
        opts[1].zero_grad(set_to_none=True)
        for i, batch in enumerate(micro):
            ctx = by_hand.no_sync() if i < MICRO - 1 else torch.enable_grad()
            with ctx:
                (_loss(by_hand, batch, amp=False) / MICRO).backward()
        opts[1].step()
    flat = torch.cat([p.detach().reshape(-1) for p in guarded.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    tdist.all_gather(gathered, flat)
    diag = guard.last_diagnosis
    pairs = zip(guarded.parameters(), by_hand.parameters(), strict=True)
    return {
        "synced": synced[:MICRO],
        "same_as_by_hand": all(torch.equal(p, q) for p, q in pairs),
        "equal_across_ranks": all(torch.equal(g, gathered[0]) for g in gathered),
        "skipped": guard.skipped,
        "diag": (diag.cause, diag.rank, diag.step, diag.evidence["origin"]["path"]) if diag else None,
    }


@pytest.mark.dist
def test_ddp_accumulation_syncs_on_the_last_micro_batch_and_matches_the_hand_written_loop() -> None:
    for r in spawn_ranks(_ddp_accumulation, 2, timeout=120.0):
        assert r["synced"] == [False] * (MICRO - 1) + [True]
        assert r["same_as_by_hand"] and r["equal_across_ranks"]
        assert r["skipped"] == 1
        assert r["diag"] == ["data.nonfinite", 1, 2, "batch[0]['x']"]
