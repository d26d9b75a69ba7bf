"""LoopGuard on loops written as llm.c's and nanoGPT's train scripts are: the loop fetches its own
micro-batches, toggles DDP's gradient sync, all-reduces its loss, clips and sets the LR itself;
guarding it is two added lines."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as tdist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import nanguard as ng
from nanguard.integrations.loop import LoopGuard
from nanguard.zoo import GPT, GPTConfig, synthetic_batch
from nanguard.zoo.spawn import spawn_ranks

ACCUM = 2
STEPS = 4
CONFIG = GPTConfig(vision_dim=16, n_embd=32, block_size=16)


class Loader:
    """llm.c's ``DataLoaderLite``: ``next_batch()`` hands out the next batch; one planted NaN image."""

    def __init__(self, rank: int = 0, bad: int | None = None) -> None:
        self.gen = torch.Generator().manual_seed(rank)
        self.calls, self.bad = 0, bad

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b = synthetic_batch(CONFIG, self.gen, batch_size=4)
        if self.calls == self.bad:
            b["pixel_values"][0, 0, 0] = float("nan")
        self.calls += 1
        return b["input_ids"], b["labels"], b["pixel_values"]


def _llmc_loop(model, raw, optimizer, loader, *, ddp: bool = False, guard: LoopGuard | None = None) -> list:
    """llm.c's ``train_gpt2.py`` training section, as written there (logged lines returned)."""
    logged = []
    for step in range(STEPS):
        model.train()
        optimizer.zero_grad(set_to_none=True)
        lossf = torch.zeros(())
        for micro_step in range(ACCUM):
            x, y, pixels = loader.next_batch()
            if ddp:
                model.require_backward_grad_sync = micro_step == ACCUM - 1
            _, loss = model(x, labels=y, pixel_values=pixels)
            loss = loss / ACCUM
            lossf += loss.detach()
            loss.backward()
        if ddp:
            tdist.all_reduce(lossf, op=tdist.ReduceOp.AVG)
        norm = torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
        lr = 1e-3 * (step + 1) / STEPS
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        logged.append((float(lossf), float(norm), guard.last_grad_norm if guard is not None else None))
    return logged


def _setup():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_a_healthy_llmc_loop_is_bit_identical_and_logs_the_guards_norm(tmp_path) -> None:
    plain, opt = _setup()
    expected = _llmc_loop(plain, plain, opt, Loader())
    model, opt = _setup()
    with LoopGuard(model, opt, policy="raise", run_dir=tmp_path) as guard:  # the one added line (and the import)
        logged = _llmc_loop(model, model, opt, Loader(), guard=guard)
    assert guard.skipped == 0 and guard.guard is not None and guard.guard.step_count == STEPS
    for a, b in zip(plain.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert [(loss, norm) for loss, norm, _ in logged] == [(loss, norm) for loss, norm, _ in expected]
    # The norm the loop logs, measured by the guard before the loop's clip.
    assert [g for _, _, g in logged] == pytest.approx([n for _, n, _ in logged], rel=1e-5)


def test_a_nan_micro_batch_in_an_llmc_loop_is_skipped_and_its_input_named() -> None:
    model, opt = _setup()
    bad = 1 * ACCUM + 1  # step 1, micro-batch 1
    with LoopGuard(model, opt) as guard:
        logged = _llmc_loop(model, model, opt, Loader(bad=bad), guard=guard)
    diag = guard.last_diagnosis
    assert guard.skipped == 1 and guard.trips == 1 and diag is not None
    assert (diag.cause, diag.module, diag.phase, diag.step) == ("data.nonfinite", "vis_proj", "data", 1)
    assert diag.evidence["origin"]["path"] == "batch[1]['pixel_values']"
    assert math.isnan(logged[1][2]) and not math.isnan(logged[2][2])
    assert int(opt.state[model.wte.weight]["step"]) == STEPS - 1
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_a_nanogpt_loop_under_autocast_replays_in_the_precision_it_ran_in() -> None:
    model, opt = _setup()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16)
    guard = LoopGuard(model, opt)
    seen = []
    model.vis_proj.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    loader = Loader(bad=ACCUM)  # step 1, micro-batch 0
    x, y, pixels = loader.next_batch()  # nanoGPT fetches the very first batch before the loop
    for _ in range(STEPS):
        for _ in range(ACCUM):
            with ctx:
                _, loss = model(x, labels=y, pixel_values=pixels)
                loss = loss / ACCUM
            x, y, pixels = loader.next_batch()  # prefetched while the forward runs
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    guard.close()
    diag = guard.last_diagnosis
    assert guard.skipped == 1 and (diag.cause, diag.module, diag.step) == ("data.nonfinite", "vis_proj", 1)
    assert set(seen) == {torch.bfloat16}  # the replays' forwards too


