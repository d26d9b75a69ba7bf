"""``LoopGuard`` on the loop of transformers' ``run_clm_no_trainer.py``, with what ``accelerator.prepare``
returns (the model, ``AcceleratedOptimizer``, ``AcceleratedScheduler``, the loader): gradient accumulation,
``accelerator.backward``, the clip on ``sync_gradients``, ``optimizer.step()``, ``lr_scheduler.step()``; one
process and 2 gloo ranks through accelerate's own MULTI_CPU setup."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as tdist
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch.nn import functional as F
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler

import nanguard as ng
from nanguard.integrations.loop import LoopGuard
from nanguard.rng import get_rng_state
from nanguard.zoo.spawn import spawn_ranks

GA, STEPS, BATCH, T, E, V = 2, 4, 2, 8, 16, 32
BAD_STEP = 2


def _accelerator(**kwargs) -> Accelerator:
    # accelerate keeps its state in process-wide singletons: each run starts from a clean one.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(gradient_accumulation_steps=GA, cpu=True, **kwargs)


def _rows(world: int, *, nan_at: tuple[int, int] | None = None, zero_weight_at: tuple[int, int] | None = None):
    """The dataset: rows of float embeddings, labels and a loss weight. accelerate hands rank r the
    r-th batch of every ``world`` in a row; ``(step, rank)`` plants a fault in that rank's first
    micro-batch of that optimizer step."""
    g = torch.Generator().manual_seed(1)
    n = STEPS * GA * BATCH * world
    embeds, labels = torch.randn(n, T, E, generator=g), torch.randint(0, V, (n, T), generator=g)
    weight = torch.rand(n, generator=g) + 0.5
    for at, planted in ((nan_at, "nan"), (zero_weight_at, "zero")):
        if at is None:
            continue
        step, rank = at
        row = ((step * GA) * world + rank) * BATCH + 1  # the micro-batch's second row
        if planted == "nan":
            embeds[row, 3, 5] = float("nan")
        else:
            weight[row] = 0.0
    return [{"inputs_embeds": embeds[i], "labels": labels[i], "weight": weight[i]} for i in range(n)]


def _parts(accelerator: Accelerator, rows: list, dropout: float):
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=E, n_head=2, vocab_size=V, n_positions=T)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = dropout
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lr_scheduler = get_scheduler("linear", optimizer, num_warmup_steps=1, num_training_steps=STEPS)
    loader = DataLoader(rows, batch_size=BATCH)
    return accelerator.prepare(model, optimizer, loader, lr_scheduler)


def _weighted_loss(model, batch) -> torch.Tensor:
    """A per-sample weighted loss in log space (a reweighting scheme's ``log w``): a weight of 0 is log(0)."""
    logits = model(inputs_embeds=batch["inputs_embeds"]).logits
    nll = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none").view(BATCH, T).mean(1)
    return (nll * (1.0 - torch.log(batch["weight"]))).mean()


def _train(
    accelerator: Accelerator,
    rows: list,
    *,
    guarded: bool,
    leave_out: int | None = None,
    custom_loss=False,
    clip: bool = True,
    **kw,
):
    """``run_clm_no_trainer.py``'s loop; ``guarded`` adds the documented lines, ``leave_out`` drops
    that optimizer step's micro-batches (a run that never saw them); ``clip=False`` leaves out the clip."""
    model, optimizer, loader, lr_scheduler = _parts(accelerator, rows, kw.pop("dropout", 0.0))
    guard = LoopGuard(model, optimizer, scheduler=lr_scheduler, **kw) if guarded else None  # +1 line
    loss_of = custom_loss if callable(custom_loss) else _weighted_loss
    if custom_loss and guard is not None:
        loss_of = guard.micro_step(loss_of)  # a loss computed outside the model: +1 line
    skipped, lrs = [], []
    model.train()
    for step, batch in enumerate(loader):
        if leave_out is not None and step // GA == leave_out:
            continue
        with accelerator.accumulate(model):
            loss = (
                loss_of(model, batch)
                if custom_loss
                else model(**{k: batch[k] for k in ("inputs_embeds", "labels")}).loss
            )
            accelerator.backward(loss)
            if accelerator.sync_gradients and clip:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            skipped.append(accelerator.optimizer_step_was_skipped)
            lrs.append(lr_scheduler.get_last_lr()[0])
    if guard is not None:
        guard.close()
    weights = torch.cat([p.detach().reshape(-1) for p in accelerator.unwrap_model(model).parameters()])
    return weights, guard, skipped, lrs


def _diag(guard: LoopGuard | None) -> list | None:
    d = guard.last_diagnosis if guard is not None else None
    return None if d is None else [d.cause, d.op, d.phase, d.rank, d.step]


def test_a_healthy_accumulating_loop_is_bit_identical_guarded_and_unguarded() -> None:
    rows = _rows(1)
    plain, _, skipped, lrs = _train(_accelerator(), rows, guarded=False, dropout=0.1)
    rng = torch.get_rng_state()
    guarded, guard, g_skipped, g_lrs = _train(_accelerator(), rows, guarded=True, dropout=0.1)
    assert torch.equal(plain, guarded) and torch.equal(rng, torch.get_rng_state())
    assert (skipped, lrs) == (g_skipped, g_lrs) and not any(skipped)
    assert guard is not None and guard.guard is not None
    assert guard.guard.step_count == STEPS and guard.skipped == 0 and guard.last_grad_norm is not None
    assert "step" not in vars(guard.optimizer)  # close() gave accelerate its own step back


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_a_nan_batch_is_skipped_through_accelerates_optimizer(mixed_precision: str) -> None:
    rows = _rows(1, nan_at=(BAD_STEP, 0))
    reference, *_ = _train(_accelerator(mixed_precision=mixed_precision), rows, guarded=False, leave_out=BAD_STEP)
    weights, guard, skipped, lrs = _train(_accelerator(mixed_precision=mixed_precision), rows, guarded=True)
    assert guard is not None and guard.skipped == 1
    assert _diag(guard)[0::4] == ["data.nonfinite", BAD_STEP]
    assert guard.last_diagnosis.evidence["origin"]["path"].startswith("batch[0]['inputs_embeds']")
    # The skip was said through the wrapper: accelerate's scheduler held the LR, as for its scaler's skip.
    assert skipped == [i == BAD_STEP for i in range(STEPS)]
    assert lrs[BAD_STEP] == lrs[BAD_STEP - 1]
    assert torch.equal(weights, reference)


def test_a_loss_domain_bug_outside_the_model_is_named_at_its_op_in_the_loss() -> None:
    rows = _rows(1, zero_weight_at=(BAD_STEP, 0))
    reference, *_ = _train(_accelerator(), rows, guarded=False, leave_out=BAD_STEP, custom_loss=True)
    weights, guard, skipped, _ = _train(_accelerator(), rows, guarded=True, custom_loss=True)
    assert _diag(guard) == ["op.log_domain", "aten.log.default", "forward", None, BAD_STEP]
    assert guard.last_diagnosis.module is None  # the loss, outside any module
    assert skipped.count(True) == 1 and torch.equal(weights, reference)


def test_raise_and_rollback_through_accelerates_objects() -> None:
    rows = _rows(1, nan_at=(BAD_STEP, 0))
    with pytest.raises(ng.NonFiniteError, match=r"data\.nonfinite"):
        _train(_accelerator(), rows, guarded=True, policy="raise")
    _, guard, skipped, _ = _train(_accelerator(), rows, guarded=True, policy="rollback", snapshot_every=1)
    assert guard is not None and guard.guard.rollbacks == 1
    # The rollback's step and the batch dropped after it: neither stepped the optimizer, both said so.
    assert skipped == [False, False, True, True]


def _scaled(rows, init_scale=2.0**8, **kw):
    """accelerate builds its float16 GradScaler on CUDA only; a CPU GradScaler stands in, stepped by
    the wrapper as accelerate's own is (its ``step()`` steps and updates the scaler). No clip: accelerate
    unscales before its clip only under its own float16 mixed precision, so with a stand-in scaler its
    clip would clip the scaled gradients, which no real run does."""
    accelerator = _accelerator()
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, backoff_factor=1e-6)
    return _train(accelerator, rows, clip=False, **kw), accelerator.scaler


