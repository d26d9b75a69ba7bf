"""The guard's promise of at most one host read a step, counted.

Every call that would make a GPU host wait (``item``, ``tolist``, ``bool``, ``float``,
``int``, ``numpy``) is counted while a guarded loop and the same unguarded loop run. The
optimizer and the model may read on their own (Adam reads its step counter); what the
guard adds on a healthy step is the difference, and it must be at most one.

On CPU the grad norm is summed in float32 and read back only to re-sum an overflow in float64,
which costs no device sync there; on CUDA it is summed in float64 with no read. The test runs
the CUDA accumulation on the CPU, so it counts what a GPU run pays.
"""

from __future__ import annotations

import pytest
import torch

import nanguard as ng
from nanguard import stats
from nanguard.zoo import build, get, train_step

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")
STEPS = 6


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setattr(stats, "_ACCUMULATE", {**stats._ACCUMULATE, "cpu": torch.float64})
    seen: list[str] = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counting(self: torch.Tensor, *args, _name=name, _original=original, **kwargs):
            seen.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    return seen


def _reads_per_run(reads: list[str], guarded: bool, optimizer: str) -> int:
    run = build(get("healthy_padding_mask"))
    if optimizer == "sgd":
        run.optimizer = torch.optim.SGD(run.model.parameters(), lr=1e-3)
    guard = ng.Guard(run.model, run.optimizer) if guarded else None
    batches = [b for _, b in run.batches(STEPS)]
    before = len(reads)
    for batch in batches:
        if guard is not None:
            assert guard.step(lambda b=batch: train_step(run.model, b)) is not None
        else:
            train_step(run.model, batch)
            run.optimizer.step()
    return len(reads) - before


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_healthy_guarded_step_adds_at_most_one_host_read(reads: list[str], optimizer: str) -> None:
    plain = _reads_per_run(reads, guarded=False, optimizer=optimizer)
    guarded = _reads_per_run(reads, guarded=True, optimizer=optimizer)
    added = guarded - plain
    assert added <= STEPS, f"the guard added {added} host reads over {STEPS} healthy steps: {reads[-guarded:]}"
    assert added >= 1, "the counter saw no guard read at all: the check must read its verdict somewhere"
