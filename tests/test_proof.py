"""Proof, not suspicion: on a trip a peer rank re-computes the suspect rank's step, and every rank
agrees whether the step reproduces everywhere (software or data), only on the suspect's device (a
faulty device, named) or nowhere (transient). Planted with the fire drill's ``faulty_device``."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import nanguard as ng
from nanguard.guard.proof import judge
from nanguard.inject import Fault, parse
from nanguard.zoo.spawn import spawn_ranks

STEPS = 5
BAD = 3


def _batch(rank: int, step: int, log_fault_rank: int | None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    if step == BAD and rank == log_fault_rank:
        x[1, 2] = 100.0  # a rare input that the loss code below mishandles: a software fault
    return {"x": x, "y": y}


def _run(spec: str | None, *, prove: bool = True, log_fault_rank: int | None = None) -> dict[str, Any]:
    """A guarded DDP run of STEPS steps with ``spec`` planted; what the guard concluded at the trips."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ng.Guard(model, opt, policy="skip", inject=spec, prove=prove, fingerprint_every=0)
    trips = []
    for step in range(STEPS):
        batch = _batch(rank, step, log_fault_rank)

        def closure(batch: dict[str, torch.Tensor] = batch) -> torch.Tensor:
            opt.zero_grad()
            out = model(batch["x"])
            loss = nn.functional.mse_loss(out, batch["y"])
            if bool(batch["x"].max() > 50):
                loss = loss + torch.log(out.mean() - 1000.0)
            loss.backward()
            return loss

        if guard.step(closure, batch=batch) is None:
            diag = guard.last_diagnosis
            assert diag is not None
            proof = diag.evidence.get("proof") or {}
            trips.append(
                {
                    "step": step,
                    "cause": diag.cause,
                    "rank": diag.rank,
                    "verdict": proof.get("verdict"),
                    "suspect": proof.get("suspect"),
                    "peer": proof.get("peer"),
                    "computations": proof.get("computations"),
                    "suspect_where": proof.get("suspect_where"),
                    "repeat_of": diag.evidence.get("repeat_of"),
                    "text": str(diag),
                }
            )
    guard.close()
    weights = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return {"trips": trips, "weights": weights.tolist()}


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    return {
        "device0": _run(f"faulty_device@step={BAD},rank=0"),
        "device1": _run(f"faulty_device@step={BAD},rank=1"),
        "transient": _run(f"faulty_device@step={BAD},rank=1,runs=1"),
        "transient_unproven": _run(f"faulty_device@step={BAD},rank=1,runs=1", prove=False),
        "software": _run(None, log_fault_rank=2),
    }


def test_a_peer_tells_a_faulty_device_from_software_and_from_a_transient() -> None:
    results = spawn_ranks(_scenarios, world=3, timeout=300)
    for name in results[0]:  # every rank concluded the same, in every scenario
        assert [r[name]["trips"] for r in results] == [results[0][name]["trips"]] * 3, name
    ours = results[0]
    for name, faulty in (("device0", 0), ("device1", 1)):
        trips = ours[name]["trips"]
        assert [t["step"] for t in trips] == list(range(BAD, STEPS)), name  # it stays faulty
        first = trips[0]
        assert first["cause"] == "hardware.faulty_device" and first["rank"] == faulty, name
        assert first["verdict"] == "device" and first["suspect"] == faulty and first["peer"] != faulty
        assert first["suspect_where"]["rank"] == faulty and first["suspect_where"]["host"]
        both = first["computations"]
        assert not both["suspect"]["finite"] and math.isnan(both["suspect"]["loss"])
        assert both["peer"]["finite"] and math.isfinite(both["peer"]["loss"])
        assert "drain" in first["text"] and f"rank {faulty}" in first["text"]
        assert all(t["cause"] == "hardware.faulty_device" and t["rank"] == faulty for t in trips[1:]), name
    (once,) = ours["transient"]["trips"]
    assert once["step"] == BAD and once["cause"] == "distributed.transient" and once["verdict"] == "transient"
    assert once["computations"]["suspect"]["finite"] and once["computations"]["peer"]["finite"]
    # the proof left every rank's state as it found it: the run after it is bit-identical to one without
    for r in results:
        assert r["transient"]["weights"] == r["transient_unproven"]["weights"]
    (software,) = ours["software"]["trips"]
    assert software["cause"] == "op.log_domain" and software["rank"] == 2 and software["verdict"] == "everywhere"
    assert not software["computations"]["peer"]["finite"]


