"""OLMo-core's own ``Trainer`` (ai2-olmo-core 3.0, a tiny llama-like ``TransformerConfig``, its numpy
data loader over a token file the run writes, ``SkipStepAdamW``, clipping at 1.0, 2 micro-batches a
step) guarded by ``NanGuardCallback``: one process, and 2 gloo ranks with OLMo-core's DDP and FSDP
(``nanguard.zoo.olmo``). Each fault on rank 0 and on rank 1; healthy runs bit-identical to unguarded
ones with the same forward and backward calls.

One spawn runs every 2-rank case in sequence (each run is a second or two; the spawn and OLMo-core's
import are the cost); one spawned process runs the 1-rank cases."""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch

pytest.importorskip("olmo_core")

with warnings.catch_warnings():  # OLMo-core imports google-api-core, which warns that grpcio-status is missing
    warnings.simplefilter("ignore", ImportWarning)
    from nanguard.integrations.olmo_core import NanGuardCallback, TrainModuleGuard, _forget, _latest

_FIELDS = ("cause", "op", "module", "phase", "rank", "ranks", "step")
_MODULE = "blocks.1.feed_forward.w1"
_SLOW = {"fsdp_log_r1", "fsdp_nan_grad_r0", "fsdp_token_r0", "fsdp_embeds_r1", "ddp_rollback", "ddp_adamw_nan_grad_r1"}

_CASES: dict[str, list] = {
    "ddp_plain": ["ddp", None, 0, None],
    "ddp_guarded": ["ddp", None, 0, "skip"],
    "ddp_log_r0": ["ddp", "log", 0, "skip"],
    "ddp_log_r1": ["ddp", "log", 1, "skip"],
    "ddp_nan_grad_r0": ["ddp", "nan_grad", 0, "skip"],
    "ddp_nan_grad_r1": ["ddp", "nan_grad", 1, "skip"],
    "ddp_term_r0": ["ddp", "term", 0, "skip"],
    "ddp_term_r1": ["ddp", "term", 1, "skip"],
    "ddp_token_r0": ["ddp", "token", 0, "skip", {"options": {"check_batch": True}}],
    "ddp_token_r1": ["ddp", "token", 1, "skip", {"options": {"check_batch": True}}],
    "ddp_embeds_r0": ["ddp", "embeds", 0, "skip"],
    "ddp_embeds_r1": ["ddp", "embeds", 1, "skip"],
    "ddp_embeds_plain": ["ddp", "embeds", 0, None, {"steps": 2}],
    # LR 1e5x OLMo-core's usual: the loss grows 20,000-fold in one step and the gradients' squared
    # norm overflows float32 (OLMo-core's clip then zeroes them; its run goes on, its grad norm inf).
    "ddp_lr": ["ddp", None, 0, "skip", {"lr": 100.0, "steps": 3}],
    "fsdp_plain": ["fsdp", None, 0, None],
    "fsdp_guarded": ["fsdp", None, 0, "skip"],
    "fsdp_log_r0": ["fsdp", "log", 0, "skip"],
    "fsdp_nan_grad_r1": ["fsdp", "nan_grad", 1, "skip"],
    "fsdp_token_r1": ["fsdp", "token", 1, "skip", {"options": {"check_batch": True}}],
    "fsdp_term_r0": ["fsdp", "term", 0, "skip"],
    "fsdp_embeds_r0": ["fsdp", "embeds", 0, "skip"],
    # slow: the other rank of each FSDP fault, a rollback guard's healthy run, AdamW instead of SkipStepAdamW
    "fsdp_log_r1": ["fsdp", "log", 1, "skip"],
    "fsdp_nan_grad_r0": ["fsdp", "nan_grad", 0, "skip"],
    "fsdp_token_r0": ["fsdp", "token", 0, "skip", {"options": {"check_batch": True}}],
    "fsdp_embeds_r1": ["fsdp", "embeds", 1, "skip"],
    "ddp_rollback": ["ddp", None, 0, "rollback"],
    "ddp_adamw_nan_grad_r1": ["ddp", "nan_grad", 1, "skip", {"optim": "adamw"}],
    # Last: a run that stops on an error leaves OLMo-core's bookkeeping collectives where they were (an
    # unguarded run's NaN loss stops the ranks at different points, so it runs alone in the one-process test
    # and in benchmarks/olmo_core_compare.py).
    "ddp_log_r1_raise": ["ddp", "log", 1, "raise"],
}


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> dict[str, list[dict]]:
    from nanguard.zoo.olmo import ranks_cases
    from nanguard.zoo.spawn import spawn_ranks

    slow = os.environ.get("NANGUARD_SLOW") == "1" or "slow" in (request.config.getoption("markexpr") or "")
    names = [n for n in _CASES if slow or n not in _SLOW]
    results = spawn_ranks(ranks_cases, [_CASES[n] for n in names], world=2, timeout=600)
    return {name: [results[r][i] for r in range(2)] for i, name in enumerate(names)}


