"""A proof is reused only for the same fault. After a faulty device is proven, a different fault on the
same rank the next step (an input that overflows on any device) is proven again, not blamed on the
device; the device's fault after it is proven again, and reused with ``repeat_of`` only while it repeats
as itself (same rank, phase, op and module)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import nanguard as ng
from nanguard.zoo.spawn import spawn_ranks

STEPS, DEVICE, OVERFLOW = 6, 2, 3


def _ranks(rank: int, world: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # From step DEVICE on, rank 1's device corrupts every forward of the last Linear.
    guard = ng.Guard(model, opt, inject=f"faulty_device@step={DEVICE},rank=1,module=2", fingerprint_every=0)
    trips = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        if step == OVERFLOW and rank == 1:
            x[0, 0] = 3e38  # overflows the loop's input scaling on any device: software or data, not hardware

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x * 10.0), y)
            loss.backward()
            return loss

        if guard.step(closure, batch={"x": x, "y": y}) is None:
            d = guard.last_diagnosis
            proof = d.evidence.get("proof") or {}
            trips.append(
                {
                    "step": step,
                    "cause": d.cause,
                    "rank": d.rank,
                    "module": d.module,
                    "verdict": proof.get("verdict"),
                    "repeat_of": d.evidence.get("repeat_of"),
                }
            )
    guard.close()
    return trips


@pytest.mark.dist
def test_a_different_fault_after_a_proven_device_is_proven_again() -> None:
    results = spawn_ranks(_ranks, world=3, timeout=300)
    assert results[1] == results[0] == results[2]  # every rank concluded the same
    by_step = {t["step"]: t for t in results[0]}
    assert sorted(by_step) == list(range(DEVICE, STEPS))
    first = by_step[DEVICE]
    assert (first["cause"], first["rank"], first["module"], first["verdict"]) == (
        "hardware.faulty_device",
        1,
        "2",
        "device",
    )
    other = by_step[OVERFLOW]
    assert other["cause"] != "hardware.faulty_device" and other["repeat_of"] is None
    assert (other["rank"], other["module"], other["verdict"]) == (1, None, "everywhere")
    again = by_step[OVERFLOW + 1]  # the device again: proven again, the last trip being another fault
    assert (again["cause"], again["verdict"], again["repeat_of"]) == ("hardware.faulty_device", "device", None)
    repeat = by_step[OVERFLOW + 2]  # the same fault as the step before: its proof reused
    assert (repeat["cause"], repeat["module"], repeat["repeat_of"]) == ("hardware.faulty_device", "2", OVERFLOW + 1)


def test_a_transient_diagnosis_lists_no_rank_as_reproducing_it() -> None:
    from nanguard.diagnose import transient_fault

    d = transient_fault(step=4, loss=float("nan"), grad_norm=1.0, flagged_ranks=[2], located=True, distributed=True)
    assert d.cause == "distributed.transient" and d.ranks == [] and d.rank == 2
    assert d.evidence["flagged_ranks"] == [2]