@pytest.mark.parametrize(
    ("suspect", "peer", "verdict"),
    [
        (
            {"loss": math.nan, "grad_norms": [1.0], "finite": False},
            {"loss": math.nan, "grad_norms": [1.0], "finite": False},
            "everywhere",
        ),
        (
            {"loss": math.nan, "grad_norms": [1.0], "finite": False},
            {"loss": 2.0, "grad_norms": [1.0], "finite": True},
            "device",
        ),
        (
            {"loss": 2.0, "grad_norms": [1.0], "finite": True},
            {"loss": 2.0, "grad_norms": [1.0 + 1e-6], "finite": True},
            "transient",
        ),
        (
            {"loss": 2.0, "grad_norms": [1.5], "finite": True},
            {"loss": 2.0, "grad_norms": [1.0], "finite": True},
            "device",
        ),
        (
            {"loss": 2.0, "grad_norms": [1.0], "finite": True},
            {"loss": math.inf, "grad_norms": [1.0], "finite": False},
            "inconclusive",
        ),
        ({"error": "RuntimeError: boom"}, {"loss": 2.0, "grad_norms": [1.0], "finite": True}, "unproven"),
        (
            {"loss": 2.0, "grad_norms": [1.0], "finite": True},
            {"loss": 2.0, "grad_norms": [1.0], "finite": True, "read": False},
            "unproven",
        ),
    ],
)
def test_the_verdict_of_two_computations(suspect: dict, peer: dict, verdict: str) -> None:
    assert judge(suspect, peer, rtol=1e-3)[0] == verdict


def test_the_faulty_device_fault_parses_and_stays_out_of_the_step_faults() -> None:
    (fault,) = parse("faulty_device@step=7,rank=2,module=0,runs=1")
    assert fault == Fault("faulty_device", step=7, rank=2, module="0", runs=1)
    assert parse(fault.spec) == [fault]
    with pytest.raises(ValueError, match="runs must be an int >= 0"):
        Fault("faulty_device", step=1, runs=-1)
    from nanguard.inject import FAULTS

    assert "faulty_device" not in FAULTS  # the drill's every-kind sets plant step faults only


def test_the_hardware_table_ranks_a_proven_faulty_device_first() -> None:
    from nanguard.hardware import FAULTY, device_rows

    def record(device: str, cause: str, reproduced: bool) -> dict[str, Any]:
        return {
            "host": "node7",
            "device": device,
            "uuid": device,
            "flagged": True,
            "reproduced": reproduced,
            "cause": cause,
        }

    rows = device_rows(
        [
            record("GPU-a", "distributed.transient", False),
            record("GPU-a", "distributed.transient", False),
            record("GPU-b", FAULTY, True),
        ]
    )
    assert [(r["id"], r["faulty"], r["transient"]) for r in rows] == [("GPU-b", 1, 0), ("GPU-a", 0, 2)]


def test_the_suspects_cuda_generators_become_the_peers_own() -> None:
    from nanguard.guard.proof import _onto_own_devices

    cpu, gpu = torch.get_rng_state(), torch.zeros(16, dtype=torch.uint8)
    model = nn.Linear(2, 2)  # on the CPU: no device of its own draws, the suspect's CUDA states are left out
    assert _onto_own_devices({"cpu": cpu, "cuda:3": gpu}, model) == {"cpu": cpu}
    if torch.cuda.is_available():
        moved = _onto_own_devices({"cpu": cpu, "cuda:3": gpu}, model.cuda())
        assert moved is not None and set(moved) == {"cpu", f"cuda:{torch.cuda.current_device()}"}
