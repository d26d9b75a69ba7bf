"""DDP at any world size: the guard's flags reach every rank through the gradient all-reduce itself
(issue 41, item 1). On 3 or more ranks a rank that flags writes a NaN into its last bucket before
the all-reduce, so the averaged gradients are non-finite on every rank exactly when some rank
flagged; a healthy step adds no collective and sends the unguarded run's bits. Who flagged is
summed across ranks only on such a step (one all-reduce). On 2 ranks the flags ride in the
bucket's payload (exact there), as before. One spawn per world size holds every assertion.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as tdist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import nanguard as ng
from _sync_count import as_on_gpu
from _sync_count import counting as sync_counting
from nanguard.zoo.spawn import spawn_ranks

pytestmark = pytest.mark.dist

_STEPS = 6


@contextlib.contextmanager
def counting(calls: dict[str, int]) -> Iterator[None]:
    """Add to ``calls`` the collectives (``"collectives"``: every c10d and functional op, DDP's reducer
    included) and the host reads (``"reads"``: what would make a GPU host wait, nanguard's norms summed
    as on CUDA) made inside the block (``_sync_count``)."""
    with as_on_gpu(), sync_counting() as counts:
        yield
    calls["collectives"] += counts.n_collectives
    calls["reads"] += counts.n_host_reads


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).pow(2).mean()


def _x(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * step + rank))


def _loop(
    rank: int,
    mode: str,
    faults: dict[int, tuple[int, str]],
    sync: str = "immediate",
    skip_spikes: bool = False,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """``_STEPS`` steps of a small DDP model under ``mode`` ("plain": DDP's built-in all-reduce, no guard;
    "counted": the Python all-reduce hook, no guard; "guarded"), with ``faults`` {step: (rank, kind)}.
    Returns the collectives called, each step's action and diagnosis, and the final weights."""
    model = _Net().to(dtype)
    ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets: the last is not the only one
    fused = sync == "deferred"  # the deferred path skips on the device: a fused optimizer's found_inf
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, **({"fused": True} if fused else {"foreach": False}))
    config = {"fingerprint_every": 0, "module_stats": False, "sync": sync, "skip_spikes": skip_spikes}
    guard = ng.Guard(ddp, opt, **config) if mode == "guarded" else None
    if mode == "counted":
        ddp.register_comm_hook(None, allreduce_hook)
    calls = {"collectives": 0, "reads": 0}
    actions, trips, before = [], {}, None
    with counting(calls):
        for step in range(_STEPS):
            bad_rank, kind = faults.get(step, (-1, ""))
            if kind == "param":
                before = _weights(model)  # the replicas as the faults before this one left them
            if rank == bad_rank and kind == "param":
                with torch.no_grad():
                    model.b.weight[0, 0] = float("nan")

            def closure(step=step, bad=rank == bad_rank, kind=kind):
                opt.zero_grad(set_to_none=True)
                x = _x(rank, step).to(dtype)
                if bad and kind == "grad":
                    x[0, 0] = float("nan")
                loss = ddp(x)
                if bad and kind == "loss":  # NaN, but no gradient flows through it: finite gradients
                    loss = loss + torch.log(torch.tensor(-1.0))
                loss.backward()
                return loss

            if guard is None:
                closure()
                opt.step()
                continue
            try:
                guard.step(closure)
            except ng.NonFiniteError as err:
                d = err.diagnosis
                actions.append(["raised", d.cause, d.rank, d.ranks] if d is not None else ["raised"])
                break
            actions.append(guard.last_action)
            d = guard.last_diagnosis
            if guard.last_action != "step" and d is not None and d.step not in [int(s) for s in trips]:
                trips[str(d.step)] = [d.cause, d.rank, d.ranks, d.evidence.get("flagged_ranks")]
        if guard is not None and sync == "deferred":
            guard.close()  # the last step's verdict
    weights = _weights(model)
    losses = [p.loss for p in guard.history] if guard is not None else []
    return {
        "calls": calls["collectives"],
        "reads": calls["reads"],
        "actions": actions,
        "trips": trips,
        "weights": weights,
        "before": before or weights,
        "losses": losses,
    }


