"""Corruption that stays finite. A device that scales one matmul output element by 1e4 on one rank
(below the model, forward and backward) makes a loss spike with nothing NaN: the ranks' local values show
which rank stands apart, a peer re-computes its batch differently, and the device is named
``hardware.faulty_device`` (rank 0, and a middle rank, of 3 DDP ranks). A batch that is itself spiky, on a
healthy device, is reproduced by the peer: a spike, never the hardware, and the run is bit-identical to
one without the proof."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import nanguard as ng
from _faulty_matmul import FaultyMatmul
from nanguard.guard.outlier import outlier
from nanguard.zoo.spawn import spawn_ranks

WARMUP = 5


def _run(
    faulty: int | None, *, spiky: int | None = None, steps: int = WARMUP + 3, prove: bool = True, fsdp: bool = False
) -> dict[str, Any]:
    """A guarded DDP (``fsdp``: FSDP2) run; from step WARMUP + 1 on, rank ``faulty``'s matmuls scale an output
    element by 1e4 (``spiky``: that rank's batch at WARMUP + 1 has targets a thousandfold the others', on a
    healthy device)."""
    rank = torch.distributed.get_rank()
    bad = WARMUP + 1
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in (net[0], net[2], net):
            fully_shard(layer)
    model = net if fsdp else nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = ng.Guard(model, opt, policy="skip", prove=prove, fingerprint_every=0, spike_warmup=WARMUP, spike_window=20)
    device = FaultyMatmul(factor=1e4)
    trips, spikes = [], []
    with device:
        for step in range(steps):
            g = torch.Generator().manual_seed(1000 * rank + step)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
            if step == bad and rank == spiky:
                y = y * 1000.0  # a batch whose targets are in other units: a genuine data outlier
            device.armed = rank == faulty and step >= bad

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss

            before = guard.spikes
            if guard.step(closure, batch={"x": x, "y": y}) is None:
                d = guard.last_diagnosis
                assert d is not None
                proof = d.evidence.get("proof") or {}
                trips.append(
                    {
                        "step": step,
                        "cause": d.cause,
                        "kind": d.kind,
                        "rank": d.rank,
                        "verdict": proof.get("verdict"),
                        "peer": proof.get("peer"),
                        "local": proof.get("local"),
                        "computations": proof.get("computations"),
                    }
                )
            elif guard.spikes > before:
                spikes.append({"step": step, **(guard.diagnoser.spike_proof or {})})
    guard.close()
    weights = torch.cat([getattr(p, "_local_tensor", p).detach().reshape(-1) for p in net.parameters()])
    return {"trips": trips, "spikes": spikes, "weights": weights.tolist(), "hits": device.hits}


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    return {
        "device0": _run(0),
        "device1": _run(1),
        "data": _run(None, spiky=2),
        "data_unproven": _run(None, spiky=2, prove=False),
    }


@pytest.mark.dist
def test_a_finite_spike_one_device_made_is_proven_and_a_spiky_batch_is_not() -> None:
    results = spawn_ranks(_scenarios, world=3, timeout=300)
    for name in ("device0", "device1", "data"):  # every rank concluded the same
        assert results[0][name]["trips"] == results[1][name]["trips"] == results[2][name]["trips"], name
        assert results[0][name]["spikes"] == results[1][name]["spikes"] == results[2][name]["spikes"], name
    ours = results[0]
    for name, faulty in (("device0", 0), ("device1", 1)):
        assert results[faulty][name]["hits"] > 0 and all(
            r[name]["hits"] == 0 for i, r in enumerate(results) if i != faulty
        )
        first = ours[name]["trips"][0]
        assert first["step"] == WARMUP + 1, name
        assert (first["cause"], first["kind"], first["rank"], first["verdict"]) == (
            "hardware.faulty_device",
            "invalid",
            faulty,
            "device",
        ), name
        assert first["peer"] != faulty
        both = first["computations"]
        assert both["suspect"]["finite"] and both["peer"]["finite"]  # nothing was NaN
        assert both["suspect"]["loss"] > 100 * both["peer"]["loss"]
        assert all(t["cause"] == "hardware.faulty_device" and t["rank"] == faulty for t in ours[name]["trips"])
    data = ours["data"]
    assert data["trips"] == []  # a spiky batch is no hardware fault: the step is not skipped
    (spike,) = data["spikes"]
    assert (spike["step"], spike["verdict"], spike["suspect"]) == (WARMUP + 1, "reproduced", 2)
    assert spike["difference"] <= 1e-3
    for r in results:  # the proof left the step's gradients and state as they were
        assert r["data"]["weights"] == r["data_unproven"]["weights"]


def _sharded(rank: int, world: int) -> dict[str, Any]:
    steps = WARMUP + 6
    return {
        "device2": _run(2, steps=steps, fsdp=True),
        "data0": _run(None, spiky=0, steps=steps, fsdp=True),
        "data0_unproven": _run(None, spiky=0, steps=steps, fsdp=True, prove=False),
    }


@pytest.mark.dist
@pytest.mark.slow
def test_under_fsdp2_on_4_ranks_a_finite_fault_on_a_middle_rank_is_proven_over_a_longer_run() -> None:
    results = spawn_ranks(_sharded, world=4, timeout=600)
    for name in results[0]:
        assert all(r[name]["trips"] == results[0][name]["trips"] for r in results), name
    trips = results[0]["device2"]["trips"]
    assert [t["step"] for t in trips] == list(range(WARMUP + 1, WARMUP + 6))  # every step it stays faulty
    assert all((t["cause"], t["rank"], t["kind"]) == ("hardware.faulty_device", 2, "invalid") for t in trips)
    data = results[0]["data0"]
    assert data["trips"] == [] and [(s["verdict"], s["suspect"]) for s in data["spikes"]] == [("reproduced", 0)]
    for r in results:
        assert r["data0"]["weights"] == r["data0_unproven"]["weights"]


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([0.9, 1.1, 2.4e4], 2),
        ([3e4, 1.0, 1.2, 0.8], 0),
        ([0.9, 1.1, 1.3], None),  # batch-to-batch variation
        ([5.0, 6.0, 80.0, 90.0], None),  # two ranks apart: not one rank's
        ([1.0, 1e4], 1),
        ([-2.0, -2.5, -900.0], 2),  # a loss may be negative
        ([1.0, math.nan, 1.0], None),
        ([1.0], None),
    ],
)
def test_the_rank_that_stands_apart(values: list[float], expected: int | None) -> None:
    assert outlier(values) == expected
