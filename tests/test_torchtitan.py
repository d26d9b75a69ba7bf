"""torchtitan's real components (its llama3 model from a shrunk debug config, ``parallelize_llama``
for FSDP2 dp_shard=2 and TP=2, its chunked loss that runs backward itself and toggles FSDP sync,
its optimizer and scheduler containers) driven as its ``train_step`` drives them on 2 gloo ranks,
guarded by ``TitanGuard``; and the rule that a replay which could not see the whole step never
blames the hardware (one process).

One spawn runs every distributed case in sequence (each build is a few seconds; the spawn and
torchtitan's import are the cost)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nanguard as ng
from nanguard.diagnose import transient_fault
from nanguard.integrations.loop import LoopGuard

pytest.importorskip("torchtitan")

_FIELDS = ("cause", "op", "module", "phase", "rank", "ranks", "step")


def _cases(rank: int, world: int, cases: list[list]) -> list[dict]:
    """Each case on this rank: ``[setup, fault, fault_rank, policy, options]``; a setup named
    ``trainer:fsdp`` / ``trainer:tp`` runs torchtitan's own ``Trainer``."""
    from nanguard.zoo.titan import titan_rank
    from nanguard.zoo.titan_trainer import trainer_rank

    out = []
    for setup, *rest in cases:
        run = trainer_rank if setup.startswith("trainer:") else titan_rank
        out.append(run(rank, world, setup.removeprefix("trainer:"), *rest[:3], **(rest[3] if len(rest) > 3 else {})))
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    from nanguard.zoo.spawn import spawn_ranks

    cases = {
        "fsdp_plain": ["fsdp", None, 0, None],
        "fsdp_guarded": ["fsdp", None, 0, "skip"],
        "fsdp_sqrt_rank0": ["fsdp", "sqrt", 0, "skip"],
        "fsdp_token_rank1": ["fsdp", "token", 1, "skip", {"check_batch": True}],
        "fsdp_nan_row": ["fsdp", "nan_row", 1, "skip", {"steps": 1}],
        "fsdp_sqrt_grad_rank1": ["fsdp", "sqrt_grad", 1, "skip"],
        "fsdp_rollback": ["fsdp", None, 0, "rollback"],
        "tp_sqrt_rank0_raise": ["tp", "sqrt", 0, "raise"],
        "tp_plain": ["tp", None, 0, None],
        "tp_guarded": ["tp", None, 0, "skip"],
        "tp_sqrt_rank1": ["tp", "sqrt", 1, "skip"],
        # LR 1e5x torchtitan's: the loss grows a million-fold, the outputs saturate (no gradient
        # for a few updates while AdamW's momentum keeps pushing), then NaN.
        "fsdp_lr_too_high": ["fsdp", None, 0, "skip", {"lr": 100.0, "steps": 9}],
        # torchtitan's own Trainer, end to end (trainer.train()): its bf16 FSDP mixed precision,
        # its activation checkpointing, its metrics and step loop.
        "trainer_fsdp_plain": ["trainer:fsdp", None, 0, None],
        "trainer_fsdp_guarded": ["trainer:fsdp", None, 0, "skip"],
        "trainer_fsdp_sqrt_rank1": ["trainer:fsdp", "sqrt", 1, "skip"],
        "trainer_tp_sqrt_rank1": ["trainer:tp", "sqrt", 1, "skip"],
        # PP: 2 stages on 2 ranks under torchtitan's 1F1B schedule (torch.distributed.pipelining).
        "trainer_pp_plain": ["trainer:pp", None, 0, None],
        "trainer_pp_guarded": ["trainer:pp", None, 0, "skip"],
        "trainer_pp_sqrt_rank1": ["trainer:pp", "sqrt", 1, "skip"],
        # The integration as documented, no option: a token id past the vocabulary is named and skipped.
        "trainer_fsdp_token_rank1": ["trainer:fsdp", "token", 1, "skip"],
        "tp_token_rank0": ["tp", "token", 0, "skip"],  # TP's vocab-parallel embedding would read a zero row
        # The plain cross-entropy loss under TP, a sqrt of negatives in rank 1's attention.
        "trainer_tp_ce_attention_rank1": ["trainer:tp", "attn_sqrt", 1, "skip", {"loss": "ce"}],
        # guard.loss left out: the replay cannot run the loss and its backward; a backward fault on rank 0.
        "fsdp_sqrt_grad_unwrapped_rank0": ["fsdp", "sqrt_grad", 0, "skip", {"wrap_loss": False}],
        "fsdp_disabled": ["fsdp", None, 0, "skip", {"disabled": True}],
        # FSDP2 reading the clip's norm: a token id past the vocabulary on rank 0, no check_batch (its loss alone NaN).
        "fsdp_token_rank0": ["fsdp", "token", 0, "skip"],
        # The Trainer under TP reading its clip's norm: rank 0's loss alone NaN (its ids made valid).
        "trainer_tp_token_rank0": ["trainer:tp", "token", 0, "skip"],
        # The Trainer under PP: stage 0 (no loss) holds an embedding row NaN that no batch looks up.
        "trainer_pp_nan_row_rank0": ["trainer:pp", "nan_row", 0, "skip", {"steps": 2}],
    }
    results = spawn_ranks(_cases, list(cases.values()), world=2, timeout=420)
    return {name: [results[r][i] for r in range(2)] for i, name in enumerate(cases)}


