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


def _fp16_supported() -> bool:
    """Asked from DeepSpeed's accelerator, as the ranks run it (its CPU accelerator decides from the CPU)."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


FP16 = _fp16_supported()
NO_FP16 = "DeepSpeed's accelerator says fp16 is not supported here (is_fp16_supported() is False)"
needs_fp16 = pytest.mark.skipif(not FP16, reason=NO_FP16)


def _skip_unless_runnable(dtype: str) -> None:
    if dtype == "fp16" and not FP16:
        pytest.skip(NO_FP16)


# Where fp16 cannot run, ZeRO-2's faults are covered in bf16 in the same spawn.
ZERO2 = "fp16" if FP16 else "bf16"
ZERO2_FAULTS = [("data", 1, 1), ("log", 0, 1), *([("overflow", 1, 2)] if FP16 else [])]
ZERO3_FAULTS = [("log", 1, 1), ("data", 0, 2)]


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
        assert guarded["backwards"] == plain["backwards"] == STEPS, where  # the default options: no second backward
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


@pytest.fixture(scope="module")
def zero_runs() -> dict[str, list[list[dict[str, Any]]]]:
    """One spawn for the always-run ZeRO cases, each group of runs by name, per rank."""
    groups: dict[str, list[dict[str, Any]]] = {
        "zero2": _cases(2, ZERO2, ZERO2_FAULTS),
        "zero3": _cases(3, "fp32", ZERO3_FAULTS),
        "rollback": _rollback_cases(3, "fp32"),
        # Runs that never see the batch a skip dropped (step 1 for ZeRO-3's first fault, step 2 for its second).
        "never_saw": [{"stage": 3, "dtype": "fp32", "steps": STEPS, "drop": step} for step in (1, 2)],
        # ng.Guard refuses the engine; DeepSpeedGuard.step(closure) is the loop's form, healthy and faulted.
        "closure": [
            {"stage": 2, "dtype": ZERO2, "steps": STEPS, "policy": "skip", "closure": True, "refuse": True},
            {"stage": 2, "dtype": ZERO2, "steps": STEPS, "policy": "skip", "closure": True, "fault": ("log", 0, 1)},
        ],
        # The loss computed outside the model without micro_step, a NaN made by a backward alone, on each rank.
        "outside": [
            {
                "stage": 2,
                "dtype": "fp32",
                "steps": STEPS,
                "policy": "skip",
                "outside": True,
                "fault": ("grad_nan", r, 1),
            }
            for r in (0, 1)
        ],
        # NANGUARD_DISABLE=1: nothing wrapped, the run as the plain one.
        "disabled": [{"stage": 3, "dtype": "fp32", "steps": STEPS, "policy": "skip", "disabled": True}],
        # A checkpoint's NaN row loaded before deepspeed.initialize: row 3 of inp.weight is in rank 0's ZeRO-3
        # partition, row 3 of out.weight in rank 1's.
        "nan_row": [
            {"stage": 3, "dtype": "fp32", "steps": 2, "policy": "skip", "nan_row": (module, 3)}
            for module in ("inp", "out")
        ],
    }
    if FP16:
        overflow = {"stage": 2, "dtype": "fp16", "steps": STEPS, "fault": ("grad_overflow", 0, 1)}
        groups["scaler"] = [overflow, {**overflow, "policy": "raise"}]  # raise does not stop the run on it
    cases = [case for group in groups.values() for case in group]
    results = spawn_ranks(run_cases, cases, world=2, timeout=600)
    out, start = {}, 0
    for name, group in groups.items():
        out[name] = [runs[start : start + len(group)] for runs in results]
        start += len(group)
    return out


@needs_fp16
def test_zero2_fp16_and_zero3_fp32_healthy_identical_faults_named_on_their_rank(
    zero_runs: dict[str, list[list[dict[str, Any]]]],
) -> None:
    _check(zero_runs["zero2"], 2, "fp16", ZERO2_FAULTS)
    _check(zero_runs["zero3"], 3, "fp32", ZERO3_FAULTS)
    _check_scaler_overflow(zero_runs["scaler"], bad_rank=0)
    _check_rollback(zero_runs["rollback"])


@pytest.mark.skipif(FP16, reason="fp16 runs here: test_zero2_fp16_and_zero3_fp32_... covers ZeRO-2 in fp16")
def test_zero2_bf16_and_zero3_fp32_where_the_accelerator_has_no_fp16(
    zero_runs: dict[str, list[list[dict[str, Any]]]],
) -> None:
    _check(zero_runs["zero2"], 2, "bf16", ZERO2_FAULTS)
    _check(zero_runs["zero3"], 3, "fp32", ZERO3_FAULTS)
    _check_rollback(zero_runs["rollback"])


def test_every_grad_norm_the_guard_records_is_the_norm_the_engine_steps_with(
    zero_runs: dict[str, list[list[dict[str, Any]]]],
) -> None:
    """ZeRO-2 and ZeRO-3: each step event's grad norm is DeepSpeed's own global norm of that step (before
    its clip), never 0.0, on both ranks alike."""
    for name in ("zero2", "zero3"):
        for rank, runs in enumerate(zero_runs[name]):
            guarded = runs[1]
            recorded, engines = guarded["recorded_norms"], guarded["engine_norms"]
            assert len(recorded) == len(engines) == STEPS, (name, rank, recorded, engines)
            for mine, theirs in zip(recorded, engines, strict=True):
                assert theirs is not None and theirs > 0, (name, rank, engines)
                assert math.isclose(mine, theirs, rel_tol=1e-4), (name, rank, recorded, engines)
        assert zero_runs[name][0][1]["recorded_norms"] == zero_runs[name][1][1]["recorded_norms"], name


def test_a_skip_at_zero3_leaves_the_run_as_if_the_batch_was_never_seen(
    zero_runs: dict[str, list[list[dict[str, Any]]]],
) -> None:
    """The engine's partitions, the optimizer's state and its step count: the faulted run's final weights
    are those of a run that never saw the step's batches, on every rank, for a fault on rank 1 and on rank 0."""
    for rank in (0, 1):
        faulted = zero_runs["zero3"][rank][2:]
        never = zero_runs["never_saw"][rank]
        for (kind, bad_rank, step), run, without in zip(ZERO3_FAULTS, faulted, never, strict=True):
            assert run["skipped"] == 1 and run["diagnosis"]["step"] == step, (rank, kind)
            assert run["weights"] == without["weights"], (rank, kind, bad_rank)


