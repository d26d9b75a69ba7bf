"""The guard's promise of at most one host read a step, counted.

Every call that would make a GPU host wait (``item``, ``tolist``, ``bool``, ``float``,
``int``, ``numpy``) is counted (``_sync_count``) while a guarded loop and the same unguarded loop run. The
optimizer and the model may read on their own (Adam reads its step counter); what the
guard adds on a healthy step is the difference, and it must be at most one.

On CPU the grad norm is summed in float32 and read back only to re-sum an overflow in float64,
which costs no device sync there; on CUDA it is summed in float64 with no read. The test runs
the CUDA accumulation on the CPU, so it counts what a GPU run pays.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import nanguard as ng
from _sync_count import Counts, as_on_gpu, counting
from nanguard.zoo import GPT, GPTConfig, build, get, synthetic_batch, train_step

STEPS = 6


@pytest.fixture
def reads() -> Iterator[Counts]:
    """Every host read made while the test runs (``_sync_count``), nanguard's norms summed as on CUDA."""
    with as_on_gpu(), counting() as counts:
        yield counts


def _reads_per_run(reads: Counts, guarded: bool, optimizer: str) -> int:
    run = build(get("healthy_padding_mask"))
    if optimizer == "sgd":
        run.optimizer = torch.optim.SGD(run.model.parameters(), lr=1e-3)
    guard = ng.Guard(run.model, run.optimizer) if guarded else None
    batches = [b for _, b in run.batches(STEPS)]
    before = reads.n_host_reads
    for batch in batches:
        if guard is not None:
            assert guard.step(lambda b=batch: train_step(run.model, b)) is not None
        else:
            train_step(run.model, batch)
            run.optimizer.step()
    return reads.n_host_reads - before


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_healthy_guarded_step_adds_at_most_one_host_read(reads: Counts, optimizer: str) -> None:
    plain = _reads_per_run(reads, guarded=False, optimizer=optimizer)
    guarded = _reads_per_run(reads, guarded=True, optimizer=optimizer)
    added = guarded - plain
    assert added <= STEPS, f"the guard added {added} host reads over {STEPS} healthy steps: {reads.host_reads}"
    assert added >= 1, "the counter saw no guard read at all: the check must read its verdict somewhere"


def _fused_run() -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vision_dim=16))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def _vision_batch(model: GPT, step: int, bad: bool = False) -> dict[str, torch.Tensor]:
    batch = synthetic_batch(model.config, torch.Generator().manual_seed(step))
    return {**batch, "pixel_values": torch.full((8, 4, 16), float("nan"))} if bad else batch


def _vision_step(guard: ng.Guard, model: GPT, step: int):
    batch = _vision_batch(model, step)
    return guard.step(lambda: train_step(model, batch), batch=batch)


def test_deferred_fault_is_skipped_on_the_device_and_diagnosed_with_the_next_call(reads: Counts) -> None:
    plain_model, plain_opt = _fused_run()  # the fused optimizer may read on its own: counted unguarded
    train_step(plain_model, _vision_batch(plain_model, 0))
    start = reads.n_host_reads
    plain_opt.step()
    optimizer_reads = reads.n_host_reads - start
    model, opt = _fused_run()
    guard = ng.Guard(model, opt, policy="skip", sync="deferred")
    for step in range(3):
        _vision_step(guard, model, step)
    before = [p.detach().clone() for p in model.parameters()]
    # Step 3 is bad: after its closure, its call reads nothing, and its update does not land.
    bad = _vision_batch(model, 3, bad=True)
    closure_done: list[int] = []

    def closure() -> torch.Tensor:
        loss = train_step(model, bad)
        closure_done.append(reads.n_host_reads)
        return loss

    loss = guard.step(closure, batch=bad)
    after_closure = reads.n_host_reads - closure_done[0]
    assert after_closure <= optimizer_reads, f"the guard read inside the bad step: {reads.host_reads}"
    assert loss is not None  # its verdict is not known yet
    assert guard.last_diagnosis is None and guard.skipped == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # The next call reads step 3's verdict first: diagnosis of step 3, skipped, then runs its own step.
    assert _vision_step(guard, model, 4) is not None
    diag = guard.last_diagnosis
    assert (diag.cause, diag.step, diag.module) == ("data.nonfinite", 3, "vis_proj")
    guard.close()
    assert guard.last_action == "step" and guard.step_count == 5 and guard.skipped == 1