def _diag(ranks: list[dict]) -> dict:
    """The diagnosis, the same on both ranks."""
    a, b = ({k: r["diag"][k] for k in _FIELDS} for r in ranks)
    assert a == b
    return a


@pytest.mark.dist
@pytest.mark.parametrize("setup", ["fsdp", "tp"])
def test_healthy_runs_are_bit_identical_to_unguarded_ones(runs: dict[str, list[dict]], setup: str) -> None:
    for plain, guarded in zip(runs[f"{setup}_plain"], runs[f"{setup}_guarded"], strict=True):
        assert guarded["digest"] == plain["digest"]
        assert guarded["losses"] == plain["losses"]  # torchtitan's logged loss and grad norm unchanged
        assert guarded["norms"] == plain["norms"]
        assert guarded["skipped"] == [] and guarded["diag"] is None
        assert guarded["forwards"] == plain["forwards"] == 4  # the trainer's forward and backward once a step


@pytest.mark.dist
def test_torchtitans_own_trainer_guarded_is_bit_identical_and_runs_one_backward_a_step(
    runs: dict[str, list[dict]],
) -> None:
    for plain, guarded in zip(runs["trainer_fsdp_plain"], runs["trainer_fsdp_guarded"], strict=True):
        assert guarded["steps"] == plain["steps"] == 4
        assert guarded["digest"] == plain["digest"]
        assert guarded["losses"] == plain["losses"] and len(plain["losses"]) == 4  # as torchtitan logs them
        assert guarded["norms"] == plain["norms"]
        assert guarded["forwards"] == plain["forwards"] == 4
        # Every Tensor.backward the trainer runs (its chunked loss runs some itself), no more.
        assert guarded["backwards"] == plain["backwards"] > 0
        assert guarded["skipped"] == [] and guarded["diag"] is None


@pytest.mark.dist
@pytest.mark.parametrize("setup", ["fsdp", "tp"])
def test_torchtitans_own_trainer_names_a_fault_on_rank1_and_goes_on(runs: dict[str, list[dict]], setup: str) -> None:
    # Under TP the trainer's bf16 w1 output is a DTensor: the tracer's float32 recompute of the
    # faulty op reduced it into a DTensor collective on rank 1 alone; the ranks' collectives
    # then mismatched and gloo aborted the job. The recompute now runs on this rank's shard.
    ranks = runs[f"trainer_{setup}_sqrt_rank1"]
    d = _diag(ranks)
    assert d == {
        "cause": "op.sqrt_domain",
        "op": "aten.sqrt.default",
        "module": "layers.1.feed_forward.w1",  # activation checkpointing's wrapper level left out
        "phase": "forward",
        "rank": 1,
        "ranks": [1],
        "step": 2,  # the guard counts optimizer steps from 0: the trainer's step 3
    }
    assert [r["skipped"] for r in ranks] == [[3], [3]]
    assert all(r["steps"] == 4 and len(r["losses"]) == 3 and all(map(math.isfinite, r["losses"])) for r in ranks)
    if setup == "tp":  # torchtitan's loss under TP is a DTensor, on both ranks
        assert all(r["loss_inputs"]["loss"].startswith("DTensor") for r in ranks)