@pytest.fixture(scope="module")
def one_process() -> dict[str, dict]:
    from nanguard.zoo.olmo import single

    cases = {
        "plain": ["single", None, 0, None],
        "guarded": ["single", None, 0, "skip"],
        "log": ["single", "log", 0, "skip"],
        "nan_grad": ["single", "nan_grad", 0, "skip"],
        "nan_grad_unguarded": ["single", "nan_grad", 0, None],
    }
    return dict(zip(cases, single(list(cases.values())), strict=True))


def _diag(ranks: list[dict]) -> dict:
    """The diagnosis, the same on both ranks."""
    assert all(r["diag"] is not None for r in ranks), [(r["error"], r["skipped"], r["trips"]) for r in ranks]
    a, b = ({k: r["diag"][k] for k in _FIELDS} for r in ranks)
    assert a == b
    return a


def _losses(run: dict) -> dict[str, float]:
    return {step: m["train/CE loss"] for step, m in run["metrics"].items() if "train/CE loss" in m}


def _same_run(plain: dict, guarded: dict) -> None:
    assert guarded["error"] is None and plain["error"] is None
    assert guarded["digest"] == plain["digest"]  # weights (this rank's shards) and the RNG state
    assert guarded["forwards"] == plain["forwards"] and guarded["backwards"] == plain["backwards"]
    for step, logged in plain["metrics"].items():  # OLMo-core's own logs, value for value
        assert {k: v for k, v in guarded["metrics"][step].items() if not k.startswith("nanguard/")} == logged
    assert guarded["skipped"] == [] and guarded["diag"] is None


# -- one process ------------------------------------------------------------------------------
def test_one_process_healthy_is_identical_and_faults_are_named(one_process: dict[str, dict]) -> None:
    _same_run(one_process["plain"], one_process["guarded"])
    assert one_process["plain"]["forwards"] == 10  # the dry run's 2 micro-batches, then 2 a step
    log, grad = one_process["log"], one_process["nan_grad"]
    assert (log["diag"]["cause"], log["diag"]["module"], log["diag"]["phase"]) == ("op.log_domain", _MODULE, "forward")
    assert (grad["diag"]["cause"], grad["diag"]["module"], grad["diag"]["phase"]) == (
        "op.sqrt_domain",
        _MODULE,
        "backward",
    )
    # A skipped step is a step that never happened: both faults leave the same weights.
    assert log["skipped"] == grad["skipped"] == [3] and log["digest"] == grad["digest"] and grad["finite"]
    assert "train/CE loss" not in log["metrics"]["3"]
    # The guard's metrics with the first step and when they change (no host read of theirs on a healthy step).
    ours = {step: [m.get("nanguard/skipped"), m.get("nanguard/trips")] for step, m in log["metrics"].items()}
    assert ours == {"0": [None, None], "1": [0.0, 0.0], "2": [None, None], "3": [1.0, 1.0], "4": [None, None]}, ours
    unguarded = one_process["nan_grad_unguarded"]
    # OLMo-core alone: SkipStepAdamW (no 64 steps of history yet) applies the NaN update, every
    # parameter turns NaN, and the metrics thread stops the run at the next step's loss.
    assert not unguarded["finite"] and unguarded["error"].startswith("RuntimeError: nan loss")


