"""DeepSpeed engines guarded by DeepSpeedGuard, with the real package on CPU (gloo, 2 spawned ranks):
ZeRO 1, 2 and 3, fp32, bf16 and fp16. Healthy runs are bit-identical to unguarded ones and run the
user's forward once per step; a fault on one rank is named (cause, module, rank) on every rank and
skipped through the engine (its ``skipped_steps``, its ``global_steps``); ZeRO's gradients are seen
where they live (the grad norm is not 0). Each spawned group runs several cases in sequence."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from nanguard import dist
from nanguard.integrations.loop import LoopGuard
from nanguard.zoo.spawn import spawn_ranks

pytest.importorskip("deepspeed")

from _deepspeed_ranks import run_cases, run_trainer

pytestmark = pytest.mark.dist

STEPS = 3


def _cases(stage: int, dtype: str, faults: list[tuple[str, int, int]]) -> list[dict[str, Any]]:
    base = {"stage": stage, "dtype": dtype, "steps": STEPS}
    return [base, {**base, "policy": "skip"}, *({**base, "policy": "skip", "fault": f} for f in faults)]


def _check(results: list[list[dict[str, Any]]], stage: int, dtype: str, faults: list[tuple[str, int, int]]) -> None:
    expected = {
        "data": ("data.nonfinite", "inp", "data"),
        "log": ("op.log_domain", "act", "forward"),
        "overflow": ("precision.overflow", "act", "forward"),
    }
    for rank, runs in enumerate(results):
        plain, guarded, *faulted = runs
        where = f"ZeRO-{stage} {dtype} rank {rank}"
        assert plain["error"] is None and guarded["error"] is None, where
        # Healthy: bit-identical, one forward per step, nothing skipped, ZeRO's gradients seen.
        assert guarded["weights"] == plain["weights"], where
        assert guarded["losses"] == plain["losses"], where
        assert guarded["forwards"] == plain["forwards"] == STEPS, where
        assert guarded["skipped"] == guarded["skipped_steps"] == 0, where
        assert guarded["last_grad_norm"] > 0 and math.isfinite(guarded["last_grad_norm"]), where
        for fault, run in zip(faults, faulted, strict=True):
            kind, bad_rank, step = fault
            diag = run["diagnosis"]
            assert run["error"] is None, (where, fault, run["error"])
            assert diag is not None, (where, fault)
            cause, module, phase = expected[kind]
            assert (diag["cause"], diag["module"], diag["phase"], diag["rank"]) == (cause, module, phase, bad_rank), (
                where,
                fault,
                diag,
            )
            assert diag["step"] == step
            # Skipped through the engine: counted there, the run went on to the end with finite weights.
            assert run["skipped"] == run["skipped_steps"] == 1, (where, fault)
            assert run["global_steps"] == STEPS and len(run["losses"]) == STEPS
            assert all(math.isfinite(w) for w in run["weights"]), (where, fault)
            assert run["weights"] != plain["weights"]  # the skipped step's batch left no update


def _check_scaler_overflow(results: list[list[dict[str, Any]]], bad_rank: int) -> None:
    """A backward overflow DeepSpeed's fp16 scaler skips: the guarded run is the unguarded one (the
    engine skipped it, its scale as DeepSpeed left it), and the guard named it; no skip of its own."""
    for rank, (plain, guarded) in enumerate(results):
        assert plain["error"] is None and guarded["error"] is None
        assert guarded["weights"] == plain["weights"] and guarded["scale"] == plain["scale"], rank
        assert guarded["skipped_steps"] == plain["skipped_steps"] == 1
        assert guarded["skipped"] == 0 and guarded["overflows"] == 1
        named = guarded["last_overflow"]
        assert named is not None
        assert (named["cause"], named["module"], named["phase"], named["rank"]) == (
            "precision.overflow",
            "act",
            "backward",
            bad_rank,
        )


def test_zero2_fp16_and_zero3_fp32_healthy_identical_faults_named_on_their_rank() -> None:
    plans = [
        (2, "fp16", [("data", 1, 1), ("log", 0, 1), ("overflow", 1, 2)]),
        (3, "fp32", [("log", 1, 1)]),
    ]
    cases = [case for stage, dtype, faults in plans for case in _cases(stage, dtype, faults)]
    overflow = {"stage": 2, "dtype": "fp16", "steps": STEPS, "fault": ("grad_overflow", 0, 1)}
    cases += [overflow, {**overflow, "policy": "raise"}]  # the scaler's overflow: raise does not stop the run
    cases += _rollback_cases(3, "fp32")
    results = spawn_ranks(run_cases, cases, world=2, timeout=400)
    start = 0
    for stage, dtype, faults in plans:
        n = 2 + len(faults)
        _check([runs[start : start + n] for runs in results], stage, dtype, faults)
        start += n
    _check_scaler_overflow([runs[start : start + 2] for runs in results], bad_rank=0)
    _check_rollback([runs[start + 2 :] for runs in results])


def _rollback_cases(stage: int, dtype: str) -> list[dict[str, Any]]:
    """A rollback at step 3 to the snapshot taken after step 1 (``snapshot_every=2``), beside a run that
    skips steps 2 and 3: the engine's partitions, the optimizer's state and the module alike after both."""
    base = {"stage": stage, "dtype": dtype, "steps": 5}
    options = {"snapshot_every": 2, "rollback_skip_batches": 0, "module_stats": False}
    return [
        {**base, "policy": "skip", "faults": [("data", 0, 2), ("log", 1, 3)]},
        {**base, "policy": "rollback", "fault": ("log", 1, 3), "options": options},
    ]


def _check_rollback(results: list[list[dict[str, Any]]]) -> None:
    for rank, (skipped, rolled) in enumerate(results):
        assert skipped["error"] is None and rolled["error"] is None, rank
        assert rolled["rollbacks"] == 1 and rolled["skipped"] == 0 and skipped["skipped"] == 2
        assert rolled["diagnosis"]["cause"] == "op.log_domain" and rolled["diagnosis"]["rank"] == 1
        assert rolled["weights"] == skipped["weights"], rank  # the update of step 2 rolled back
        assert rolled["global_steps"] == skipped["global_steps"] == 5


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage,dtype", [(1, "fp32"), (1, "bf16"), (2, "fp32"), (2, "bf16"), (3, "bf16"), (3, "fp16"), (0, "fp32")]
)
def test_every_stage_and_precision(stage: int, dtype: str) -> None:
    faults = [("data", 0, 1), ("log", 1, 2)]
    rollback = _rollback_cases(stage, dtype) if stage > 0 else []
    results = spawn_ranks(run_cases, _cases(stage, dtype, faults) + rollback, world=2, timeout=400)
    n = 2 + len(faults)
    _check([runs[:n] for runs in results], stage, dtype, faults)
    if rollback:
        _check_rollback([runs[n:] for runs in results])


def test_hf_trainer_with_deepspeed_zero2_through_the_callback(tmp_path) -> None:
    """The HF callback under a DeepSpeed Trainer: healthy runs as unguarded (no second backward, which
    ZeRO-2 refused with "has already been reduced"); a NaN sample on rank 1 is named and skipped through
    the engine."""
    runs = [{"stage": 2}, {"stage": 2, "policy": "skip"}, {"stage": 2, "policy": "skip", "nan_at": 6}]
    results = spawn_ranks(run_trainer, runs, str(tmp_path), world=2, timeout=400)
    for rank, (plain, guarded, faulted) in enumerate(results):
        assert guarded["losses"] == plain["losses"] and guarded["weights"] == plain["weights"], rank
        assert guarded["skipped"] == guarded["skipped_steps"] == 0
        diag = faulted["diagnosis"]
        assert diag is not None and (diag["cause"], diag["rank"], diag["step"]) == ("data.nonfinite", 1, 1)
        assert faulted["skipped"] == faulted["skipped_steps"] == 1
        assert faulted["losses"][1] is None  # the skipped step's loss is not logged as a number
        assert all(math.isfinite(w) for w in faulted["weights"])


class _OldWrapper(nn.Module):
    """A wrapper whose ``zero_grad`` takes no ``set_to_none`` (DeepSpeed's engine, older wrappers)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.cleared = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).mean()

    def zero_grad(self) -> None:  # type: ignore[override]
        self.cleared += 1
        for p in self.parameters():
            p.grad = None


def test_a_wrapper_whose_zero_grad_takes_no_set_to_none_survives_a_trip() -> None:
    model = _OldWrapper()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with LoopGuard(model, optimizer, policy="skip", module_stats=False) as guard:
        x = torch.ones(2, 4)
        x[0, 0] = float("nan")
        model(x).backward()
        optimizer.step()  # tripped: replayed (zero_grad() called plainly) and skipped
    assert guard.skipped == 1 and guard.last_diagnosis is not None
    assert guard.last_diagnosis.cause == "data.nonfinite"
    assert model.cleared >= 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    dist.zero_grad(model)  # and the helper itself calls what the object offers
    assert model.cleared >= 2
