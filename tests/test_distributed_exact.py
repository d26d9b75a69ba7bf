"""A healthy guarded DDP run is the unguarded one, bit for bit, at any world size (issue 31, item 7),
and nothing of the guard keeps the DDP model alive after the loop lets go of it (item 9).

On 2 ranks the guard's flags ride in the last gradient bucket's payload (each element sums two terms:
the same bits in either order). On 3 or more a longer payload moves gloo's ring chunks and with them
the order each element's terms are summed in (the zoo GPT's weights differed after 3 AdamW steps), so
the flags go in one small all-reduce of their own, issued from the comm hook right after the bucket's.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nanguard as ng
from nanguard.zoo import build, get
from nanguard.zoo.spawn import spawn_ranks

pytestmark = pytest.mark.dist


def _gpt_run(rank: int, world: int, guarded: bool) -> list[float]:
    torch.manual_seed(0)
    run = build(get("healthy_padding_mask"), 0)
    ddp = DDP(run.model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    guard = ng.Guard(ddp, opt, fingerprint_every=0, module_stats=False) if guarded else None
    for step in range(3):
        closure = run.closure(run.batch(step * world + rank), ddp)
        if guard is None:
            closure()
            opt.step()
        else:
            assert guard.step(closure) is not None and guard.last_action == "step"
    return [v for p in run.model.parameters() for v in p.detach().double().reshape(-1).tolist()]


def _freed_after_join(rank: int, guarded: bool) -> bool:
    """A short DDP ``join()`` loop: is its model freed as soon as the loop lets go (no cycle holds it)?"""

    def loop() -> weakref.ref[nn.Module]:
        torch.manual_seed(0)
        ddp = DDP(nn.Linear(2, 1))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        guard = ng.Guard(ddp, opt, fingerprint_every=0, module_stats=False) if guarded else None
        with ddp.join():
            for step in range(2):
                x = torch.randn(3, 2, generator=torch.Generator().manual_seed(rank * 10 + step))

                def closure(x: torch.Tensor = x) -> torch.Tensor:
                    opt.zero_grad()
                    loss = ddp(x).sum()
                    loss.backward()
                    return loss

                if guard is None:
                    closure()
                    opt.step()
                else:
                    guard.step(closure)
        return weakref.ref(ddp)

    gc.disable()  # reference counting alone: a cycle would wait for a collection, perhaps at exit
    try:
        return loop()() is None
    finally:
        gc.enable()


def _compare(rank: int, world: int) -> dict[str, object]:
    plain, guarded = _gpt_run(rank, world, False), _gpt_run(rank, world, True)
    return {
        "differ": sum(a != b for a, b in zip(plain, guarded, strict=True)),
        "freed": [_freed_after_join(rank, False), _freed_after_join(rank, True)],
    }


@pytest.mark.parametrize("world", [3, 4])
def test_a_healthy_guarded_ddp_run_is_bit_identical_at_more_than_two_ranks(world: int) -> None:
    for rank, r in enumerate(spawn_ranks(_compare, world=world, timeout=300)):
        assert r["differ"] == 0, (world, rank, r)
        # The guard kept the DDP model (and the process group its reducer holds) alive past the loop
        # in a reference cycle (its join hook held the model), into interpreter shutdown.
        assert r["freed"] == [True, True], (world, rank, r)