# -- 2 gloo ranks -----------------------------------------------------------------------------
@pytest.mark.dist
@pytest.mark.parametrize("setup", ["ddp", "fsdp"])
def test_healthy_runs_are_bit_identical_to_unguarded_ones(runs: dict[str, list[dict]], setup: str) -> None:
    for plain, guarded in zip(runs[f"{setup}_plain"], runs[f"{setup}_guarded"], strict=True):
        _same_run(plain, guarded)
        assert plain["forwards"] == 10 and plain["steps"] == 4


@pytest.mark.dist
@pytest.mark.parametrize(
    "name", ["ddp_log_r0", "ddp_log_r1", "fsdp_log_r0", "fsdp_log_r1"], ids=lambda n: n.replace("_log", "")
)
def test_a_log_of_negatives_in_one_module_on_one_rank_is_named_there(runs: dict[str, list[dict]], name: str) -> None:
    if name not in runs:
        pytest.skip("slow variant (-m slow)")
    ranks, rank = runs[name], int(name[-1])
    assert _diag(ranks) == {
        "cause": "op.log_domain",
        "op": "aten.log.default",
        "module": _MODULE,  # OLMo-core's own module names
        "phase": "forward",
        "rank": rank,
        "ranks": [rank],
        "step": 2,  # the guard counts optimizer steps from 0: the trainer's step 3
    }
    assert [r["skipped"] for r in ranks] == [[3], [3]] and all(r["error"] is None for r in ranks)
    assert all(r["steps"] == 4 and r["finite"] for r in ranks)
    logged = [r["metrics"] for r in ranks]
    assert all("train/CE loss" not in m["3"] and math.isfinite(m["4"]["train/CE loss"]) for m in logged)


@pytest.mark.dist
@pytest.mark.parametrize("name", ["ddp_nan_grad_r0", "ddp_nan_grad_r1", "fsdp_nan_grad_r0", "fsdp_nan_grad_r1"])
def test_a_nan_gradient_made_in_one_ranks_backward_is_skipped_and_the_weights_stay_finite(
    runs: dict[str, list[dict]], name: str
) -> None:
    if name not in runs:
        pytest.skip("slow variant (-m slow)")
    ranks, rank = runs[name], int(name[-1])
    d = _diag(ranks)
    assert (d["cause"], d["module"], d["phase"], d["rank"], d["ranks"], d["step"]) == (
        "op.sqrt_domain",
        _MODULE,
        "backward",
        rank,
        [rank],
        2,
    )
    assert all(r["finite"] and r["skipped"] == [3] and r["error"] is None for r in ranks)
    # Skipped as if the step never ran: the same weights as the other fault's skip of that step.
    other = runs[name.replace("nan_grad", "log").replace(f"_r{rank}", f"_r{1 - rank}")]
    if name.startswith("ddp"):  # DDP ranks hold the same weights; FSDP shards differ per rank
        assert ranks[0]["digest"] == ranks[1]["digest"] == other[0]["digest"]


@pytest.mark.dist
@pytest.mark.parametrize("name", ["ddp_term_r0", "ddp_term_r1", "fsdp_term_r0"])
def test_a_nan_loss_with_finite_gradients_on_one_rank_reaches_every_rank_through_the_clips_norm(
    runs: dict[str, list[dict]], name: str
) -> None:
    # The guard reads OLMo-core's clip norm instead of its own all-reduce: the rank's loss seeds its backward.
    ranks, rank = runs[name], int(name[-1])
    d = _diag(ranks)
    assert (d["rank"], d["step"]) == (rank, 2), d
    assert all(r["finite"] and r["skipped"] == [3] and r["error"] is None for r in ranks)
    if name.startswith("ddp"):  # skipped as if the step never ran: the other faults' weights
        assert ranks[0]["digest"] == ranks[1]["digest"] == runs["ddp_log_r0"][0]["digest"]


@pytest.mark.dist
@pytest.mark.parametrize("setup", ["ddp", "fsdp"])
def test_a_token_id_past_the_vocabulary_on_one_rank_is_named_and_no_rank_crashes(
    runs: dict[str, list[dict]], setup: str
) -> None:
    for rank in (0, 1):
        name = f"{setup}_token_r{rank}"
        if name not in runs:
            continue
        ranks = runs[name]
        d = _diag(ranks)
        assert (d["cause"], d["phase"], d["rank"], d["ranks"], d["step"]) == (
            "data.index_out_of_range",
            "data",
            rank,
            [rank],
            2,
        )
        wheres = [f["where"] for f in ranks[rank]["diag"]["evidence"]["findings"]]
        assert "batch[0]['input_ids']" in wheres  # the micro-batch and the key: row 1 is in micro-batch 0
        assert all(r["error"] is None and r["skipped"] == [3] and r["steps"] == 4 for r in ranks)