def test_ng_guard_refuses_an_engine_and_deepspeed_guard_steps_a_closure(
    zero_runs: dict[str, list[list[dict[str, Any]]]],
) -> None:
    """``ng.Guard(engine, ...)`` read ``param.grad`` (None under ZeRO: a grad norm of 0.0), named modules
    ``module.act`` and stepped the torch optimizer behind the engine: it refuses, naming DeepSpeedGuard,
    whose ``step(closure)`` runs the same closure through the engine."""
    for rank in (0, 1):
        plain = zero_runs["zero2"][rank][0]
        healthy, faulted = zero_runs["closure"][rank]
        assert healthy["refused"] is not None and "DeepSpeedGuard" in healthy["refused"], rank
        assert healthy["error"] is None and healthy["weights"] == plain["weights"], rank
        assert healthy["losses"] == plain["losses"] and healthy["skipped"] == 0, rank
        diag = faulted["diagnosis"]
        assert (diag["cause"], diag["module"], diag["phase"], diag["rank"]) == ("op.log_domain", "act", "forward", 0)
        assert faulted["skipped"] == faulted["skipped_steps"] == 1, rank


def test_nanguard_disable_leaves_the_engine_untouched(zero_runs: dict[str, list[list[dict[str, Any]]]]) -> None:
    for rank in (0, 1):
        plain, disabled = zero_runs["zero3"][rank][0], zero_runs["disabled"][rank][0]
        assert plain["untouched"] and disabled["untouched"], rank  # no wrapped method, no hook on the engine
        assert disabled["has_guard"] is False and disabled["recorded_norms"] == [], rank
        assert (disabled["weights"], disabled["losses"]) == (plain["weights"], plain["losses"]), rank
        assert disabled["forwards"] == disabled["backwards"] == STEPS, rank