@pytest.mark.dist
def test_pipeline_parallel_under_torchtitans_schedule_healthy_identical_and_a_stage1_fault_named(
    runs: dict[str, list[dict]],
) -> None:
    for plain, guarded in zip(runs["trainer_pp_plain"], runs["trainer_pp_guarded"], strict=True):
        assert (guarded["digest"], guarded["losses"], guarded["norms"]) == (
            plain["digest"],
            plain["losses"],
            plain["norms"],
        )
        assert guarded["forwards"] == plain["forwards"] and guarded["backwards"] == plain["backwards"]
        assert guarded["skipped"] == [] and guarded["diag"] is None
    ranks = runs["trainer_pp_sqrt_rank1"]
    d = _diag(ranks)
    assert (d["cause"], d["op"], d["module"], d["phase"], d["rank"], d["ranks"], d["step"]) == (
        "op.sqrt_domain",
        "aten.sqrt.default",
        "layers.1.feed_forward.w1",
        "forward",
        1,
        [1],
        2,
    )
    # Only the faulty step: before, stage 1's shape inference (run on uninitialized inputs before
    # the first step) was recorded as a micro-batch, and its garbage tripped step 0 as data.
    assert [r["skipped"] for r in ranks] == [[3], [3]]
    assert ranks[1]["losses"][:2] == runs["trainer_pp_plain"][1]["losses"][:2]


@pytest.mark.dist
def test_a_far_too_high_lr_under_fsdp2_is_an_optimizer_divergence_on_every_rank(runs: dict[str, list[dict]]) -> None:
    ranks = runs["fsdp_lr_too_high"]
    losses = ranks[0]["losses"]
    assert max(losses) > 1e4 * losses[0]  # the scenario: the loss grew geometrically first
    assert ranks[0]["skipped"] and ranks[0]["skipped"] == ranks[1]["skipped"]  # then NaN, skipped
    d = _diag(ranks)
    # Before: the updates without a gradient filled the history's window, the growth fell out
    # of it, and the trip was "unknown" (a NaN in SDPA or RMSNorm's backward).
    assert d["cause"] == "optimizer.divergence"
    history = ranks[0]["diag"]["evidence"]["history"]
    assert history["diverging"] and history["growth"] > 1e3
    # The rate is the container's optimizers' (its own groups carry none): the fix names it.
    assert history["lr"] is not None and history["lr"] > 1.0
    assert any("lower the learning rate (now" in f for f in ranks[0]["diag"]["fixes"])
    for r in ranks:
        assert r["diag"]["cause"] not in ("distributed.transient", "step.not_reproduced")
        assert not any("hardware" in f or "drain" in f for f in r["diag"]["fixes"])


@pytest.mark.dist
def test_a_rollback_guard_leaves_a_healthy_run_bit_identical(runs: dict[str, list[dict]]) -> None:
    # Its snapshots read the container's optimizers one by one: OptimizersContainer.state_dict()
    # would first run a zero-LR step, counting a step for AdamW and changing the first update.
    for plain, guarded in zip(runs["fsdp_plain"], runs["fsdp_rollback"], strict=True):
        assert (guarded["digest"], guarded["losses"], guarded["norms"]) == (
            plain["digest"],
            plain["losses"],
            plain["norms"],
        )


@pytest.mark.dist
def test_tp_op_fault_on_rank0_under_raise_stops_every_rank_naming_rank0(runs: dict[str, list[dict]]) -> None:
    ranks = runs["tp_sqrt_rank0_raise"]
    assert all(r["raised"] for r in ranks)
    d = _diag(ranks)
    assert (d["cause"], d["module"], d["rank"], d["ranks"], d["step"]) == (
        "op.sqrt_domain",
        "layers.1.feed_forward.w1",
        0,
        [0],
        2,
    )


@pytest.mark.dist
def test_fsdp_op_fault_on_rank0_is_named_there_with_the_chunked_loss(runs: dict[str, list[dict]]) -> None:
    # The chunked loss turns the output layer's FSDP sync back on: the replay keeps it off, so
    # rank 1 does not receive rank 0's NaN and call it data in lm_head.
    assert _diag(runs["fsdp_sqrt_rank0"]) == {
        "cause": "op.sqrt_domain",
        "op": "aten.sqrt.default",
        "module": "layers.1.feed_forward.w1",
        "phase": "forward",
        "rank": 0,
        "ranks": [0],
        "step": 2,
    }
    assert [r["skipped"] for r in runs["fsdp_sqrt_rank0"]] == [[2], [2]]
    assert all(len(r["losses"]) == 3 and all(map(math.isfinite, r["losses"])) for r in runs["fsdp_sqrt_rank0"])