def test_a_loss_outside_the_model_goes_through_micro_step() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    guard = LoopGuard(net, opt)

    @guard.micro_step
    def loss_of(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(net(x), target.sqrt())  # sqrt of a negative target: NaN made outside the model

    for step in range(3):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
        target = torch.full((4, 1), -1.0 if step == 1 else 1.0)
        loss_of(x, target).backward()
        opt.step()
        opt.zero_grad()
    guard.close()
    diag = guard.last_diagnosis
    assert guard.skipped == 1 and (diag.cause, diag.op, diag.step) == ("op.sqrt_domain", "aten.sqrt.default", 1)


def test_wrong_arguments_and_a_closure_are_refused() -> None:
    model, opt = _setup()
    with pytest.raises(ValueError, match="model must be"):
        LoopGuard(object(), opt)
    with pytest.raises(ValueError, match="optimizer must be"):
        LoopGuard(model, object())
    with pytest.raises(ValueError, match="mean must be"):
        LoopGuard(model, opt, mean=1)
    with LoopGuard(model, opt) as guard, pytest.raises(ValueError, match="without a closure"):
        opt.step(lambda: 0.0)
    assert "step" not in vars(opt) and guard.guard is not None


def _ddp_llmc(rank: int, world: int, bad_rank: int) -> dict:
    raw, opt = _setup()
    model = DDP(raw)
    guard = LoopGuard(model, opt)
    logged = _llmc_loop(
        model, raw, opt, Loader(rank, bad=ACCUM + 1 if rank == bad_rank else None), ddp=True, guard=guard
    )
    guard.close()
    flat = torch.cat([p.detach().reshape(-1) for p in raw.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    tdist.all_gather(gathered, flat)
    d = guard.last_diagnosis
    return {
        "skipped": guard.skipped,
        "losses": [loss for loss, _, _ in logged],
        "equal": all(torch.equal(g, gathered[0]) for g in gathered),
        "diag": None if d is None else [d.cause, d.module, d.rank, d.ranks, d.step],
    }


@pytest.mark.dist
@pytest.mark.parametrize("bad_rank", [1, 0])
def test_an_llmc_ddp_loop_skips_on_every_rank_and_names_the_rank(bad_rank: int) -> None:
    results = spawn_ranks(_ddp_llmc, bad_rank, timeout=180)
    for r in results:
        assert r["skipped"] == 1 and r["equal"], r
        assert r["diag"] == ["data.nonfinite", "vis_proj", bad_rank, [bad_rank], 1], r
    # The loop's own loss all-reduce ran every step on both ranks: the same averaged values.
    assert results[0]["losses"] == results[1]["losses"] and math.isnan(results[0]["losses"][1])
    assert all(math.isfinite(v) for i, v in enumerate(results[0]["losses"]) if i != 1)


def test_guard_last_grad_norm_is_the_norm_before_the_guards_clip() -> None:
    model, opt = _setup()
    guard = ng.Guard(model, opt, clip_grad_norm=0.01)  # the clip moved into the guard: the loop has no norm of its own
    loader = Loader(bad=ACCUM)  # step 1, micro-batch 0
    assert guard.last_grad_norm is None
    norms = []
    for _ in range(3):
        micro = [loader.next_batch() for _ in range(ACCUM)]
        grads_before: list[torch.Tensor] = []
        hook = opt.register_step_pre_hook(
            lambda *_, seen=grads_before: seen.extend(p.grad.clone() for p in model.parameters())
        )
        guard.step_accumulated(micro, lambda b: model(b[0], labels=b[1], pixel_values=b[2])[1])
        hook.remove()
        norms.append(guard.last_grad_norm)
        if grads_before:  # the step was taken: its gradients were clipped to 0.01 first
            clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads_before]))
            assert float(clipped) == pytest.approx(0.01, rel=1e-4) and norms[-1] > 0.1
    assert guard.skipped == 1 and math.isnan(norms[1])
    assert norms[2] == guard.history.points[-1].grad_norm


def _scheduled_loop(
    guard_it: bool, bad: int | None, steps: int
) -> tuple[torch.optim.lr_scheduler.LRScheduler, torch.optim.Optimizer, LoopGuard | None]:
    """A loop that steps an ``ExponentialLR`` after each ``optimizer.step()``, as torch's docs write it;
    ``bad``: the iteration whose input holds a NaN."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    options = {"snapshot_every": 2, "rollback_skip_batches": 0}
    guard = LoopGuard(model, opt, policy="rollback", scheduler=sched, **options) if guard_it else None
    for i in range(steps):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
        if i == bad:
            x[0, 0] = float("nan")
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()
        sched.step()
    return sched, opt, guard


def test_a_rollback_restores_the_scheduler_as_the_restored_step_left_it() -> None:
    """The snapshot after the second update (iteration 1) holds the state the next update starts from:
    iteration 1's ``scheduler.step()`` included. After the rollback the LR is the one an unguarded run has
    after iteration 1, not one step behind."""
    sched, opt, guard = _scheduled_loop(True, bad=3, steps=4)
    twin, twin_opt, _ = _scheduled_loop(False, bad=None, steps=2)
    assert guard is not None and guard.guard is not None and guard.guard.last_action == "rollback"
    assert sched.last_epoch == twin.last_epoch == 2
    assert opt.param_groups[0]["lr"] == twin_opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)
    guard.close()
