"""Megatron-core guarded by MegatronGuard, with the real package on CPU (gloo, 2 spawned ranks; the CUDA
shim lives in ``_megatron_cpu``, in the test processes only): a tiny GPT from a ``TransformerConfig``,
Megatron's DistributedDataParallel, its optimizer (the DistributedOptimizer too), its schedules
(``get_forward_backward_func``), data, tensor and pipeline parallel. Healthy runs are bit-identical
to unguarded ones with the same forwards and backwards; a fault on one rank is named (cause, module,
rank and its TP/PP/DP coordinates) on every rank and the step skipped there (``update_successful``
False on every rank); the weights stay finite where Megatron's own fp32 step applies the NaN.
Each spawned group runs several runs in sequence."""

from __future__ import annotations

import math
from typing import Any

import pytest

pytest.importorskip("megatron.core")

from _megatron_ranks import FAULT_MODULE, run_cases
from nanguard.zoo.spawn import spawn_ranks

pytestmark = pytest.mark.dist

STEPS, BAD_STEP = 3, 1

EXPECTED = {
    "data": ("data.nonfinite", None, "data"),
    "ids": ("data.index_out_of_range", None, "data"),
    "log": ("op.log_domain", FAULT_MODULE, "forward"),
    "grad": ("op.nan_write", FAULT_MODULE, "backward"),
}
"""Each fault's diagnosis: a NaN in the batch's loss mask, a token id past the vocabulary (named by the
batch check: no IndexError ends the job), ``log`` of a negative in one module, a NaN written into one
module's gradient in its backward."""


def _cases(base: dict[str, Any], faults: list[tuple[str, int]]) -> list[dict[str, Any]]:
    base = {**base, "steps": STEPS}
    runs = [base, {**base, "policy": "skip"}]
    for kind, rank in faults:
        options = {"check_batch": True} if kind == "ids" else {}
        runs.append({**base, "policy": "skip", "fault": (kind, rank, BAD_STEP), "options": options})
    return runs


def _coordinates(base: dict[str, Any], rank: int) -> dict[str, int]:
    """Where ``rank`` sits in a 2-rank world: TP 2, PP 2, or data parallel 2."""
    if base.get("tp", 1) == 2:
        return {"tp": rank, "pp": 0, "dp": 0}
    if base.get("pp", 1) == 2:
        return {"tp": 0, "pp": rank, "dp": 0}
    return {"tp": 0, "pp": 0, "dp": rank}


def _check(results: list[list[dict[str, Any]]], base: dict[str, Any], faults: list[tuple[str, int]]) -> None:
    micro = base.get("micro", 1)
    for rank, runs in enumerate(results):
        plain, guarded, *faulted = runs
        where = f"{base} rank {rank}"
        assert "error" not in plain and "error" not in guarded, (where, plain.get("error"), guarded.get("error"))
        # Healthy: bit-identical (weights, losses, Megatron's grad norms), the same forwards and backwards.
        assert guarded["weights"] == plain["weights"], where
        assert guarded["losses"] == plain["losses"], where
        assert guarded["results"] == plain["results"], where
        assert guarded["forwards"] == plain["forwards"] == STEPS * micro, where
        assert guarded["backwards"] == plain["backwards"] == STEPS * micro, where
        assert guarded["skipped"] == 0 and guarded["diagnosis"] is None, where
        for (kind, bad_rank), run in zip(faults, faulted, strict=True):
            assert "error" not in run, (where, kind, run.get("error"))
            diag = run["diagnosis"]
            assert diag is not None, (where, kind)
            cause, module, phase = EXPECTED[kind]
            got = (diag["cause"], diag["module"], diag["phase"], diag["rank"])
            assert got == (cause, module, phase, bad_rank), (where, kind, bad_rank, diag)
            assert diag["step"] == BAD_STEP, (where, kind)
            assert diag["evidence"]["parallel"] == _coordinates(base, bad_rank), (where, kind)
            # Skipped on every rank as Megatron's own fp16 skip: (False, None, None); the run went on.
            assert [r[0] for r in run["results"]] == [s != BAD_STEP for s in range(STEPS)], (where, kind)
            assert run["results"][BAD_STEP][1] is None
            assert run["skipped"] == 1 and run["finite"], (where, kind)
            assert all(math.isfinite(v) for v in run["weights"]), (where, kind)
            assert run["weights"] != plain["weights"], (where, kind)  # the skipped batch left no update
            assert "hardware" not in " ".join(run["said"]), (where, kind)