@pytest.mark.dist
@pytest.mark.parametrize("setup", ["ddp", "fsdp"])
def test_a_nan_in_one_ranks_input_embeddings_is_data_on_that_rank(runs: dict[str, list[dict]], setup: str) -> None:
    for rank in (0, 1):
        name = f"{setup}_embeds_r{rank}"
        if name not in runs:
            continue
        ranks = runs[name]
        d = _diag(ranks)
        assert (d["cause"], d["phase"], d["rank"], d["ranks"], d["step"]) == ("data.nonfinite", "data", rank, [rank], 2)
        assert all(r["error"] is None and r["skipped"] == [3] and r["finite"] for r in ranks)
    assert runs["ddp_embeds_plain"][0]["error"] is None  # the setup itself trains under OLMo-core's DDP


@pytest.mark.dist
def test_a_far_too_high_lr_is_an_optimizer_divergence_on_every_rank(runs: dict[str, list[dict]]) -> None:
    ranks = runs["ddp_lr"]
    d = _diag(ranks)
    assert d["cause"] == "optimizer.divergence" and d["ranks"] == [0, 1]
    assert all(r["skipped"] and r["skipped"][0] == 2 and r["finite"] for r in ranks)
    for r in ranks:
        assert r["diag"]["cause"] not in ("distributed.transient", "step.not_reproduced", "hardware.faulty_device")
        assert not any("hardware" in f or "drain" in f for f in r["diag"]["fixes"])


@pytest.mark.dist
def test_policy_raise_stops_every_rank_naming_the_rank(runs: dict[str, list[dict]]) -> None:
    ranks = runs["ddp_log_r1_raise"]
    assert all(r["error"] == "NonFiniteError: op.log_domain" for r in ranks)
    assert _diag(ranks)["rank"] == 1 and all(r["steps"] == 3 for r in ranks)


@pytest.mark.dist
@pytest.mark.slow
def test_rollback_healthy_and_adamw_variants(runs: dict[str, list[dict]]) -> None:
    for plain, guarded in zip(runs["ddp_plain"], runs["ddp_rollback"], strict=True):
        _same_run(plain, guarded)
    ranks = runs["ddp_adamw_nan_grad_r1"]
    assert _diag(ranks)["rank"] == 1 and all(r["finite"] and r["skipped"] == [3] for r in ranks)


# -- the pieces, on OLMo-core's own objects ---------------------------------------------------
def test_wrong_arguments_name_what_is_accepted() -> None:
    with pytest.raises(ValueError, match="policy must be one of"):
        NanGuardCallback(policy="ignore")
    with pytest.raises(ValueError, match="unknown Guard option"):
        NanGuardCallback(polcy="skip")
    with pytest.raises(ValueError, match="train_module must be an OLMo-core train module"):
        TrainModuleGuard(object())


def test_a_skipped_steps_entries_leave_skipstepadamws_window() -> None:
    from olmo_core.optim import SkipStepAdamW

    optimizer = SkipStepAdamW([torch.nn.Parameter(torch.ones(3))], rolling_interval_length=4)
    for value in (1.0, 2.0):
        optimizer.latest_loss = torch.tensor(value)
    before = _latest(optimizer)
    optimizer.latest_loss = torch.tensor(float("nan"))
    _forget(optimizer, before, losses=True)
    assert [float(x) for x in optimizer._losses] == [1.0, 2.0]
    _forget(optimizer, before, losses=True)  # nothing new since: nothing taken
    assert len(optimizer._losses) == 2
    for value in range(6):  # a full window drops its oldest as it takes the newest
        optimizer.latest_loss = torch.tensor(float(value))
    before = _latest(optimizer)
    optimizer.latest_loss = torch.tensor(float("nan"))
    _forget(optimizer, before, losses=True)
    assert all(math.isfinite(float(x)) for x in optimizer._losses)
    assert _latest(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)) is None