def test_a_replay_that_could_not_run_the_loss_says_what_it_could_not_see(
    zero_runs: dict[str, list[list[dict[str, Any]]]],
) -> None:
    """The replay runs the engine's forward alone (the loss is the loop's, no ``micro_step``): a NaN only the
    backward makes is not seen there, and the diagnosis says so instead of blaming the hardware."""
    for runs in zero_runs["outside"]:
        for rank, run in enumerate(runs):
            diag = run["diagnosis"]
            assert run["error"] is None and diag is not None, (rank, run["error"])
            assert diag["cause"] not in ("step.not_reproduced", "distributed.transient"), (rank, diag)
            assert diag["evidence"].get("unobserved"), (rank, diag["evidence"])
            assert not any("hardware" in f or "drain" in f for f in diag["fixes"]), (rank, diag["fixes"])
            assert not any("drain" in line for line in run["said"]), rank
            assert run["skipped"] == run["skipped_steps"] == 1, rank


def test_a_nan_row_loaded_before_initialize_at_zero3_is_named_on_every_rank(
    zero_runs: dict[str, list[list[dict[str, Any]]]],
) -> None:
    """No skip repairs loaded weights: every rank stops together, naming the row, its module and the rank
    whose ZeRO-3 partition holds it (rank 0 for inp's row 3, rank 1 for out's)."""
    for (module, owner), runs in zip([("inp", 0), ("out", 1)], zip(*zero_runs["nan_row"], strict=True), strict=True):
        for rank, run in enumerate(runs):
            assert run["error"] is not None and run["error"].startswith("NonFiniteError"), (module, rank, run["error"])
            diag = run["diagnosis"]
            assert (diag["cause"], diag["phase"], diag["module"], diag["rank"]) == (
                "parameters.nonfinite",
                "parameters",
                module,
                owner,
            ), (module, rank, diag)
            assert diag["evidence"]["rows"] == [3], (module, rank, diag["evidence"])


# -- a far too high LR: the run diverges, and is named a divergence ------------------------------
# Least squares (tests/_deepspeed_ranks.Regression), plain SGD, DeepSpeed's gradient clipping off: at an
# LR whose product with the smallest curvature of every step's batches is past 2, each step multiplies
# the error in every direction (by >= 3x here), whatever the seed, until float32 overflows.
DIVERGING = {
    # the squared errors averaged: the loss overflows first, in the forward
    "forward": {"model": "regression", "lr": 30.0, "steps": 17, "trip": 16},
    # summed: the gradients' norm over the ranks passes float32's squared range first, every loss finite
    "backward": {"model": "regression_sum", "lr": 0.3, "steps": 15, "trip": 14},
}


def _diverging(stage: int, dtype: str, where: str) -> dict[str, Any]:
    plan = DIVERGING[where]
    return {"stage": stage, "dtype": dtype, "sgd": True, "clip": 0.0, "policy": "skip", **plan}


def _every_direction_expands(plan: dict[str, Any]) -> bool:
    """The setup's claim, from the batches themselves: lr x the smallest eigenvalue of each step's
    Hessian (both ranks' batches averaged, as ZeRO averages the gradients) is past 2."""
    from _deepspeed_ranks import batch

    total = plan["model"] == "regression_sum"
    for step in range(plan["steps"]):
        hessian = torch.zeros(9, 9, dtype=torch.float64)
        for rank in range(2):
            x, _ = batch(rank, step, "fp32", 32)
            a = torch.cat([x, torch.ones(32, 1)], 1).double()
            hessian += 2 * a.T @ a / (1 if total else a.shape[0] * 4) / 2
        if plan["lr"] * float(torch.linalg.eigvalsh(hessian)[0]) <= 2:
            return False
    return True


def _check_divergence(results: list[dict[str, Any]], where: str, label: str) -> None:
    """Named ``optimizer.divergence`` at the step it overflowed, the same verdict on every rank, no
    word of hardware; skipped through the engine, the weights left finite."""
    plan = DIVERGING[where]
    verdicts = []
    for rank, run in enumerate(results):
        at = f"{label} rank {rank}"
        assert run["error"] is None, (at, run["error"])
        assert run["trip_diagnoses"], (at, run["losses"])
        first = run["trip_diagnoses"][0]
        assert first["cause"] == "optimizer.divergence", (at, first["cause"], first["evidence"].get("why"))
        assert (first["step"], first["phase"]) == (plan["trip"], where), (at, first)
        assert all(d["cause"] == "optimizer.divergence" for d in run["trip_diagnoses"]), at
        losses = run["losses"]
        assert all(math.isfinite(v) for v in losses[: plan["trip"]]), at  # it grew, finite, up to the trip
        assert losses[plan["trip"] - 1] > 1e30 * losses[0], at
        assert math.isfinite(losses[plan["trip"]]) == (where == "backward"), at
        assert run["skipped"] == run["skipped_steps"] == plan["steps"] - plan["trip"], at
        assert all(math.isfinite(w) for w in run["weights"]), at
        text = " ".join(
            [*run["said"], *(d["evidence"].get("why", "") + " ".join(d["fixes"]) for d in run["trip_diagnoses"])]
        )
        assert "drain" not in text and "hardware" not in text, at
        verdicts.append(
            [
                {k: d[k] for k in ("cause", "phase", "op", "module", "rank", "ranks", "step")}
                for d in run["trip_diagnoses"]
            ]
        )
    assert verdicts[0] == verdicts[1], label