@pytest.mark.dist
def test_fsdp_backward_fault_is_seen_in_the_unsharded_gradients_not_blamed_on_hardware(
    runs: dict[str, list[dict]],
) -> None:
    # The replay's backward runs with FSDP sync off: its gradients sit in FSDP's unsharded
    # buffers, which the tracer now reads; before, the replay looked finite and the step was
    # called distributed.transient ("drain this node").
    d = _diag(runs["fsdp_sqrt_grad_rank1"])
    assert (d["op"], d["module"], d["phase"], d["rank"], d["ranks"]) == (
        "aten.sqrt.default",
        "layers.1.feed_forward.w1",
        "backward",
        1,
        [1],
    )
    assert d["cause"] == "op.sqrt_domain"  # a sqrt of negatives run by a backward of the user's
    assert [r["skipped"] for r in runs["fsdp_sqrt_grad_rank1"]] == [[2], [2]]


@pytest.mark.dist
def test_tp_op_fault_on_rank1_is_named_on_rank1(runs: dict[str, list[dict]]) -> None:
    d = _diag(runs["tp_sqrt_rank1"])
    assert (d["cause"], d["module"], d["phase"], d["rank"], d["ranks"]) == (
        "op.sqrt_domain",
        "layers.1.feed_forward.w1",
        "forward",
        1,
        [1],
    )
    assert [r["skipped"] for r in runs["tp_sqrt_rank1"]] == [[2], [2]]


@pytest.mark.dist
def test_bad_token_id_on_rank1_is_named_and_skipped_not_fatal(runs: dict[str, list[dict]]) -> None:
    d = _diag(runs["fsdp_token_rank1"])
    assert (d["cause"], d["phase"], d["rank"], d["step"]) == ("data.index_out_of_range", "data", 1, 2)
    assert [r["skipped"] for r in runs["fsdp_token_rank1"]] == [[2], [2]]
    # The run goes on after the skip, both ranks in step (FSDP keeps them consistent).
    assert all(len(r["losses"]) == 3 for r in runs["fsdp_token_rank1"])


@pytest.mark.dist
def test_a_nan_row_of_the_sharded_embedding_is_named_as_a_row_of_the_model_on_its_owner(
    runs: dict[str, list[dict]],
) -> None:
    from nanguard.zoo.titan import NAN_ROW

    ranks = runs["fsdp_nan_row"]
    assert all(r["raised"] for r in ranks)  # no skip repairs a loaded NaN: every rank stops together
    d = _diag(ranks)
    assert (d["cause"], d["module"], d["phase"], d["rank"]) == (
        "parameters.nonfinite",
        "tok_embeddings",
        "parameters",
        1,
    )
    evidence = ranks[0]["diag"]["evidence"]
    assert evidence["rows"] == [NAN_ROW]  # not 200 - 128, the row in rank 1's shard
    assert evidence["token_ids"] == [NAN_ROW]


@pytest.mark.dist
def test_a_bad_token_id_never_ends_the_run_with_the_integration_as_documented(runs: dict[str, list[dict]]) -> None:
    """No check_batch: the ids are made valid on the device before the embedding (no host read), the
    step's checked loss carries the finding, and the replay names it: on rank 1 under FSDP2 in
    torchtitan's Trainer (before: an IndexError ended the job), on rank 0 under TP (before: a zero row)."""
    for name, rank, step, at in (("trainer_fsdp_token_rank1", 1, 2, 3), ("tp_token_rank0", 0, 2, 2)):
        ranks = runs[name]
        d = _diag(ranks)
        assert (d["cause"], d["phase"], d["rank"], d["ranks"], d["step"]) == (
            "data.index_out_of_range",
            "data",
            rank,
            [rank],
            step,
        ), name
        assert [r["skipped"] for r in ranks] == [[at], [at]], name
        assert all(len(r["losses"]) == 3 and all(map(math.isfinite, r["losses"])) for r in ranks), name


@pytest.mark.dist
def test_a_token_id_past_the_vocabulary_on_rank0_reaches_every_rank_through_the_clips_norm(
    runs: dict[str, list[dict]],
) -> None:
    """FSDP2, no check_batch: rank 0's loss alone is NaN (its ids made valid, its gradients finite); its gradients
    carry it into the norm the other rank reads: skipped on both, named on rank 0."""
    ranks = runs["fsdp_token_rank0"]
    d = _diag(ranks)
    assert (d["cause"], d["rank"], d["step"]) == ("data.index_out_of_range", 0, 2)
    assert [r["skipped"] for r in ranks] == [[2], [2]]