DP_FAULTS = [("data", 1), ("ids", 0), ("log", 0), ("grad", 1)]
TP, TP_FAULTS = {"tp": 2}, [("log", 1), ("grad", 0)]
PP, PP_FAULTS = {"pp": 2, "micro": 2}, [("log", 0), ("grad", 1)]
DIVERGE = {"steps": 6, "lr": 50.0, "optimizer": "sgd", "clip_grad": 0.0, "regression": True}
NAN_CHECK = {"dist_opt": True, "check_for_nan_in_grad": True, "steps": STEPS, "policy": "skip"}


@pytest.fixture(scope="module")
def runs() -> dict[str, list[list[dict[str, Any]]]]:
    """Every always-run case in one spawned group of 2 ranks (starting one costs seconds), by layout."""
    groups = {
        "dp": _cases({"dist_opt": True}, DP_FAULTS),
        "tp": _cases(TP, TP_FAULTS),
        "pp": _cases(PP, PP_FAULTS),
        "diverge": [DIVERGE, {**DIVERGE, "policy": "skip"}],
        "alone": [{"dist_opt": True, "steps": STEPS, "fault": ("grad", 1, BAD_STEP)}],
        "nan_check": [{**NAN_CHECK, "fault": ("grad", 0, BAD_STEP)}],
        "validate": [{"validate": True, "steps": STEPS, "policy": "skip", "fault": ("data", 1, BAD_STEP)}],
        # Riding Megatron's norm under TP and PP: a loss NaN only in a logged term on TP rank 0; an embedding
        # row no batch looks up NaN on PP stage 0, which computes no loss.
        "ride": [
            {**TP, "steps": STEPS, "policy": "skip", "fault": ("logged", 0, BAD_STEP)},
            {**PP, "steps": STEPS, "policy": "skip", "fault": ("nan_row", 0, 0)},
        ],
    }
    flat = [case for cases in groups.values() for case in cases]
    results = spawn_ranks(run_cases, flat, world=2, timeout=900)
    out, at = {}, 0
    for name, cases in groups.items():
        out[name] = [rank_runs[at : at + len(cases)] for rank_runs in results]
        at += len(cases)
    return out


def test_data_parallel_with_the_distributed_optimizer_faults_on_rank_0_and_1(runs: dict[str, Any]) -> None:
    """DP 2, Megatron's DDP and DistributedOptimizer, fp32: healthy identical; a NaN in rank 1's batch,
    a token id past the vocabulary on rank 0, ``log`` of a negative on rank 0, a NaN gradient on rank 1."""
    _check(runs["dp"], {"dist_opt": True}, DP_FAULTS)
    for rank, (alone,) in enumerate(runs["alone"]):  # Megatron on its own: the NaN gradient is applied
        ok, norm = alone["results"][BAD_STEP]
        assert ok is True and math.isnan(norm) and not alone["finite"], rank


def test_tensor_and_pipeline_parallel_faults_on_rank_0_and_1(runs: dict[str, Any]) -> None:
    """TP 2 (the tracer follows the values through Megatron's TP all-reduces to the rank that made
    them) and PP 2 with 2 micro-batches through Megatron's 1F1B schedule (each stage replays from what
    it received; the stage that received a non-finite value did not create it)."""
    _check(runs["tp"], TP, TP_FAULTS)
    _check(runs["pp"], PP, PP_FAULTS)


def test_a_far_too_high_lr_is_a_divergence_on_every_rank_where_megatron_applies_nan(runs: dict[str, Any]) -> None:
    """Megatron's SGD at an LR far above 2 / curvature, no clipping: unguarded, Megatron's fp32 step
    returns ``(True, nan, ...)`` and applies the NaN update; guarded, the first non-finite step is
    ``optimizer.divergence`` on every rank (never hardware), skipped, and the weights stay finite."""
    for rank, (plain, guarded) in enumerate(runs["diverge"]):
        assert "error" not in plain and "error" not in guarded, rank
        first_nan = next(i for i, r in enumerate(plain["results"]) if not math.isfinite(r[1]))
        assert plain["results"][first_nan][0] is True and not plain["finite"], rank  # Megatron stepped on NaN
        first = guarded["trips"][0]
        assert first["cause"] == "optimizer.divergence" and first["step"] == first_nan, (rank, first)
        assert all(t["cause"] == "optimizer.divergence" for t in guarded["trips"]), rank
        assert guarded["results"][:first_nan] == plain["results"][:first_nan], rank
        assert guarded["results"][first_nan][0] is False and guarded["finite"], rank
        text = " ".join(guarded["said"])
        assert "hardware" not in text and "drain" not in text, rank