@pytest.mark.parametrize("where", list(DIVERGING))
def test_the_diverging_setups_expand_every_direction(where: str) -> None:
    assert _every_direction_expands(DIVERGING[where])


@pytest.fixture(scope="module")
def diverging_runs() -> list[list[dict[str, Any]]]:
    """ZeRO-2 runs at a far too high LR, in one spawn: fp32 forward and backward, auto, and fp16 where it runs."""
    auto = {**_diverging(2, "fp32", "forward"), "policy": "auto", "steps": 19}
    fp16 = [{**_diverging(2, "fp16", "forward"), "steps": 9}] if FP16 else []
    cases = [_diverging(2, "fp32", "forward"), _diverging(2, "fp32", "backward"), *fp16, auto]
    results = spawn_ranks(run_cases, cases, world=2, timeout=400)
    runs = [[ranks[i] for ranks in results] for i in range(len(cases))]
    return [*runs[:2], runs[-1], *runs[2:-1]]  # forward, backward, auto, then fp16 where it ran


@needs_fp16
def test_an_lr_far_too_high_under_zero2_is_named_a_divergence_on_every_rank(
    diverging_runs: list[list[dict[str, Any]]],
) -> None:
    """ZeRO-2: the forward overflow (loss Inf) and the backward one (every loss finite, the gradient
    norm past float32) are both ``optimizer.divergence``; under fp16, the gradient overflows DeepSpeed's
    scaler skips while the loss grows are named a divergence too, not a float16 range problem."""
    _check_divergence(diverging_runs[0], "forward", "ZeRO-2 fp32")
    _check_divergence(diverging_runs[1], "backward", "ZeRO-2 fp32")
    _check_fp16_divergence(diverging_runs[3])
    _check_auto_remedy(diverging_runs[2])


@pytest.mark.skipif(FP16, reason="fp16 runs here: test_an_lr_far_too_high_under_zero2_... covers fp32 with it")
def test_an_lr_far_too_high_under_zero2_in_fp32_where_the_accelerator_has_no_fp16(
    diverging_runs: list[list[dict[str, Any]]],
) -> None:
    _check_divergence(diverging_runs[0], "forward", "ZeRO-2 fp32")
    _check_divergence(diverging_runs[1], "backward", "ZeRO-2 fp32")
    _check_auto_remedy(diverging_runs[2])


def _check_auto_remedy(results: list[dict[str, Any]]) -> None:
    """``policy="auto"``: the divergence's remedy runs through the engine: rolled back to a snapshot from
    before the growth, the engine's LR halved, every rank alike."""
    trip = DIVERGING["forward"]["trip"]
    for rank, run in enumerate(results):
        assert run["error"] is None, (rank, run["error"])
        assert run["trip_diagnoses"][0]["cause"] == "optimizer.divergence" and run["rollbacks"] == 1, rank
        assert run["lr"] == DIVERGING["forward"]["lr"] / 2, rank
        losses = run["losses"]
        assert losses[trip + 1] < 100 * losses[0] and all(math.isfinite(v) for v in losses[trip + 1 :]), rank
    assert [run["rollbacks"] for run in results] == [1, 1]