@pytest.mark.dist
def test_under_tp_a_loss_nan_on_rank0_alone_reaches_the_other_rank_through_the_clips_norm(
    runs: dict[str, list[dict]],
) -> None:
    """torchtitan's Trainer under TP, no check_batch: rank 0's loss alone is NaN (a token id past the vocabulary,
    made valid: its gradients finite). The NaN seeded in rank 0's gradient of the model's output reaches the
    norm torchtitan's clip reduces (a replicated parameter's norm enters its partial sum on every rank), which
    the other rank reads: skipped on both at the trainer's step 3, named on rank 0."""
    ranks = runs["trainer_tp_token_rank0"]
    d = _diag(ranks)
    assert (d["cause"], d["rank"], d["ranks"], d["step"]) == ("data.index_out_of_range", 0, [0], 2)
    assert [r["skipped"] for r in ranks] == [[3], [3]]
    assert all(len(r["losses"]) == 3 and all(map(math.isfinite, r["losses"])) for r in ranks)


@pytest.mark.dist
def test_under_pp_a_nan_parameter_of_the_stage_without_the_loss_reaches_the_last_stage(
    runs: dict[str, list[dict]],
) -> None:
    """torchtitan's Trainer under PP: stage 0 (rank 0) computes no loss and holds an embedding row NaN that no
    batch looks up (the loss and every gradient finite). Its parameter check rides in the gradient its output
    receives back, into the norm the clip sums over the stages: both ranks stop (a loaded NaN is no step's to
    skip), naming the row's module on rank 0."""
    ranks = runs["trainer_pp_nan_row_rank0"]
    assert all(r["raised"] for r in ranks)
    d = _diag(ranks)
    expected = ("parameters.nonfinite", "tok_embeddings", "parameters", 0)
    assert (d["cause"], d["module"], d["phase"], d["rank"]) == expected


@pytest.mark.dist
@pytest.mark.slow
def test_a_loss_nan_alone_on_either_rank_under_tp_is_skipped_on_both() -> None:
    """The long variant: rank 0's or rank 1's loss alone NaN in the Trainer under TP (under full_dtensor, whose
    loss and model output are DTensors on a 2-D mesh, the seed rides on their local values:
    ``test_torchtitans_own_trainer_in_every_setup``'s faults on each rank)."""
    from nanguard.zoo.spawn import spawn_ranks

    cases = [["trainer:tp", "token", bad, "skip"] for bad in (0, 1)]
    results = spawn_ranks(_cases, cases, world=2, timeout=1200)
    for at, bad in enumerate((0, 1)):
        ranks = [r[at] for r in results]
        d = _diag(ranks)
        assert (d["cause"], d["rank"], d["ranks"]) == ("data.index_out_of_range", bad, [bad]), bad
        assert [r["skipped"] for r in ranks] == [[3], [3]], bad


@pytest.mark.dist
def test_tp_with_the_plain_cross_entropy_names_a_fault_in_rank1s_attention(runs: dict[str, list[dict]]) -> None:
    ranks = runs["trainer_tp_ce_attention_rank1"]
    d = _diag(ranks)
    assert (d["cause"], d["op"], d["module"], d["phase"], d["rank"], d["ranks"], d["step"]) == (
        "op.sqrt_domain",
        "aten.sqrt.default",
        "layers.1.attention",
        "forward",
        1,
        [1],
        2,
    )
    assert [r["skipped"] for r in ranks] == [[3], [3]]


@pytest.mark.dist
def test_a_replay_without_the_loss_says_what_it_could_not_see_under_fsdp2(runs: dict[str, list[dict]]) -> None:
    for r in runs["fsdp_sqrt_grad_unwrapped_rank0"]:
        d = r["diag"]
        assert d is not None and d["cause"] not in ("step.not_reproduced", "distributed.transient"), d
        assert d["evidence"].get("unobserved"), d["evidence"]
        assert not any("hardware" in f or "drain" in f for f in d["fixes"]), d["fixes"]
        assert r["skipped"] == [2]


@pytest.mark.dist
def test_nanguard_disable_leaves_torchtitans_step_untouched(runs: dict[str, list[dict]]) -> None:
    for plain, off in zip(runs["fsdp_plain"], runs["fsdp_disabled"], strict=True):
        assert off["hooked"] == plain["hooked"]  # no hook on the model or the optimizers
        assert (off["digest"], off["losses"], off["norms"]) == (plain["digest"], plain["losses"], plain["norms"])
        assert off["skipped"] == [] and off["diag"] is None


