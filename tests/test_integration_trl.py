"""TRL's SFTTrainer, DPOTrainer and GRPOTrainer under ``NanGuardCallback``: the loss the trainer
back-propagates is the one checked, replayed and logged, whatever computes it. Tiny Llama models from a
config and a tokenizer built in the test (``tests/_trl_ranks.py``); nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

from _trl_ranks import run_one, run_ranks
from nanguard.zoo.spawn import spawn_ranks

HARDWARE = {"step.not_reproduced", "distributed.transient", "hardware.faulty_device"}


def _step_losses(out_dir: Path) -> list[float]:
    lines = (out_dir / "nanguard" / "events-rank0.jsonl").read_text().splitlines()
    return [e["loss"] for e in map(json.loads, lines) if e.get("kind") == "step"]


def _named_in_the_loss(diag: dict[str, Any], cause: str, op: str, step: int) -> None:
    assert (diag["cause"], diag["op"], diag["module"], diag["phase"], diag["step"]) == (
        cause,
        op,
        None,
        "forward",
        step,
    )
    assert "unobserved" not in diag["evidence"]
    assert not any("hardware" in fix or "drain" in fix for fix in diag["fixes"])


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_sft_healthy_runs_are_bit_identical_and_nanguard_logs_the_trainers_loss(tmp_path: Path, loss_type: str) -> None:
    run = {"trainer": "sft", "accum": 2, "loss_type": loss_type}
    guarded = run_one({**run, "guard": True}, str(tmp_path / "guarded"))
    plain = run_one(run, str(tmp_path / "plain"))
    assert guarded["weights"] == plain["weights"]
    assert guarded["logged"] == plain["logged"] and len(plain["logged"]) == 4
    assert guarded["skipped"] == 0 and guarded["diagnosis"] is None
    # logging_steps=1: each step's loss in nanguard's events is the one the Trainer logged.
    assert _step_losses(tmp_path / "guarded") == pytest.approx(plain["logged"], rel=1e-6)


@pytest.mark.parametrize(
    "trainer,fault",
    [("sft", "log_func"), ("sft", "log_override"), ("dpo", "dpo_log")],
)
def test_a_custom_loss_bug_is_named_at_its_op_in_the_loss(tmp_path: Path, trainer: str, fault: str) -> None:
    """``-log(p - floor)`` with a floor past p on one batch, through ``compute_loss_func`` or a
    ``compute_loss`` override (DPO's from the policy's and the reference model's log-probs): the
    model's own loss is finite, the trained one is not."""
    result = run_one({"trainer": trainer, "fault": fault, "guard": True, "bad": 1}, str(tmp_path))
    assert result["skipped"] == 1
    _named_in_the_loss(result["diagnosis"], "op.log_domain", "aten.log.default", 1)
    assert len(result["logged"]) == 3  # the skipped step logs no loss


def test_a_nan_trained_loss_with_finite_gradients_is_tripped_and_skipped_without_a_trace(tmp_path: Path) -> None:
    """A z-loss averaged over an empty selection: NaN loss, every gradient finite (a zero-size mean's)."""
    steps, bad = 4, 1
    result = run_one({"trainer": "sft", "fault": "nan_loss", "guard": True, "bad": bad}, str(tmp_path / "g"))
    assert result["skipped"] == 1
    _named_in_the_loss(result["diagnosis"], "op.division_by_zero", "aten.mean.default", bad)

    # The same run without the bad batch, one update fewer, on the same LR schedule: the same weights.
    reference = run_one(
        {"trainer": "sft", "fault": "nan_loss", "drop": bad, "stop_after": steps - 1}, str(tmp_path / "r")
    )
    assert result["weights"] == reference["weights"]
    assert result["logged"] == reference["logged"]


def test_dpo_healthy_runs_are_bit_identical(tmp_path: Path) -> None:
    guarded = run_one({"trainer": "dpo", "guard": True, "steps": 3}, str(tmp_path / "guarded"))
    plain = run_one({"trainer": "dpo", "steps": 3}, str(tmp_path / "plain"))
    assert guarded["weights"] == plain["weights"] and guarded["logged"] == plain["logged"]
    assert guarded["skipped"] == 0


def test_grpo_healthy_is_bit_identical_and_a_nan_statistic_in_its_loss_is_skipped(tmp_path: Path) -> None:
    """GRPO generates on CPU with the model's own ``generate`` and scores with a Python reward function."""
    guarded = run_one({"trainer": "grpo", "guard": True, "steps": 3}, str(tmp_path / "guarded"))
    plain = run_one({"trainer": "grpo", "steps": 3}, str(tmp_path / "plain"))
    assert guarded["weights"] == plain["weights"] and guarded["logged"] == plain["logged"]

    faulty = run_one({"trainer": "grpo", "fault": "nan_stat", "guard": True, "bad": 1}, str(tmp_path / "faulty"))
    assert faulty["skipped"] >= 1
    diag = faulty["diagnosis"]
    assert (diag["cause"], diag["op"], diag["module"], diag["phase"]) == (
        "op.division_by_zero",
        "aten.mean.default",
        None,
        "forward",
    )


def _check_ranks(runs: list[dict[str, Any]], expected: list[tuple[str, int, int]], tmp_path: Path) -> None:
    """Every fault named on the rank that holds the bad batch, every rank skipping the step; a healthy
    guarded run (the pair after the faults) bit-identical to the unguarded one."""
    results = spawn_ranks(run_ranks, runs, str(tmp_path), world=2, timeout=600)
    for i, (cause, rank, step) in enumerate(expected):
        for r in range(2):
            diag = results[r][i]["diagnosis"]
            assert results[r][i]["skipped"] == 1, (i, r)
            assert (diag["cause"], diag["rank"], diag["ranks"], diag["step"]) == (cause, rank, [rank], step), (i, r)
            assert diag["phase"] == "forward" and diag["cause"] not in HARDWARE
        assert results[0][i]["weights"] == results[1][i]["weights"]  # the ranks stepped together
    for r in range(2):
        healthy, plain = results[r][len(expected)], results[r][len(expected) + 1]
        assert healthy["weights"] == plain["weights"] and healthy["logged"] == plain["logged"]


@pytest.mark.dist
def test_a_custom_loss_bug_and_a_nan_loss_on_two_gloo_ranks_are_named_on_their_rank(tmp_path: Path) -> None:
    """DDP over gloo, the sequential sampler dealing global batch b to rank b % 2 at step b // 2."""
    runs = [
        {"trainer": "sft", "fault": "log_func", "guard": True, "bad": 1, "steps": 2},  # rank 1, step 0
        {"trainer": "sft", "fault": "nan_loss", "guard": True, "bad": 2, "steps": 2},  # rank 0, step 1
        {"trainer": "sft", "guard": True, "steps": 2},
        {"trainer": "sft", "steps": 2},
    ]
    _check_ranks(runs, [("op.log_domain", 1, 0), ("op.division_by_zero", 0, 1)], tmp_path)


@pytest.mark.dist
@pytest.mark.slow
def test_every_fault_on_two_gloo_ranks_is_named_on_its_rank(tmp_path: Path) -> None:
    runs = [
        {"trainer": "sft", "fault": "log_func", "guard": True, "bad": 0},  # rank 0, step 0
        {"trainer": "sft", "fault": "log_override", "guard": True, "bad": 3},  # rank 1, step 1
        {"trainer": "sft", "fault": "nan_loss", "guard": True, "bad": 1},  # rank 1, step 0
        {"trainer": "dpo", "fault": "dpo_log", "guard": True, "bad": 2, "steps": 3},  # rank 0, step 1
        {"trainer": "dpo", "guard": True, "steps": 3},
        {"trainer": "dpo", "steps": 3},
    ]
    expected = [
        ("op.log_domain", 0, 0),
        ("op.log_domain", 1, 1),
        ("op.division_by_zero", 1, 0),
        ("op.log_domain", 0, 1),
    ]
    _check_ranks(runs, expected, tmp_path)