def test_megatrons_check_for_nan_in_grad_is_taken_over(runs: dict[str, Any]) -> None:
    """With ``check_for_nan_in_grad`` on, Megatron raises "found NaN in local grad norm" on the rank whose
    own gradients hold the NaN (in the backward: the other rank waits in its all-reduce). Guarded, its
    local bucket norm is the guard's flag: the step is named on that rank and skipped on both."""
    for rank, (run,) in enumerate(runs["nan_check"]):
        assert "error" not in run, (rank, run.get("error"))
        diag = run["diagnosis"]
        assert (diag["cause"], diag["rank"], diag["phase"]) == ("op.nan_write", 0, "backward"), rank
        assert diag["evidence"]["flagged_ranks"] == [0], rank  # only rank 0's own gradients were non-finite
        assert [r[0] for r in run["results"]] == [s != BAD_STEP for s in range(STEPS)], rank
        assert run["finite"], rank


@pytest.mark.slow
@pytest.mark.parametrize(
    "base",
    [
        {"dtype": "bf16"},
        {"dtype": "bf16", "dist_opt": True},
        {"dist_opt": True, "dtype": "bf16", "micro": 2},
        {"tp": 2, "dtype": "bf16"},
        {"pp": 2, "micro": 2, "dtype": "bf16"},
        {},
    ],
    ids=["dp-bf16", "distopt-bf16", "distopt-bf16-accum", "tp-bf16", "pp-bf16", "dp-fp32"],
)
def test_every_fault_on_both_ranks(base: dict[str, Any]) -> None:
    """Every fault on rank 0 and on rank 1, in each parallel layout and precision."""
    faults = [(kind, rank) for kind in ("data", "ids", "log", "grad") for rank in (0, 1)]
    if base.get("pp", 1) == 2:  # the token ids enter the first stage, the loss mask the last
        faults = [(k, r) for k, r in faults if (k, r) not in (("data", 0), ("ids", 1))]
    results = spawn_ranks(run_cases, _cases(base, faults), world=2, timeout=1200)
    _check(results, base, faults)


def test_a_rerun_state_machine_validation_leaves_a_nan_loss_to_the_guard(runs: dict[str, Any]) -> None:
    """``pretrain_gpt.py``'s loss function validates the loss with Megatron's RerunStateMachine, which
    raises on a NaN (its default mode) on that rank alone. Inside the guarded loss function the guard
    decides first: the NaN in rank 1's batch is named and the step skipped on both ranks."""
    for rank, (run,) in enumerate(runs["validate"]):
        assert "error" not in run, (rank, run.get("error"))
        assert (run["diagnosis"]["cause"], run["diagnosis"]["rank"]) == ("data.nonfinite", 1), rank
        assert [r[0] for r in run["results"]] == [s != BAD_STEP for s in range(STEPS)], rank


