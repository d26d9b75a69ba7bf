"""FSDP2, tensor parallel and 2D where the loop clips (issue 41, item 2): ``clip_grad_norm_`` over
DTensor gradients reduces the total norm over the mesh, so every rank holds it whole. The guard
reads that norm instead of its own all-reduce: a rank whose own signal is bad (its loss, its
parameters) multiplies its backward's root by NaN, so every gradient it contributes, and the
reduced norm on every rank, is non-finite; healthy, by 1.0 (the same bits). Who flagged is summed
across ranks only on such a step. Without a clip the guard's one all-reduce stays
(``tests/test_parallel.py``). One spawn per setup holds every assertion.
"""

from __future__ import annotations

import pytest
import torch

import nanguard as ng
from nanguard import compat
from nanguard.stats import local
from nanguard.zoo import parallel
from nanguard.zoo.spawn import spawn_ranks
from test_distributed_poison import counting

pytestmark = pytest.mark.dist

_STEPS = 4


def _model(setup: str, rank: int, world: int) -> tuple[torch.nn.Module, int]:
    if setup != "fsdp":
        model, _, replica = parallel._build(setup, rank, world)
        return model, replica
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = parallel.ParallelMLP()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.up, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, rank


def _loop(rank: int, world: int, setup: str, guarded: bool, fault: tuple[int, int] | None, part: bool = False) -> dict:
    """``_STEPS`` steps that clip inside the closure; ``fault`` (step, rank): that rank's loss is NaN
    through a term no gradient flows through (its gradients stay finite)."""
    model, replica = _model(setup, rank, world)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = ng.Guard(model, opt, fingerprint_every=0, module_stats=False) if guarded else None
    calls = {"collectives": 0, "reads": 0}
    actions, trip, clipped = [], None, []
    with counting(calls):
        for step in range(_STEPS):
            gen = torch.Generator().manual_seed(1000 * replica + step)
            x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)

            def closure(x=x, y=y, bad=fault == (step, rank)):
                opt.zero_grad(set_to_none=True)
                loss = ((model(x) - y) ** 2).mean()
                if bad:
                    loss = loss + torch.log(torch.tensor(-1.0))
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_((model.down if part else model).parameters(), 1.0)
                clipped.append(float(compat.full_tensor(norm) if compat.full_tensor(norm) is not None else norm))
                return loss

            if guard is None:
                closure()
                opt.step()
                continue
            guard.step(closure)
            actions.append(guard.last_action)
            d = guard.last_diagnosis
            if trip is None and d is not None:
                trip = [d.step, d.rank, d.ranks]
    weights = [v for p in model.parameters() for v in local(p).detach().double().reshape(-1).tolist()]
    norms = [p.grad_norm for p in guard.history] if guard is not None else []
    return {
        "calls": calls["collectives"],
        "reads": calls["reads"],
        "actions": actions,
        "trip": trip,
        "weights": weights,
        "norms": norms,
        "clipped": clipped,
    }


def _ranks(rank: int, world: int, setup: str, bad_rank: int) -> dict:
    plain = _loop(rank, world, setup, False, None)
    healthy = _loop(rank, world, setup, True, None)
    faulty = _loop(rank, world, setup, True, (1, bad_rank))
    part = _loop(rank, world, setup, True, None, part=True)  # a clip of some parameters carries no flags
    part_plain = _loop(rank, world, setup, False, None, part=True)
    return {
        "added": healthy["calls"] - plain["calls"],
        "reads": healthy["reads"] - plain["reads"],
        "differ": sum(a != b for a, b in zip(plain["weights"], healthy["weights"], strict=True)),
        "actions": [healthy["actions"], faulty["actions"]],
        "trip": faulty["trip"],
        "norms": healthy["norms"],
        "clipped": healthy["clipped"],
        "fault_added": faulty["calls"] - plain["calls"],
        "part_added": part["calls"] - part_plain["calls"],
    }


@pytest.mark.parametrize(
    ("setup", "world", "bad_rank"),
    [("fsdp", 2, 0), ("tp", 2, 0), pytest.param("2d", 4, 1, marks=pytest.mark.slow)],
)
def test_the_flags_ride_in_the_loops_clip_norm(setup: str, world: int, bad_rank: int) -> None:
    results = spawn_ranks(_ranks, setup, bad_rank, world=world, timeout=300)
    first = results[0]
    for rank, r in enumerate(results):
        assert r["added"] == 0, (setup, rank, r)  # no collective of the guard's on a healthy step
        assert r["reads"] <= _STEPS, (setup, rank, r)  # and at most one host read
        assert r["part_added"] == _STEPS, (setup, rank, r)  # the guard's own all-reduce, each step
        assert r["differ"] == 0, (setup, rank, r)  # the root times 1.0: the unguarded run's bits
        # The grad norm the history keeps is the clip's, whole and alike on every rank.
        assert r["norms"] == first["norms"] == r["clipped"] and len(r["norms"]) == _STEPS, (setup, rank, r)
        assert r["actions"] == [["step"] * _STEPS, ["step", "skip", "step", "step"]], (setup, rank, r)
        # Only the tripped step sums who flagged (one all-reduce), plus the trip's own gathers.
        assert r["trip"][:1] == [1] and r["trip"] == first["trip"], (setup, rank, r)
    assert first["trip"][1] == bad_rank and bad_rank in first["trip"][2], first