def _check_fp16_divergence(results: list[dict[str, Any]]) -> None:
    named = []
    for rank, run in enumerate(results):
        assert run["error"] is None, (rank, run["error"])
        overflow = run["last_overflow"]  # DeepSpeed's scaler skipped the gradients' overflow: the guard named it
        assert overflow is not None and run["overflows"] >= 1, rank
        assert (overflow["cause"], overflow["phase"], overflow["module"]) == ("optimizer.divergence", "backward", "fc")
        assert overflow["evidence"]["op_cause"] == "precision.overflow"  # the op's own verdict, kept
        assert all(math.isfinite(v) for v in run["losses"][: overflow["step"] + 1])  # every loss finite
        first = run["trip_diagnoses"][0]  # the first named: an overflow, the same verdict
        assert first["cause"] == "optimizer.divergence" and first["phase"] == "backward", rank
        assert all(d["cause"] == "optimizer.divergence" for d in run["trip_diagnoses"]), rank
        text = " ".join(run["said"])
        assert "drain" not in text and "hardware" not in text, rank
        named.append([(d["cause"], d["phase"], d["rank"], d["step"]) for d in run["trip_diagnoses"]])
    assert named[0] == named[1]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_an_lr_far_too_high_is_named_a_divergence_at_zero1_and_zero3(stage: int) -> None:
    cases = [_diverging(stage, "fp32", "forward"), _diverging(stage, "fp32", "backward")]
    results = spawn_ranks(run_cases, cases, world=2, timeout=400)
    _check_divergence([runs[0] for runs in results], "forward", f"ZeRO-{stage} fp32")
    _check_divergence([runs[1] for runs in results], "backward", f"ZeRO-{stage} fp32")


# -- DeepSpeed's gradient accumulation (gradient_accumulation_steps > 1) ---------------------------
ACCUM = 2


# DeepSpeed builds this one from its config (torch's AdamW: no C++ op to build).
CONFIG_ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}


def _accumulation_cases(stage: int, dtype: str, **extra: Any) -> list[dict[str, Any]]:
    """Healthy unguarded and guarded; a NaN in the second micro-batch of step 1 on rank 1; ``log`` of a
    negative in step 2 on rank 0 (every micro-batch of it: the module's fault is a switch the replay, at
    the step's end, must find as the step's micro-batches did)."""
    base = {"stage": stage, "dtype": dtype, "steps": STEPS, "accum": ACCUM, **extra}
    faults = [("data", 1, 1, 1), ("log", 0, 2)]
    return [base, {**base, "policy": "skip"}, *({**base, "policy": "skip", "fault": f} for f in faults)]


def _check_accumulation(results: list[list[dict[str, Any]]], label: str) -> None:
    expected = {"data": ("data.nonfinite", "inp", "data"), "log": ("op.log_domain", "act", "forward")}
    faults = [("data", 1, 1), ("log", 0, 2)]
    for rank, (plain, guarded, *faulted) in enumerate(results):
        where = f"{label} rank {rank}"
        assert plain["error"] is None and guarded["error"] is None, (where, plain["error"], guarded["error"])
        # Healthy: bit-identical; the user's forward and backward once per micro-batch, no more.
        assert guarded["weights"] == plain["weights"] and guarded["losses"] == plain["losses"], where
        assert guarded["forwards"] == guarded["backwards"] == plain["backwards"] == STEPS * ACCUM, where
        assert guarded["global_steps"] == plain["global_steps"] == STEPS, where
        assert guarded["skipped"] == guarded["skipped_steps"] == 0, where
        for (kind, bad, step), run in zip(faults, faulted, strict=True):
            diag = run["diagnosis"]
            assert run["error"] is None and diag is not None, (where, kind, run["error"])
            cause, module, phase = expected[kind]
            # Named on the faulted rank alone, at the step (not the micro-batch) it happened in.
            assert (diag["cause"], diag["module"], diag["phase"]) == (cause, module, phase), (where, diag)
            assert (diag["rank"], diag["ranks"], diag["step"]) == (bad, [bad], step), (where, diag)
            assert run["skipped"] == run["skipped_steps"] == 1 and run["global_steps"] == STEPS, (where, kind)
            assert run["weights"] != plain["weights"] and all(math.isfinite(w) for w in run["weights"]), where


def test_gradient_accumulation_and_the_configs_optimizer_under_zero2() -> None:
    """ZeRO-2, 2 accumulation steps, the optimizer DeepSpeed builds from its config's "optimizer" section:
    healthy identical, one forward and backward per micro-batch, faults named on their rank alone."""
    cases = _accumulation_cases(2, "fp32", ds_optimizer=CONFIG_ADAMW)
    results = spawn_ranks(run_cases, cases, world=2, timeout=400)
    _check_accumulation(results, "ZeRO-2 fp32 accumulation 2, config optimizer")