@pytest.mark.dist
@pytest.mark.slow
def test_the_documented_integration_on_each_rank_without_options() -> None:
    """The long variant: a bad token id (torchtitan's Trainer, FSDP2 and TP) and the plain cross-entropy
    loss under TP with a fault in the attention, on rank 0 and rank 1."""
    from nanguard.zoo.spawn import spawn_ranks

    cases = [["trainer:" + s, "token", r, "skip"] for s in ("fsdp", "tp") for r in (0, 1)]
    cases += [["trainer:tp", "attn_sqrt", r, "skip", {"loss": "ce"}] for r in (0, 1)]
    results = spawn_ranks(_cases, cases, world=2, timeout=1800)
    for i, (_, fault, rank, *_) in enumerate(cases):
        d = _diag([results[0][i], results[1][i]])
        want = ("data.index_out_of_range", "data") if fault == "token" else ("op.sqrt_domain", "forward")
        assert (d["cause"], d["phase"], d["rank"], d["ranks"], d["step"]) == (*want, rank, [rank], 2), cases[i]
        if fault == "attn_sqrt":
            assert d["module"] == "layers.1.attention", cases[i]
        assert results[0][i]["skipped"] == results[1][i]["skipped"] == [3], cases[i]


@pytest.mark.dist
@pytest.mark.slow
def test_every_fault_on_each_rank_in_both_setups() -> None:
    """The long variant: each fault on each rank, FSDP2 and TP, skip and rollback."""
    from nanguard.zoo.spawn import spawn_ranks

    cases = [
        [setup, fault, rank, policy, {"check_batch": fault in ("token", "label")}]
        for setup in ("fsdp", "tp")
        for fault in ("sqrt", "sqrt_grad", "token", "label")
        for rank in (0, 1)
        for policy in ("skip", "rollback")
    ]
    results = spawn_ranks(_cases, cases, world=2, timeout=1800)
    for i, (setup, fault, rank, policy, _) in enumerate(cases):
        d = _diag([results[0][i], results[1][i]])
        want = {"token": "data.index_out_of_range", "label": "data.index_out_of_range"}.get(fault)
        assert (d["rank"], d["ranks"], d["step"]) == (rank, [rank], 2), (setup, fault, rank, policy)
        if want is not None:
            assert d["cause"] == want
        else:
            assert (d["op"], d["module"]) == ("aten.sqrt.default", "layers.1.feed_forward.w1")
            assert d["phase"] == ("forward" if fault == "sqrt" else "backward")
            assert d["cause"] == "op.sqrt_domain"
        assert results[0][i]["skipped"] == results[1][i]["skipped"] and 2 in results[0][i]["skipped"]


@pytest.mark.dist
@pytest.mark.slow
def test_torchtitans_own_trainer_in_every_setup() -> None:
    """The long variant for the Trainer: FSDP2, TP, PP (1F1B) and TP on the full_dtensor backend (every
    activation a DTensor, the loss a DTensor on 2 ranks: ~1 min a run here), healthy
    bit-identical, and an op fault in the forward or the backward on each rank."""
    from nanguard.zoo.spawn import spawn_ranks

    setups = [("fsdp", {}), ("tp", {}), ("tp", {"backend": "full_dtensor"}), ("pp", {})]
    cases: list[list] = []
    results: list[list[dict]] = [[], []]
    for setup, options in setups:  # one spawn each: the backends' global state stays apart
        these = [[f"trainer:{setup}", None, 0, None, options], [f"trainer:{setup}", None, 0, "skip", options]]
        # Under PP layers.1 lives on stage 1 (rank 1): rank 0's fault is a token id past the vocabulary.
        these += [[f"trainer:{setup}", f, r, "skip", options] for f in ("sqrt", "sqrt_grad") for r in (0, 1)]
        if setup == "pp":
            these[2] = these[4] = ["trainer:pp", "token", 0, "skip", {"check_batch": True}]
        # full_dtensor keeps its meshes in torchtitan's globals: a second trainer in the same
        # process gets "different mesh objects" from FSDP; each of its runs gets its own spawn.
        batches = [[case] for case in these] if options.get("backend") == "full_dtensor" else [these]
        for batch in batches:
            for rank, found in enumerate(spawn_ranks(_cases, batch, world=2, timeout=1200)):
                results[rank] += found
        cases += these
    for i in range(0, len(cases), 6):
        for rank in (0, 1):
            plain, guarded = results[rank][i], results[rank][i + 1]
            assert (guarded["digest"], guarded["losses"], guarded["norms"], guarded["backwards"]) == (
                plain["digest"],
                plain["losses"],
                plain["norms"],
                plain["backwards"],
            ), cases[i]
            assert guarded["diag"] is None and guarded["forwards"] == plain["forwards"]
            if cases[i][4]:
                assert guarded["loss_inputs"]["loss"].startswith("DTensor")
        for j in range(i + 2, i + 6):
            d = _diag([results[0][j], results[1][j]])
            fault, rank = cases[j][1], cases[j][2]
            if fault == "token":  # stage 0 reads the tokens: named on rank 0, skipped on both
                assert (d["cause"], d["phase"], d["rank"], d["ranks"]) == ("data.index_out_of_range", "data", 0, [0])
                assert results[0][j]["skipped"] == results[1][j]["skipped"] == [3], cases[j]
                continue
            assert (d["cause"], d["module"], d["rank"], d["ranks"]) == (
                "op.sqrt_domain",
                "layers.1.feed_forward.w1",
                rank,
                [rank],
            ), cases[j]
            assert d["phase"] == ("forward" if fault == "sqrt" else "backward"), cases[j]
            assert results[0][j]["skipped"] == results[1][j]["skipped"] == [3], cases[j]


