"""The peer proof beyond DDP. Under FSDP2 every rank's forward all-gathers the same full weights, so a
peer can re-compute the suspect's batch: a device whose matmuls corrupt an output (below the model, on
one rank) is named ``hardware.faulty_device`` on rank 0 and on a middle rank, a software fault on one
rank's batch stays the ordinary diagnosis. Under tensor and pipeline parallelism no other rank computes
what the suspect computes: the proof says why it cannot run and the hardware is never named."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import nanguard as ng
from _faulty_matmul import FaultyMatmul
from nanguard.zoo.spawn import spawn_ranks

STEPS, BAD = 4, 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))


def _trip(guard: Any) -> dict[str, Any]:
    diag = guard.last_diagnosis
    assert diag is not None
    proof = diag.evidence.get("proof") or {}
    both = proof.get("computations") or {}
    return {
        "cause": diag.cause,
        "rank": diag.rank,
        "verdict": proof.get("verdict"),
        "suspect": proof.get("suspect"),
        "peer": proof.get("peer"),
        "why": proof.get("why"),
        "suspect_finite": (both.get("suspect") or {}).get("finite"),
        "peer_finite": (both.get("peer") or {}).get("finite"),
    }


def _fsdp(faulty: int | None, log_rank: int | None = None) -> list[dict[str, Any]]:
    """A guarded FSDP2 run; from step BAD on, rank ``faulty``'s matmuls put a NaN in their outputs
    (``log_rank``: that rank's batch at BAD holds an input the loss code takes the log of a negative of)."""
    from torch.distributed.fsdp import fully_shard

    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = Net()
    fully_shard(model.inp)
    fully_shard(model.out)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ng.Guard(model, opt, policy="skip", fingerprint_every=0)
    device = FaultyMatmul()
    trips = []
    with device:
        for step in range(STEPS):
            g = torch.Generator().manual_seed(1000 * rank + step)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
            if step == BAD and rank == log_rank:
                x[0, 0] = 100.0
            device.armed = rank == faulty and step >= BAD

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                opt.zero_grad()
                out = model(x)
                loss = nn.functional.mse_loss(out, y)
                if bool(x.max() > 50):
                    loss = loss + torch.log(out.mean() - 1000.0)
                loss.backward()
                return loss

            if guard.step(closure, batch={"x": x, "y": y}) is None:
                trips.append({"step": step, **_trip(guard)})
    guard.close()
    return trips


def _parallel(setup: str, faulty: int) -> list[dict[str, Any]]:
    """A guarded tensor- or pipeline-parallel run (``nanguard.zoo.parallel``'s MLP); from step 1 on, rank
    ``faulty``'s device puts a NaN in its ``up`` projection's output (the drill's ``faulty_device``: a
    Python dispatch mode above DTensor would see DTensor's ops, not the kernels)."""
    from nanguard.zoo.parallel import _build, _closure

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model, schedule, replica = _build(setup, rank, world)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    spec = f"faulty_device@step=1,rank={faulty},module=up"
    guard = ng.Guard(model, opt, policy="skip", fingerprint_every=0, inject=spec)
    trips = []
    for step in range(3):
        gen = torch.Generator().manual_seed(1000 * replica + step)
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
        closure = _closure(setup, model, schedule, opt, x, y, rank, world)
        if guard.step(closure, batch={"x": x}) is None:
            trips.append({"step": step, **_trip(guard)})
    guard.close()
    return trips


def _titan(faulty: int) -> dict[str, Any]:
    """torchtitan's llama3 under its own FSDP2 (``nanguard.zoo.titan``, TitanGuard): rank ``faulty``'s matmuls
    put a NaN in their outputs from the first step on."""
    from nanguard.zoo.titan import titan_rank

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    with FaultyMatmul() as device:
        device.armed = rank == faulty
        run = titan_rank(rank, world, "fsdp", None, faulty, "skip", steps=2)
    diag = run["diag"]
    proof = diag["evidence"].get("proof") or {}
    return {"skipped": run["skipped"], "cause": diag["cause"], "rank": diag["rank"], "verdict": proof.get("verdict")}


def _zero(stage: int, faulty: int) -> list[dict[str, Any]]:
    """A DeepSpeed engine loop under ZeRO ``stage`` (``_deepspeed_ranks``' MLP), guarded by DeepSpeedGuard; from
    step 1 on, rank ``faulty``'s matmuls put a NaN in their outputs."""
    import _deepspeed_ranks as ds
    from nanguard.integrations.deepspeed import DeepSpeedGuard

    rank = torch.distributed.get_rank()
    engine = ds.engine_for(stage, "fp32")
    guard = DeepSpeedGuard(engine, "skip", fingerprint_every=0)
    trips = []
    with FaultyMatmul() as device:
        for step in range(3):
            device.armed = rank == faulty and step >= 1
            x, y = ds.batch(rank, step, "fp32")
            engine.backward(engine(x, y))
            engine.step()
            if guard.step_skipped:
                trips.append({"step": step, **_trip(guard)})
    guard.close()
    return trips


def _zeros(rank: int, world: int, runs: list[tuple[int, int]]) -> dict[str, Any]:
    import _deepspeed_ranks as ds

    ds.init(rank)
    return {f"zero{stage}/{faulty}": _zero(stage, faulty) for stage, faulty in runs}


def _titans(rank: int, world: int) -> dict[str, Any]:
    return {"titan0": _titan(0), "titan1": _titan(1)}


def _sharded(rank: int, world: int) -> dict[str, Any]:
    return {"fsdp0": _fsdp(0), "fsdp1": _fsdp(1), "software": _fsdp(None, log_rank=2)}


def _tp_pp(rank: int, world: int) -> dict[str, Any]:
    return {name: _parallel(name[:2], int(name[2])) for name in ("tp0", "tp1", "pp0", "pp1")}


@pytest.mark.dist
def test_under_fsdp2_a_peer_proves_a_faulty_device_on_rank_0_and_a_middle_rank() -> None:
    results = spawn_ranks(_sharded, world=3, timeout=300)
    for name in results[0]:
        assert results[1][name] == results[0][name] == results[2][name], name  # every rank concluded the same
    ours = results[0]
    for name, faulty in (("fsdp0", 0), ("fsdp1", 1)):
        trips = ours[name]
        assert [t["step"] for t in trips] == list(range(BAD, STEPS)), name  # it stays faulty
        for t in trips:
            assert (t["cause"], t["rank"], t["suspect"]) == ("hardware.faulty_device", faulty, faulty), (name, t)
        first = trips[0]
        assert first["verdict"] == "device" and first["peer"] != faulty
        assert first["suspect_finite"] is False and first["peer_finite"] is True
    (software,) = ours["software"]
    assert (software["cause"], software["rank"], software["verdict"]) == ("op.log_domain", 2, "everywhere")
    assert software["peer_finite"] is False


@pytest.mark.dist
def test_under_torchtitans_fsdp2_a_peer_proves_a_faulty_device_on_either_rank() -> None:
    results = spawn_ranks(_titans, world=2, timeout=300)
    assert results[0] == results[1]
    for name, faulty in (("titan0", 0), ("titan1", 1)):
        found = results[0][name]
        assert found == {"skipped": [0, 1], "cause": "hardware.faulty_device", "rank": faulty, "verdict": "device"}


def _proven_under_zero(runs: list[tuple[int, int]]) -> None:
    results = spawn_ranks(_zeros, runs, world=2, timeout=600)
    assert results[0] == results[1]
    for stage, faulty in runs:
        trips = results[0][f"zero{stage}/{faulty}"]
        assert [t["step"] for t in trips] == [1, 2], stage
        for t in trips:
            assert (t["cause"], t["rank"], t["verdict"]) == ("hardware.faulty_device", faulty, "device"), (stage, t)
            assert t["suspect_finite"] is False and t["peer_finite"] is True


@pytest.mark.dist
def test_under_deepspeed_zero3_a_peer_proves_a_faulty_device_on_rank_0() -> None:
    _proven_under_zero([(3, 0)])


@pytest.mark.dist
@pytest.mark.slow
def test_under_deepspeed_zero_1_to_3_a_peer_proves_a_faulty_device_on_either_rank() -> None:
    _proven_under_zero([(1, 1), (2, 0), (3, 1)])


@pytest.mark.dist
def test_under_tensor_and_pipeline_parallel_the_hardware_is_never_blamed_without_a_proof() -> None:
    results = spawn_ranks(_tp_pp, world=2, timeout=300)
    for name in results[0]:
        assert results[1][name] == results[0][name], name
    for name, trips in results[0].items():
        assert trips and trips[0]["step"] == 1, name
        for t in trips:
            assert not t["cause"].startswith("hardware."), (name, t)
            assert t["verdict"] == "unproven" and "no other rank computes" in t["why"], (name, t)
            assert t["why"].startswith("tensor parallel" if name.startswith("tp") else "pipeline parallel"), name