def _big(model, batch) -> torch.Tensor:
    return 1e3 * _weighted_loss(model, batch)


def test_accelerates_grad_scaler_skips_its_overflows_itself_guarded_as_unguarded() -> None:
    # A scale far too large for a loss 1000x: step 0's gradients overflow (x100 past float32's max),
    # and the scaler skips it itself; its scale x1e-6 then leaves a wide margin.
    (plain, _, plain_skipped, _), plain_scaler = _scaled(_rows(1), 3e38, guarded=False, custom_loss=_big)
    (guarded, guard, skipped, _), scaler = _scaled(_rows(1), 3e38, guarded=True, custom_loss=_big)
    assert plain_skipped == skipped == [True, False, False, False]
    assert torch.equal(plain, guarded) and plain_scaler.get_scale() == scaler.get_scale()
    assert guard.skipped == 0 and guard.guard.overflows == 1 and guard.last_diagnosis is None
    assert guard.guard.scaler is scaler


def test_accelerates_grad_scaler_a_fault_skipped_keeps_the_scale() -> None:
    bad = _rows(1, nan_at=(BAD_STEP, 0))
    (reference, *_), ref_scaler = _scaled(bad, guarded=False, leave_out=BAD_STEP)
    (weights, guard, skipped, _), scaler = _scaled(bad, guarded=True)
    assert _diag(guard)[0::4] == ["data.nonfinite", BAD_STEP] and guard.skipped == 1
    assert skipped == [i == BAD_STEP for i in range(STEPS)] and torch.equal(weights, reference)
    assert scaler.get_scale() == ref_scaler.get_scale()  # a bad batch is no overflow: the scale stays