@pytest.mark.slow
@pytest.mark.parametrize("stage,dtype", [(1, "bf16"), (3, "fp32"), (3, "fp16")])
def test_gradient_accumulation_at_every_stage(stage: int, dtype: str) -> None:
    _skip_unless_runnable(dtype)
    results = spawn_ranks(run_cases, _accumulation_cases(stage, dtype), world=2, timeout=400)
    _check_accumulation(results, f"ZeRO-{stage} {dtype} accumulation 2")


def _rollback_cases(stage: int, dtype: str, **extra: Any) -> list[dict[str, Any]]:
    """A rollback at step 3 to the snapshot taken after step 1 (``snapshot_every=2``), beside a run that
    skips steps 2 and 3: the engine's partitions, the optimizer's state and the module alike after both."""
    base = {"stage": stage, "dtype": dtype, "steps": 5, **extra}
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
    _skip_unless_runnable(dtype)
    faults = [("data", 0, 1), ("log", 1, 2)]
    rollback = _rollback_cases(stage, dtype) if stage > 0 else []
    results = spawn_ranks(run_cases, _cases(stage, dtype, faults) + rollback, world=2, timeout=400)
    n = 2 + len(faults)
    _check([runs[:n] for runs in results], stage, dtype, faults)
    if rollback:
        _check_rollback([runs[n:] for runs in results])


def _trainer_runs(stage: int, dtype: str, accum: int, nan_at: int) -> list[dict[str, Any]]:
    base = {"stage": stage, "dtype": dtype, "accum": accum}
    return [base, {**base, "policy": "skip"}, {**base, "policy": "skip", "nan_at": nan_at}]


def _check_trainer(results: list[list[dict[str, Any]]], engine: list[Any], accum: int) -> None:
    for rank, (plain, guarded, faulted) in enumerate(results):
        assert plain["engine"] == guarded["engine"] == engine and guarded["accum"] == accum, rank  # the config took
        assert guarded["losses"] == plain["losses"] and guarded["weights"] == plain["weights"], rank
        assert guarded["skipped"] == guarded["skipped_steps"] == plain["skipped_steps"] == 0
        diag = faulted["diagnosis"]
        assert diag is not None and (diag["cause"], diag["rank"], diag["ranks"], diag["step"]) == (
            "data.nonfinite",
            1,
            [1],
            0 if accum > 1 else 1,
        ), (rank, diag)
        assert faulted["skipped"] == faulted["skipped_steps"] == 1
        assert faulted["losses"][diag["step"]] is None  # the skipped step's loss is not logged as a number
        assert all(math.isfinite(w) for w in faulted["weights"])


