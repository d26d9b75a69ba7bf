"""``LoopGuard`` over a hand-written loop that clips (issue 41, item 1): the flags ride in the loop's own
reductions. Under DDP in its gradient all-reduce (2 ranks: in the last bucket's payload; 3 or more: a
flagging rank's NaN in it, who flagged summed on that step only); under FSDP2, tensor parallel and 2D in the
total norm the loop's ``clip_grad_norm_`` reduces over every rank, a flagging rank having made one element
it reduces NaN before the norm (its loss, its parameters, a gradient the norm keeps its own). A healthy
step adds no collective and one host read, the weights the unguarded run's bit for bit; a fault on one rank
(its loss NaN with finite gradients, a NaN made in its own backward, a NaN in a gradient after the
backward) is skipped on every rank alike and named on that rank. One spawn per world size holds every run.
"""

from __future__ import annotations

import os

import pytest
import torch

from nanguard.integrations.loop import LoopGuard
from nanguard.stats import local
from nanguard.zoo.spawn import spawn_ranks
from test_distributed_poison import counting
from test_parallel_clip import _model as _parallel_model

pytestmark = pytest.mark.dist

_STEPS = 4
_BAD_STEP = 1


def _model(setup: str, rank: int, world: int) -> tuple[torch.nn.Module, int]:
    if setup != "ddp":
        return _parallel_model(setup, rank, world)
    from torch.nn.parallel import DistributedDataParallel as DDP

    from nanguard.zoo import parallel

    torch.manual_seed(0)
    return DDP(parallel.ParallelMLP()), rank


def _spoil_after_backward(model: torch.nn.Module) -> None:
    """A NaN in one element of this rank's gradient after the backward, before the clip: under tensor
    parallel in a gradient it replicates (the clip's norm of it is this rank's own), else its first."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    replicated = [g for g in grads if any(pl.is_replicate() for pl in getattr(g, "placements", ()))]
    local((replicated or grads)[0]).view(-1)[0] = float("nan")


def _loop(rank: int, world: int, setup: str, guarded: bool, fault: tuple[int, str] | None) -> dict:
    """``_STEPS`` steps of forward, backward, ``clip_grad_norm_`` and SGD; ``fault`` (rank, kind) at
    ``_BAD_STEP``: "loss" (NaN through a term no gradient flows through), "backward" (this rank's
    gradients made NaN in its own backward), "after" (``_spoil_after_backward``)."""
    model, replica = _model(setup, rank, world)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = LoopGuard(model, opt, fingerprint_every=0, module_stats=False) if guarded else None

    def loss_of(x: torch.Tensor, y: torch.Tensor, kind: str | None) -> torch.Tensor:
        out = model(x)
        if kind == "backward":
            out.register_hook(lambda g: g * float("nan"))
        loss = ((out - y) ** 2).mean()
        return loss + torch.log(torch.tensor(-1.0)) if kind == "loss" else loss

    run = guard.micro_step(loss_of) if guard is not None else loss_of
    calls = {"collectives": 0, "reads": 0}
    actions: list[str] = []
    with counting(calls):
        for step in range(_STEPS):
            gen = torch.Generator().manual_seed(1000 * replica + step)
            x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
            kind = fault[1] if fault is not None and (step, rank) == (_BAD_STEP, fault[0]) else None
            run(x, y, kind).backward()
            if kind == "after":
                _spoil_after_backward(model)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            actions.append("skip" if guard is not None and guard.step_skipped else "step")
    weights = [v for p in model.parameters() for v in local(p).detach().double().reshape(-1).tolist()]
    d = guard.guard.last_diagnosis if guard is not None and guard.guard is not None else None
    if guard is not None:
        guard.close()
    return {
        "calls": calls["collectives"],
        "reads": calls["reads"],
        "actions": actions,
        "trip": None if d is None else [d.step, d.rank, d.cause],
        "weights": weights,
    }


def _ranks(rank: int, world: int, cases: list[tuple[str, int]]) -> dict:
    """Each ``(setup, bad rank)`` in turn: the plain run, the healthy guarded run and one run per fault kind."""
    out = {}
    for setup, bad_rank in cases:
        plain = _loop(rank, world, setup, False, None)
        healthy = _loop(rank, world, setup, True, None)
        faulty = {kind: _loop(rank, world, setup, True, (bad_rank, kind)) for kind in _KINDS[setup]}
        out[setup] = {
            "added": healthy["calls"] - plain["calls"],
            "reads": healthy["reads"] - plain["reads"],
            "identical": healthy["weights"] == plain["weights"],
            "healthy": healthy["actions"],
            "faulty": {k: [r["actions"], r["trip"], all(w == w for w in r["weights"])] for k, r in faulty.items()},
        }
    return out


_KINDS = {
    "ddp": ["loss", "backward"],
    **{setup: ["loss", "backward", "after"] for setup in ("fsdp", "tp", "2d")},
}
_CASES = {2: [("ddp", 0), ("fsdp", 0), ("tp", 1)], 3: [("ddp", 1)], 4: [("2d", 1)]}


@pytest.fixture(scope="module")
def spawned() -> dict[int, list[dict]]:
    """One spawn per world size (2 ranks: DDP, FSDP2 and TP in turn), the 4-rank 2D one only when asked for."""
    slow = os.environ.get("NANGUARD_SLOW") == "1"
    worlds = [w for w in _CASES if w < 4 or slow]
    return {w: spawn_ranks(_ranks, _CASES[w], world=w, timeout=600) for w in worlds}


@pytest.mark.parametrize(
    ("setup", "world"),
    [("ddp", 2), ("ddp", 3), ("fsdp", 2), ("tp", 2), pytest.param("2d", 4, marks=pytest.mark.slow)],
)
def test_loopguard_rides_the_loops_reductions_and_a_fault_on_one_rank_is_skipped_everywhere(
    spawned: dict[int, list[dict]], setup: str, world: int
) -> None:
    bad_rank = dict(_CASES[world])[setup]
    results = [r[setup] for r in spawned[world]]
    for rank, r in enumerate(results):
        assert r["added"] == 0, (setup, rank, r)  # no collective of the guard's on a healthy step
        assert r["reads"] == _STEPS, (setup, rank, r)  # one host read a step
        assert r["identical"] and r["healthy"] == ["step"] * _STEPS, (setup, rank, r)
        for kind in _KINDS[setup]:
            actions, trip, finite = r["faulty"][kind]
            assert actions == ["step", "skip", "step", "step"], (setup, rank, kind, r)  # alike on every rank
            assert trip is not None and trip[0] == _BAD_STEP, (setup, rank, kind, trip)
            if kind != "after":  # (a NaN written after the backward is not in the replay: no rank is blamed)
                assert trip[1] == bad_rank, (setup, rank, kind, trip)
            assert finite, (setup, rank, kind)  # the skipped step wrote no NaN into the weights
            assert trip == results[0]["faulty"][kind][1], (setup, rank, kind)
