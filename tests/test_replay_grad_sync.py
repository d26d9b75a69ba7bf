"""A loop that sets DDP's ``require_backward_grad_sync`` itself (nanoGPT, llm.c): the replay keeps
communication off whatever it sets, so a NaN made in one rank's forward is named where it was made."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist
from torch.nn.parallel import DistributedDataParallel as DDP

import nanguard as ng
from nanguard.rng import get_rng_state
from nanguard.zoo.spawn import spawn_ranks

pytestmark = pytest.mark.dist
ACCUM = 2
BAD_STEP = 1


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.log(self.fc(x) + 50.0)).pow(2).mean()  # a NaN once fc(x) < -50


def _x(rank: int, step: int, micro: int, bad: bool) -> torch.Tensor:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 100 + step * 10 + micro))
    if bad:
        x[0] = 1e3  # finite: the log in the forward makes the NaN
    return x


def _run(rank: int, bad_rank: int, bad_micro: int, style: str) -> dict:
    model = Net()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    guard = ng.Guard(ddp, opt, module_stats=False)
    skips_at = []

    def forward_backward(step: int) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for micro in range(ACCUM):
            ddp.require_backward_grad_sync = micro == ACCUM - 1  # the loop's own toggle
            bad = (step, micro, rank) == (BAD_STEP, bad_micro, bad_rank)
            loss = ddp(_x(rank, step, micro, bad)) / ACCUM
            loss.backward()
            total = total + loss.detach()
        return total

    for step in range(3):
        if style == "check":  # nanoGPT: the loop owns backward and the step
            rng = get_rng_state()
            loss = forward_backward(step)
            if guard.check(loss, replay=lambda step=step: forward_backward(step), rng=rng):
                opt.step()
                guard.after_step()
            else:
                skips_at.append(step)
        elif guard.step(lambda step=step: forward_backward(step)) is None:  # llm.c: the closure form
            skips_at.append(step)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(tdist.get_world_size())]
    tdist.all_gather(gathered, flat)
    d = guard.last_diagnosis
    return {
        "skips_at": skips_at,
        "equal": all(torch.equal(g, gathered[0]) for g in gathered),
        "sync_after": ddp.require_backward_grad_sync,
        "diag": None if d is None else [d.cause, d.op, d.phase, d.rank, d.ranks, d.step],
    }


def _cases(rank: int, world: int) -> list[dict]:
    return [
        _run(rank, bad_rank, bad_micro, style)
        for style in ("check", "step")
        for bad_rank in (1, 0)
        for bad_micro in (0, ACCUM - 1)
    ]


def test_a_forward_nan_under_the_loops_own_sync_toggle_is_named_on_its_rank() -> None:
    cases = [(style, bad_rank, bad_micro) for style in ("check", "step") for bad_rank in (1, 0) for bad_micro in (0, 1)]
    for per_rank in spawn_ranks(_cases, timeout=180):
        for (style, bad_rank, bad_micro), r in zip(cases, per_rank, strict=True):
            where = (style, bad_rank, bad_micro)
            assert r["skips_at"] == [BAD_STEP] and r["equal"], (where, r)
            assert r["sync_after"] is True, where  # the loop's last write stands after the replay
            expected = ["op.log_domain", "aten.log.default", "forward", bad_rank, [bad_rank], BAD_STEP]
            assert r["diag"] == expected, (where, r["diag"])