def test_guard_check_takes_accelerates_optimizer_and_scheduler() -> None:
    """The closure-free ``check`` in an accumulating accelerate loop, ``scheduler=`` accelerate's."""
    rows = _rows(1, nan_at=(BAD_STEP, 0))
    reference, *_ = _train(_accelerator(), rows, guarded=False, leave_out=BAD_STEP)
    accelerator = _accelerator()
    model, optimizer, loader, lr_scheduler = _parts(accelerator, rows, 0.0)
    guard = ng.Guard(model, optimizer, scheduler=lr_scheduler)

    def forward(batch):
        return model(inputs_embeds=batch["inputs_embeds"], labels=batch["labels"]).loss

    def replay(micro: list) -> None:
        for batch in micro:
            (forward(batch) / GA).backward()

    total, micro, rng = 0.0, [], None
    for batch in loader:
        rng = get_rng_state() if not micro else rng
        micro.append(batch)
        with accelerator.accumulate(model):
            loss = forward(batch)
            accelerator.backward(loss)
            total = total + loss.detach() / GA
            if accelerator.sync_gradients:
                if guard.check(total, replay=lambda m=micro: replay(m), batch=micro, rng=rng):
                    optimizer.step()
                    lr_scheduler.step()
                    guard.after_step()
                optimizer.zero_grad()
                total, micro = 0.0, []
    guard.close()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    diag = guard.last_diagnosis
    assert guard.skipped == 1 and (diag.cause, diag.step) == ("data.nonfinite", BAD_STEP)
    assert diag.evidence["origin"]["path"].startswith("batch[0]['inputs_embeds']")
    assert torch.equal(weights, reference)