# -- ZeRO's optimizer offloaded to the CPU: DeepSpeedCPUAdam, from the config ---------------------
@pytest.mark.slow
@pytest.mark.parametrize("stage,dtype", [(1, "bf16"), (2, "fp16"), (2, "fp32"), (3, "fp32")])
def test_offload_optimizer_to_cpu_with_deepspeeds_cpu_adam(stage: int, dtype: str) -> None:
    """``offload_optimizer: {device: cpu}``: ZeRO-1/2 keep the gradients in the fp32 partitions' ``.grad``
    (persistent buffers: a skip must leave them, or the next backward fails), ZeRO-3 in its flat buffer.
    Healthy identical, faults on rank 0 and rank 1 named there and skipped through the engine, a rollback
    through DeepSpeedCPUAdam's state. Builds DeepSpeed's cpu_adam op on first use (minutes; cached in the
    virtualenv's torch_extensions)."""
    _skip_unless_runnable(dtype)
    extra = {"ds_optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "offload": True}
    faults = [("data", 1, 1), ("log", 0, 2)]
    cases = [{**case, **extra} for case in _cases(stage, dtype, faults)] + _rollback_cases(stage, dtype, **extra)
    results = spawn_ranks(run_cases, cases, world=2, timeout=1200)
    n = 2 + len(faults)
    _check([runs[:n] for runs in results], stage, dtype, faults)
    _check_rollback([runs[n:] for runs in results])


@needs_fp16
def test_hf_trainer_with_deepspeed_zero3_fp16_and_accumulation_through_the_callback(tmp_path) -> None:
    """The HF callback under a DeepSpeed Trainer at ZeRO-3, fp16, 2 accumulation steps: healthy runs as
    unguarded (no second backward: ZeRO-3's ranks disagreed on a collective and hung, ZeRO-2 refused with
    "has already been reduced"); a NaN sample on rank 1 is named there and skipped through the engine."""
    results = spawn_ranks(run_trainer, _trainer_runs(3, "fp16", 2, 6), str(tmp_path), world=2, timeout=400)
    _check_trainer(results, [3, True, False], 2)


@pytest.mark.skipif(FP16, reason="fp16 runs here: test_hf_trainer_with_deepspeed_zero3_fp16_... covers it")
def test_hf_trainer_with_deepspeed_zero3_bf16_where_the_accelerator_has_no_fp16(tmp_path) -> None:
    results = spawn_ranks(run_trainer, _trainer_runs(3, "bf16", 2, 6), str(tmp_path), world=2, timeout=400)
    _check_trainer(results, [3, False, True], 2)


@pytest.mark.slow
@pytest.mark.parametrize("stage,dtype,accum", [(2, "fp32", 1), (3, "bf16", 2), (1, "fp16", 2)])
def test_hf_trainer_with_deepspeed_at_other_stages(tmp_path, stage: int, dtype: str, accum: int) -> None:
    _skip_unless_runnable(dtype)
    runs = _trainer_runs(stage, dtype, accum, 6)
    results = spawn_ranks(run_trainer, runs, str(tmp_path), world=2, timeout=400)
    _check_trainer(results, [stage, dtype == "fp16", dtype == "bf16"], accum)


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


def _logged_fault_runs(healthy: list[int], faults: list[tuple[int, int]]) -> None:
    """ZeRO stages (fp32, ``gradient_clipping`` 1.0) on 3 ranks in one spawn, the guard reading the global grad
    norm the engine reduces for its own clip (``tests/test_sync_count.py`` counts a healthy step's collectives):
    for each ``healthy`` stage, a guarded run bit-identical to the unguarded one; for each ``(stage, rank)`` of
    ``faults``, a loss that is NaN only in a term it logs (its gradients finite) on that rank reaches every rank
    through that reduction: skipped everywhere, named on its rank."""
    cases = []
    for stage in healthy:
        base = {"stage": stage, "dtype": "fp32", "steps": STEPS, "clip": 1.0}
        cases += [base, {**base, "policy": "skip"}]
    for stage, bad_rank in faults:
        cases.append({"stage": stage, "dtype": "fp32", "steps": STEPS, "clip": 1.0, "policy": "skip",
                      "fault": ("logged", bad_rank, 1)})  # fmt: skip
    results = spawn_ranks(run_cases, cases, world=3, timeout=600)
    for rank, runs in enumerate(results):
        for at, stage in enumerate(healthy):
            plain, guarded = runs[2 * at : 2 * at + 2]
            where = f"ZeRO-{stage} rank {rank}"
            assert plain["error"] is None and guarded["error"] is None, (where, plain["error"], guarded["error"])
            assert guarded["weights"] == plain["weights"] and guarded["losses"] == plain["losses"], where
            assert guarded["skipped"] == 0, where
        for (stage, bad_rank), run in zip(faults, runs[2 * len(healthy) :], strict=True):
            where = f"ZeRO-{stage}, NaN on rank {bad_rank}, seen on rank {rank}"
            diag = run["diagnosis"]
            assert run["error"] is None, (where, run["error"])
            assert run["skipped"] == run["skipped_steps"] == 1, where
            assert diag is not None and diag["step"] == 1, where
            assert (diag["cause"], diag["module"], diag["rank"]) == ("op.log_domain", "act", bad_rank), (where, diag)
            assert all(math.isfinite(w) for w in run["weights"]), where


def test_zero2_a_loss_nan_only_in_a_logged_term_on_rank_0_or_the_middle_rank_reaches_every_rank() -> None:
    """ZeRO-2 rides ``scaled_global_norm``: healthy bit-identical, a logged NaN on rank 0 then on rank 1 (the
    middle one) skipped everywhere (``_logged_fault_runs``)."""
    _logged_fault_runs([2], [(2, 0), (2, 1)])


def test_zero0_and_zero3_a_loss_nan_only_in_a_logged_term_reaches_every_rank() -> None:
    """ZeRO-0 rides its fp32 clip's norm, ZeRO-3 its groups' norms: a logged NaN on the middle rank under ZeRO-0,
    on rank 0 under ZeRO-3, skipped everywhere (the other ranks and the healthy runs: the slow variant)."""
    _logged_fault_runs([], [(0, 1), (3, 0)])


@pytest.mark.slow
def test_zero0_and_zero3_healthy_identical_and_a_logged_nan_on_either_rank_reaches_every_rank() -> None:
    """ZeRO-0 and ZeRO-3 healthy at 3 ranks, and the other rank of each stage. Only the elements that hold
    the parameters' values are compared: ZeRO-3's padding on the last rank is uninitialized memory, which
    differs between any two runs, guarded or not."""
    _logged_fault_runs([0, 3], [(0, 0), (3, 1)])


def test_zero3_padding_that_holds_nan_is_no_parameter_of_the_run() -> None:
    """At 3 ranks each of the MLP's parameters is padded to a multiple of 3 at the end of the last rank's
    partition, memory DeepSpeed allocates with ``torch.empty`` and never reads. NaN there (what a GPU's
    allocator can hand out again) is no fault of the run: the guarded run steps as the unguarded one does."""
    cases, dtypes = [], ["fp32", "bf16"]  # bf16: ZeRO's fp32 partitions are a copy of the bit16 ones, padding too
    for dtype in dtypes:
        base = {"stage": 3, "dtype": dtype, "steps": 3, "clip": 1.0, "padding": float("nan")}
        cases += [base, {**base, "policy": "skip"}]
    results = spawn_ranks(run_cases, cases, world=3, timeout=600)
    for rank, runs in enumerate(results):
        for dtype, plain, guarded in zip(dtypes, runs[::2], runs[1::2], strict=True):
            where = (rank, dtype)
            assert plain["error"] is None and guarded["error"] is None, (where, plain["error"], guarded["error"])
            assert guarded["trip_diagnoses"] == [] and guarded["skipped"] == 0, (where, guarded["trip_diagnoses"])
            assert guarded["weights"] == plain["weights"] and guarded["losses"] == plain["losses"], where
            assert all(math.isfinite(w) for w in guarded["weights"]), where
            assert len(guarded["weights"]) == 73 - (rank == 2) * 7, where  # 208 parameters: 73 a rank, 7 padding


def test_zero3_real_elements_are_the_runs_before_each_parameters_padding() -> None:
    """The layout the guard reads ZeRO-3's partitions by, on a stand-in: a rank's flat partition holds each
    parameter's partition in order, the last ranks' ending in padding; a layout that does not add up, or a
    parameter DeepSpeed describes otherwise, leaves the partition read whole (as before)."""
    from types import SimpleNamespace

    from nanguard.integrations.deepspeed import _unpadded

    def param(numel: int, world: int = 3) -> SimpleNamespace:
        size = -(-numel // world)
        return SimpleNamespace(ds_numel=numel, partition_numel=lambda: size)

    params = [param(128), param(16), param(64), param(4)]  # partitions of 43, 6, 22 and 2 elements
    flat = torch.arange(73.0)
    for rank, runs in [(0, [(0, 73)]), (2, [(0, 42), (43, 47), (49, 69)])]:
        zero = SimpleNamespace(fp16_groups=[params], fp32_partitioned_groups_flat=[flat])
        zero._get_param_partition_rank = lambda p, rank=rank: rank
        got = _unpadded(zero)
        assert [(int(t[0]), int(t[-1]) + 1) for t in got] == runs, rank
        assert all(t.data_ptr() >= flat.data_ptr() and t._base is flat for t in got if t is not flat)
    short = flat[:70]  # 3 elements fewer than the partitions: not this layout
    zero = SimpleNamespace(fp16_groups=[params], fp32_partitioned_groups_flat=[short], _get_param_partition_rank=None)
    zero._get_param_partition_rank = lambda p: 2
    assert [t is short for t in _unpadded(zero)] == [True]
    odd = SimpleNamespace(fp16_groups=[[object()]], fp32_partitioned_groups_flat=[flat])  # no partition_numel
    assert [t is flat for t in _unpadded(odd)] == [True]