def _scaled(rank: int, world: int) -> list:
    """A GradScaler: step 1 the middle rank's loss alone is NaN (a trip); step 3 rank 0's finite loss
    scaled past float32 (the scaler's overflow, not a trip). Each step's action, named rank and scale."""
    model = _Net()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    guard = ng.Guard(ddp, opt, scaler=scaler, fingerprint_every=0, module_stats=False)
    out = []
    for step in range(5):

        def closure(step=step):
            opt.zero_grad(set_to_none=True)
            loss = ddp(_x(rank, step))
            if (step, rank) == (1, world // 2):
                loss = loss + torch.log(torch.tensor(-1.0))
            scaler.scale(loss * 1e36 if (step, rank) == (3, 0) else loss).backward()
            return loss

        guard.step(closure)
        d = guard.last_diagnosis
        out.append([guard.last_action, d.rank if d is not None and d.step == step else None, scaler.get_scale()])
    return out


def _loss_spikes(rank: int, world: int) -> dict:
    """A loss that spikes on one rank alone, rank 0 at step 8 and the middle rank at step 10: a term no
    gradient flows through, so the gradients and their norm stay as they were (the grad norm's detector
    sees nothing). Each rank's spike events (``on_event``), actions, added collectives and weights."""
    # step: the rank whose loss alone spikes, and by how much (the second past twice the first, which a
    # detector's window keeps: on 2 ranks the mean loss spikes both times)
    spikes = {8: (0, 1e4), 10: (world // 2, 1e6)}
    model = _Net()
    ddp = DDP(model, bucket_cap_mb=0.001)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, foreach=False)
    events: list[dict] = []
    config = {"fingerprint_every": 0, "module_stats": False, "spike_warmup": 4, "prove": False}
    guard = ng.Guard(ddp, opt, on_event=lambda e: events.append(e) if e["kind"] == "spike" else None, **config)
    actions, calls = [], {"collectives": 0, "reads": 0}
    with counting(calls):
        for step in range(12):

            def closure(step=step):
                opt.zero_grad(set_to_none=True)
                loss = ddp(_x(rank, step % _STEPS))
                bad, by = spikes.get(step, (-1, 0.0))
                if bad == rank:
                    loss = loss + by  # its backward passes the gradient through as it is
                loss.backward()
                return loss

            guard.step(closure)
            actions.append(guard.last_action)
    counted, plain = _unguarded(rank, 12, hook=True), _unguarded(rank, 12, hook=False)
    return {
        "spikes": [[e["step"], e["metric"], e.get("own", False)] for e in events],
        "actions": actions,
        "added": calls["collectives"] - counted[0],
        "weights": _weights(model) == plain[1],
    }


def _unguarded(rank: int, steps: int, *, hook: bool) -> tuple[int, list[float]]:
    """``steps`` unguarded steps (``hook``: the Python all-reduce hook, whose collectives are counted;
    else DDP's built-in all-reduce, whose bits the guard sends): the collectives and the final weights."""
    model = _Net()
    ddp = DDP(model, bucket_cap_mb=0.001)
    if hook:
        ddp.register_comm_hook(None, allreduce_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, foreach=False)
    calls = {"collectives": 0, "reads": 0}
    with counting(calls):
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            ddp(_x(rank, step % _STEPS)).backward()
            opt.step()
    return calls["collectives"], _weights(model)


def _weights(model: torch.nn.Module) -> list[float]:
    return [v for p in model.parameters() for v in p.detach().double().reshape(-1).tolist()]


def _ranks(rank: int, world: int) -> dict:
    middle = world // 2
    faults = {2: (0, "loss"), 3: (middle, "grad"), 5: (0, "param")}
    plain, counted = _loop(rank, "plain", {}), _loop(rank, "counted", {})
    healthy = _loop(rank, "guarded", {})
    faulty = _loop(rank, "guarded", faults)
    fused = _loop(rank, "plain", {}, sync="deferred")  # the fused AdamW the deferred path needs
    deferred = [_loop(rank, "guarded", f, sync="deferred") for f in ({}, {3: (middle, "grad")})]
    spikes = _loop(rank, "guarded", {}, skip_spikes=True)  # a policy that acts on the mean loss
    # bfloat16 buckets would round the loss: they carry the flags by the NaN at any world size.
    bf16 = [_loop(rank, mode, {}, dtype=torch.bfloat16) for mode in ("plain", "counted", "guarded")]
    scaled = _scaled(rank, world)
    gathered: list = [None] * world
    tdist.all_gather_object(gathered, faulty["before"])
    return {
        "added": healthy["calls"] - counted["calls"],
        "reads": healthy["reads"] - counted["reads"],
        "differ": sum(a != b for a, b in zip(plain["weights"], healthy["weights"], strict=True)),
        "healthy_actions": healthy["actions"],
        "actions": faulty["actions"],
        "trips": faulty["trips"],
        "fault_calls": faulty["calls"] - counted["calls"],
        "replicas_equal": all(g == gathered[0] for g in gathered),
        "finite": all(v == v and abs(v) != float("inf") for v in faulty["before"]),
        "bf16": [bf16[2]["calls"] - bf16[1]["calls"], bf16[2]["weights"] == bf16[0]["weights"], bf16[2]["actions"]],
        "scaled": scaled,
        "deferred_added": deferred[0]["calls"] - counted["calls"],
        "deferred_differ": sum(a != b for a, b in zip(fused["weights"], deferred[0]["weights"], strict=True)),
        "deferred": [deferred[1]["actions"], deferred[1]["trips"]],
        "losses": healthy["losses"],
        "spikes": [spikes["calls"] - counted["calls"], spikes["losses"], spikes["weights"] == plain["weights"]],
        "own": _loss_spikes(rank, world),
    }


@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_flags_reach_every_rank_through_the_gradient_all_reduce(world: int) -> None:
    results = spawn_ranks(_ranks, world=world, timeout=300)
    middle = world // 2
    for rank, r in enumerate(results):
        assert r["added"] == 0, (world, rank, r)  # a healthy step adds no collective
        assert r["reads"] <= _STEPS, (world, rank, r)  # and at most one host read
        assert r["differ"] == 0, (world, rank, r)  # and sends the unguarded run's bits
        assert r["healthy_actions"] == ["step"] * _STEPS, (world, rank, r)
        assert r["replicas_equal"] and r["finite"], (world, rank, r)
        assert r["bf16"] == [0, True, ["step"] * _STEPS], (world, rank, r)
    first = results[0]
    # No mean loss without a collective on 3 or more ranks: the history holds NaN (its rules go by the
    # grad norm, alike on every rank); on 2 the loss rides in the payload. skip_spikes acts on the mean
    # loss: on 3 or more it takes one small all-reduce a step (beside the last bucket's), as before.
    spikes = first["spikes"]
    assert all(r["spikes"] == spikes for r in results) and spikes[2], results
    assert all(loss == loss for loss in spikes[1]) and len(spikes[1]) == _STEPS, spikes
    if world > 2:
        assert all(loss != loss for loss in first["losses"]) and spikes[0] == _STEPS, first
    else:
        assert first["losses"] == spikes[1] and spikes[0] == 0, first
    assert all(r["actions"] == first["actions"] and r["trips"] == first["trips"] for r in results), results
    # rank 0's NaN loss with finite gradients and the middle rank's NaN input skipped on every rank;
    # rank 0's NaN weight raises on every rank at the same step (a skip cannot repair it).
    assert first["actions"] == ["step", "step", "skip", "skip", "step", ["raised", "parameters.nonfinite", 0, [0]]]
    # Under a GradScaler the NaN loss trips and the overflow is the scaler's, alike on every rank.
    assert all(r["scaled"] == first["scaled"] for r in results), results
    assert [a[:2] for a in first["scaled"]] == [
        ["step", None],
        ["skip", middle],
        ["step", None],
        ["overflow", None],
        ["step", None],
    ], first
    trips = first["trips"]
    assert trips == {"2": ["op.log_domain", 0, [0], [0]], "3": ["op.nan_write", middle, [middle], [middle]]}, trips
    # The deferred path: no collective and no bit added; the middle rank's NaN input skipped on the device
    # on every rank and its verdict read with the next call.
    assert all(r["deferred_added"] == 0 and r["deferred_differ"] == 0 for r in results), results
    assert all(r["deferred"] == first["deferred"] for r in results), results
    assert first["deferred"][0][4] == "skip", first
    assert first["deferred"][1] == {"3": ["op.nan_write", middle, [middle], [middle]]}, first
    # A loss that spikes on one rank alone (rank 0, then the middle rank) is seen at any world size, and
    # no rank acts otherwise: on 2 ranks as the run's spike (the mean loss rode), on every rank; on 3 or
    # more as that rank's own (no collective agreed a mean), in its log alone. No collective added.
    for rank, r in enumerate(results):
        own = r["own"]
        assert own["actions"] == ["step"] * 12 and own["added"] == 0 and own["weights"], (world, rank, own)
        expected = [[s, "loss", world > 2] for s, bad in ((8, 0), (10, middle)) if world == 2 or bad == rank]
        assert own["spikes"] == expected, (world, rank, own)