_FAULTS = {"nan0": (0, False), "nan1": (1, False), "log0": (0, True), "log1": (1, True)}


def _ranks(rank: int, world: int, runs: list[str]) -> dict:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    os.environ.update({"LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"})
    out: dict = {}

    def gathered(weights: torch.Tensor) -> bool:
        parts = [torch.zeros_like(weights) for _ in range(world)]
        tdist.all_gather(parts, weights)
        return all(torch.equal(p, parts[0]) for p in parts)

    if "healthy" in runs:
        healthy = _rows(world)
        plain, *_ = _train(_accelerator(), healthy, guarded=False, dropout=0.1)
        weights, guard, skipped, lrs = _train(_accelerator(), healthy, guarded=True, dropout=0.1)
        out["type"] = type(guard.model).__name__
        out["healthy"] = [torch.equal(plain, weights), guard.skipped, skipped.count(True), gathered(weights)]
    for name in runs:
        if name == "healthy":
            continue
        bad_rank, custom = _FAULTS[name]
        at = (BAD_STEP, bad_rank)
        rows = _rows(world, nan_at=None if custom else at, zero_weight_at=at if custom else None)
        reference, *_ = _train(_accelerator(), rows, guarded=False, leave_out=BAD_STEP, custom_loss=custom)
        weights, guard, skipped, lrs = _train(_accelerator(), rows, guarded=True, custom_loss=custom)
        same = torch.equal(weights, reference)
        out[name] = [_diag(guard), guard.skipped, skipped, same, gathered(weights), all(map(math.isfinite, lrs))]
    return out


def _check_ranks(results: list[dict], runs: list[str]) -> None:
    skipped = [i == BAD_STEP for i in range(STEPS)]
    for r in results:
        if "healthy" in runs:
            assert r["type"] == "DistributedDataParallel", r
            assert r["healthy"] == [True, 0, 0, True], r
        for name in runs:
            if name == "healthy":
                continue
            bad_rank, custom = _FAULTS[name]
            diag, n, steps, same, equal, lrs_finite = r[name]
            if custom:
                assert diag == ["op.log_domain", "aten.log.default", "forward", bad_rank, BAD_STEP], (name, r)
            else:
                assert diag[0] == "data.nonfinite" and diag[3:] == [bad_rank, BAD_STEP], (name, r)
            assert (n, steps, same, equal, lrs_finite) == (1, skipped, True, True, True), (name, r)


@pytest.mark.dist
def test_two_ranks_healthy_identical_a_nan_on_rank_0_and_a_loss_bug_on_rank_1_skipped_on_both() -> None:
    runs = ["healthy", "nan0", "log1"]
    _check_ranks(spawn_ranks(_ranks, runs, world=2, timeout=300), runs)


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_a_nan_on_rank_1_and_a_loss_bug_on_rank_0() -> None:
    runs = ["nan1", "log0"]
    _check_ranks(spawn_ranks(_ranks, runs, world=2, timeout=300), runs)


def test_auto_lowers_the_lr_inside_accelerates_scheduler() -> None:
    """``policy="auto"``'s lower_lr scales the wrapped scheduler's ``base_lrs``: its next step keeps the lower LR."""
    model, optimizer, _, lr_scheduler = _parts(_accelerator(), _rows(1), 0.0)
    guard = ng.Guard(model, optimizer, policy="auto", scheduler=lr_scheduler)
    before = lr_scheduler.scheduler.base_lrs[0]
    guard._remedies.lower_lr()
    optimizer.step()  # no gradients yet: changes nothing
    lr_scheduler.step()
    assert lr_scheduler.scheduler.base_lrs[0] == before * guard.config.lr_factor
    assert optimizer.param_groups[0]["lr"] == lr_scheduler.get_last_lr()[0] <= before * guard.config.lr_factor
    guard.close()