@pytest.mark.dist
@pytest.mark.slow
def test_a_far_too_high_lr_in_torchtitans_own_trainer_is_an_optimizer_divergence() -> None:
    """torchtitan's Trainer (bf16, activation checkpointing) at LR 100 (1e5x its debug config's),
    FSDP2 and TP: the loss grows ~1e5-fold, saturates, then goes non-finite in a backward."""
    from nanguard.zoo.spawn import spawn_ranks

    cases = [[f"trainer:{setup}", None, 0, "skip", {"lr": 100.0, "steps": 9}] for setup in ("fsdp", "tp")]
    results = spawn_ranks(_cases, cases, world=2, timeout=1200)
    for i, case in enumerate(cases):
        ranks = [results[0][i], results[1][i]]
        d = _diag(ranks)
        assert d["cause"] == "optimizer.divergence", case
        assert max(ranks[0]["losses"]) > 1e4 * ranks[0]["losses"][0], case
        assert ranks[0]["skipped"] and ranks[0]["skipped"] == ranks[1]["skipped"], case
        assert ranks[0]["diag"]["trip"]["history"]["diverging"], case


# -- one process: a replay that could not observe the step blames no hardware ------------------


class _BackwardNaN(torch.autograd.Function):
    """Identity forward; NaN gradient in the backward (a fault only a backward can show)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return _BackwardNaN.apply(h) if self.bad else h


def test_a_replay_that_could_not_see_the_backward_blames_no_hardware() -> None:
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = LoopGuard(model, opt, policy="skip", module_stats=False)
    for step in range(3):
        model.bad = step == 2
        loss = model(torch.randn(2, 4)).pow(2).mean()  # the loss outside the model, no micro_step
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    guard.close()
    d = guard.last_diagnosis
    assert guard.step_skipped and d is not None
    assert d.cause not in ("step.not_reproduced", "distributed.transient")
    assert "the loss and the backward" in " ".join(d.evidence["unobserved"])
    assert not any("hardware" in f or "drain" in f for f in d.fixes)


def test_step_skipped_is_false_on_a_healthy_step() -> None:
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with LoopGuard(model, opt, module_stats=False) as guard:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        assert not guard.step_skipped and guard.skipped == 0


def test_transient_is_claimed_only_for_a_faithful_replay() -> None:
    args = {"step": 3, "loss": float("nan"), "grad_norm": 1.0, "flagged_ranks": [1], "located": True}
    faithful = transient_fault(**args, distributed=True)
    assert faithful.cause == "distributed.transient"
    blind = transient_fault(**args, distributed=True, unobserved=["the gradient reduce-scatter"])
    assert blind.cause == "unknown" and blind.evidence["unobserved"] == ["the gradient reduce-scatter"]
    assert not any("hardware" in f or "drain" in f for f in blind.fixes)
    single = transient_fault(**args, distributed=False, unobserved=["the backward"])
    assert single.cause == "unknown"


class _DTensorLoss(nn.Module):
    """A tensor-parallel model whose loss is a DTensor (a parallel loss); NaN when ``bad``."""

    def __init__(self, mesh: object) -> None:
        super().__init__()
        self.mesh = mesh
        self.fc = nn.Linear(4, 4)
        self.bad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate

        h = self.fc(x)
        loss = torch.log(h.pow(2).mean() - 1e3) if self.bad else h.pow(2).mean()
        return DTensor.from_local(loss, self.mesh, [Replicate()])


def test_a_dtensor_loss_is_checked_and_a_trip_named(tmp_path) -> None:
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh

    tdist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = _DTensorLoss(init_device_mesh("cpu", (1,)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with LoopGuard(model, opt, policy="skip", module_stats=False) as guard:
            for step in range(3):
                model.bad = step == 1
                model(torch.randn(2, 4)).backward()  # the README's loop: the loss is the model's
                opt.step()
                opt.zero_grad(set_to_none=True)
                assert guard.step_skipped == (step == 1)
        d = guard.last_diagnosis
        assert d is not None and (d.cause, d.op, d.step) == ("op.log_domain", "aten.log.default", 1)
        assert guard.last_grad_norm is not None and math.isfinite(guard.last_grad_norm)
    finally:
        tdist.destroy_process_group()


def test_a_blind_replay_after_a_millionfold_loss_growth_is_a_divergence() -> None:
    from nanguard.diagnose import with_run_facts
    from nanguard.evidence import RunFacts

    blind = transient_fault(
        step=9,
        loss=float("nan"),
        grad_norm=float("nan"),
        flagged_ranks=[0, 1],
        located=True,
        distributed=True,
        unobserved=["the gradients FSDP2 reduce-scatters"],
    )
    grew = RunFacts(history={"diverging": True, "metric": "loss", "growth": 1e6, "window": 5})
    d = with_run_facts(blind, grew)
    assert d.cause == "optimizer.divergence"
    assert not any("drain" in f for f in d.fixes)


def test_updates_without_a_gradient_do_not_hide_the_growth_before_them() -> None:
    from nanguard.guard.history import History

    history = History(
        size=64, spike_window=50, spike_warmup=10, spike_threshold=6.0, divergence_window=5, divergence_factor=10.0
    )
    for step, (loss, norm) in enumerate([(3.0, 1.0), (1e5, 1e6), (7e6, 1e11)] + [(2.77, 0.0)] * 5):
        history.append(step, loss=loss, grad_norm=norm)
    evidence = history.evidence(8, None)
    assert evidence["diverging"] and evidence["growth"] > 1e6
    steady = History(
        size=64, spike_window=50, spike_warmup=10, spike_threshold=6.0, divergence_window=5, divergence_factor=10.0
    )
    for step in range(8):
        steady.append(step, loss=3.0 - 0.1 * step, grad_norm=0.0 if step > 4 else 1.0)
    assert not steady.evidence(8, None)["diverging"]


def test_titan_guard_names_wrong_arguments() -> None:
    from nanguard.integrations.torchtitan import TitanGuard

    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="model_parts"):
        TitanGuard([], opt)
    with pytest.raises(ValueError, match="optimizers"):
        TitanGuard([model], object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lr_schedulers"):
        TitanGuard([model], opt, object())
    guard = TitanGuard([model], opt)
    with pytest.raises(ValueError, match="loss_fn"):
        guard.loss(3)  # type: ignore[arg-type]
    guard.close()
    assert ng.CAUSES  # the public causes stay importable beside the adapter


def test_titan_guard_under_nanguard_disable_hooks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from nanguard.integrations.torchtitan import TitanGuard

    monkeypatch.setenv("NANGUARD_DISABLE", "1")
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = TitanGuard([model], opt)
    loss_fn = nn.functional.mse_loss
    assert guard.loss(loss_fn) is loss_fn and guard.guard is None
    assert not (model._forward_pre_hooks or model._forward_hooks or opt._optimizer_step_pre_hooks)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert not guard.step_skipped and guard.skipped == 0 and guard.last_diagnosis is None
    guard.close()


@pytest.mark.parametrize(
    ("dtype", "vocab"), [(torch.int64, 10), (torch.int32, 10), (torch.int16, 49_999), (torch.uint8, 1000)]
)
def test_ids_outside_the_vocabulary_are_told_in_any_integer_dtype(dtype: torch.dtype, vocab: int) -> None:
    # The check runs on every step's ids and labels; a vocabulary past the dtype's range (int16 ids, a 50k
    # vocabulary) must not wrap into flagging every id.
    from nanguard.integrations.torchtitan import IGNORE_INDEX, _valid_labels, _valid_tokens

    values = [0, 5, 9, 10, 99, 200] + ([-1, IGNORE_INDEX, -101] if dtype != torch.uint8 else [])
    ids, wide = torch.tensor(values, dtype=dtype), torch.tensor(values)
    outside = (wide < 0) | (wide >= vocab)
    (tokens, *_), _, bad = _valid_tokens((ids,), {}, vocab)
    assert tokens.tolist() == torch.where(outside, 0, wide).tolist() and bool(bad) == bool(outside.any())
    labels, bad_labels = _valid_labels(ids, vocab)
    ignored = outside & (wide != IGNORE_INDEX)
    assert labels.tolist() == torch.where(ignored, IGNORE_INDEX, wide).tolist()
    assert bool(bad_labels) == bool(ignored.any())