def test_wrong_arguments_name_what_is_accepted() -> None:
    """The model must be Megatron's model chunks and the optimizer Megatron's (a torch optimizer is not)."""
    import torch

    from nanguard.integrations.megatron import MegatronGuard

    layer = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"policy must be one of \['skip', 'raise'\]"):
        MegatronGuard([layer], None, policy="rollback")
    with pytest.raises(ValueError, match="model must be Megatron's list of model chunks"):
        MegatronGuard([], torch.optim.SGD(layer.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="get_megatron_optimizer"):
        MegatronGuard([layer], torch.optim.SGD(layer.parameters(), lr=0.1))


def test_a_nan_only_in_a_logged_loss_term_on_rank_0_or_the_middle_rank_reaches_every_rank() -> None:
    """Data parallel over 3 ranks (Megatron's plain optimizer: its norm reduced over the model-parallel group
    only, after the gradient all-reduce), the guard reading that norm (``tests/test_sync_count.py`` counts a
    healthy step's collectives): a healthy guarded run is bit-identical to the unguarded one, and a loss NaN only
    in a term it logs (its gradients finite) on rank 0, then on rank 1 (the middle one), rides in that rank's
    gradients to every rank: skipped everywhere, named on its rank."""
    base = {"steps": STEPS}
    cases = [
        base,
        {**base, "policy": "skip"},
        *({**base, "policy": "skip", "fault": ("logged", r, BAD_STEP)} for r in (0, 1)),
    ]
    results = spawn_ranks(run_cases, cases, world=3, timeout=900)
    for rank, (plain, guarded, *faulted) in enumerate(results):
        assert "error" not in plain and "error" not in guarded, (rank, plain.get("error"), guarded.get("error"))
        assert guarded["weights"] == plain["weights"] and guarded["results"] == plain["results"], rank
        for bad_rank, run in zip((0, 1), faulted, strict=True):
            assert "error" not in run, run.get("error")
            diag = run["diagnosis"]
            assert diag is not None and diag["step"] == BAD_STEP, (rank, bad_rank)
            assert (diag["cause"], diag["rank"]) == ("op.log_domain", bad_rank), diag
            assert [r[0] for r in run["results"]] == [s != BAD_STEP for s in range(STEPS)], (rank, bad_rank)
            assert run["skipped"] == 1 and run["finite"]


def _check_ridden(tp_logged: dict[str, Any], pp_nan_row: dict[str, Any], where: str) -> None:
    for run in (tp_logged, pp_nan_row):
        assert "error" not in run, (where, run.get("error"))
    diag = tp_logged["diagnosis"]
    assert diag is not None and (diag["cause"], diag["rank"], diag["step"]) == ("op.log_domain", 0, BAD_STEP), diag
    assert [r[0] for r in tp_logged["results"]] == [s != BAD_STEP for s in range(STEPS)], where
    assert tp_logged["skipped"] == 1 and tp_logged["finite"], where
    (stopped,) = pp_nan_row["trips"]  # a loaded NaN is no step's to skip: every rank stops at the first step
    assert pp_nan_row["said"] == ["raised"] and pp_nan_row["results"] == [], where
    assert (stopped["cause"], stopped["phase"], stopped["rank"]) == ("parameters.nonfinite", "parameters", 0), stopped


def test_under_tp_and_pp_the_flags_ride_in_megatrons_norm_from_rank_0(runs: dict[str, Any]) -> None:
    """TP 2: rank 0's loss alone NaN (a logged term; its gradients finite) rides in its output layer's gradient
    shards into the norm Megatron reduces over the model-parallel group: skipped on both ranks, named on rank 0.
    PP 2: stage 0 computes no loss; an embedding row no batch looks up, NaN from the start, rides in the gradient
    its output receives back: both ranks stop at the first step, naming rank 0's parameters."""
    for rank, (tp_logged, pp_nan_row) in enumerate(runs["ride"]):
        _check_ridden(tp_logged, pp_nan_row, f"rank {rank}")


@pytest.mark.slow
def test_under_tp_and_pp_the_flags_ride_from_either_rank_healthy_bit_identical() -> None:
    """The long variant: TP and PP healthy bit-identical, a logged loss NaN on either TP rank, the PP stage-0 row."""
    cases = [
        *_cases(TP, [("log", 0)]),
        *_cases(PP, [("log", 1)]),
        *({**TP, "steps": STEPS, "policy": "skip", "fault": ("logged", r, BAD_STEP)} for r in (0, 1)),
        {**PP, "steps": STEPS, "policy": "skip", "fault": ("nan_row", 0, 0)},
    ]
    results = spawn_ranks(run_cases, cases, world=2, timeout=1200)
    _check([r[:3] for r in results], TP, [("log", 0)])
    _check([r[3:6] for r in results], PP, [("log", 1)])
    for rank, runs in enumerate(results):
        _check_ridden(runs[6], runs[8], f"rank {rank}")
        diag = runs[7]["diagnosis"]
        assert (diag["cause"], diag["rank"]) == ("op.log_domain", 1) and runs[7]["skipped"] == 1, (rank, diag)
