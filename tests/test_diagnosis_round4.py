"""Diagnosis, fourth round: infinities meeting infinities, the log family, replays that draw the
same numbers, the sample behind a masked row, gradient surgery, a compiled submodule."""

import json

import numpy as np
import torch

import nanguard as ng
from nanguard.zoo.wild import get_wild
from nanguard.zoo.wild_replays import DIFFUSION_BAD_SEED, ITEMS_BAD_SEED, diffusion_case, masked_items_case
from nanguard.zoo.wild_samples import stopword_batch


def _locate(name: str) -> ng.Diagnosis:
    case = get_wild(name).build()
    diag = ng.locate(case.fn, *case.args, model=case.model)
    assert diag is not None
    return diag


def test_two_sentinels_meeting_name_the_arithmetic_and_both_fixes() -> None:
    diag = _locate("online_softmax_padded_block")
    origin = diag.evidence["origin"]
    assert (diag.cause, diag.op, diag.kind) == ("op.masked_softmax", "aten.sub.Tensor", "nan")
    assert origin["infinities_met"] == "-inf - (-inf)"
    assert {s["op"] for s in origin["infinity_sources"]} == {"aten.full.default", "aten.masked_fill.Scalar"}
    fixes = " ".join(diag.fixes)
    assert "finite sentinel" in fixes and "guard the empty block" in fixes


def test_a_distribution_at_the_edge_of_its_support_is_named_by_its_method() -> None:
    diag = _locate("beta_policy_clipped_action")
    assert (diag.cause, diag.op, diag.module) == ("op.log_domain", "aten.xlogy.Tensor", "actor")
    assert diag.evidence["origin"]["user_op"] == "Beta.log_prob"
    assert diag.evidence["origin"]["at_boundary"] == 1
    assert "Beta.log_prob" in diag.evidence["why"] and "support" in diag.evidence["why"]
    assert "clamp(eps, 1 - eps)" in diag.fixes[0]


def test_arithmetic_on_what_autograd_grad_returned_is_gradient_surgery() -> None:
    diag = _locate("pcgrad_autograd_grad_zero_task")
    assert (diag.cause, diag.phase) == ("op.division_by_zero", "backward")
    assert diag.evidence["origin"]["gradient_surgery"] is True
    update = _locate("sam_layerwise_zero_grad")
    assert (update.op, update.phase) == ("aten.addcdiv_.default", "optimizer")


def test_an_empty_sample_is_traced_to_its_batch_tensor_and_row() -> None:
    diag = _locate("stopword_empty_sample_tuple_batch")
    assert diag.cause == "op.masked_softmax"
    assert diag.evidence["origin"]["masked_by"] == {"path": "batch[0][1]", "rows": [3]}
    assert diag.evidence["rows"] == [3] and diag.also[0]["cause"] == "data.fully_masked"
    assert "batch[0][1] row(s) [3]" in diag.evidence["why"]
    dict_diag = _locate("empty_passage_dict_where")  # torch.where(mask, scores, full_like(-inf)), 4-D heads
    assert dict_diag.evidence["origin"]["masked_by"] == {"path": "batch['attention_mask']", "rows": [1]}


def test_check_batch_finds_the_empty_sample_in_tuple_and_list_batches() -> None:
    (ids, mask), labels = stopword_batch()
    for batch, where in (
        (((ids, mask), labels), "batch[0][1]"),
        ([ids, mask, labels], "batch[1]"),
        ({"input_ids": ids, "attention_mask": mask}, "batch['attention_mask']"),
    ):
        (finding,) = ng.check_batch(batch)
        assert (finding.cause, finding.where, finding.details["samples"]) == ("data.fully_masked", where, [3])
    # An all-zero tensor after the mask (token type ids of single sentences) is not read as a mask.
    assert ng.check_batch((ids, torch.zeros_like(ids), torch.ones_like(ids))) == []


def test_policy_auto_quarantines_the_dataset_id_of_the_empty_sample(tmp_path) -> None:
    case = get_wild("stopword_empty_sample_tuple_batch").build()
    (batch,) = case.args
    optimizer = torch.optim.SGD(case.model.parameters(), lr=0.1)
    guard = ng.Guard(case.model, optimizer, policy="auto", run_dir=tmp_path)
    try:
        guard.step(lambda: case.fn(batch), batch=batch, sample_ids=[40, 41, 42, 43])
    finally:
        guard.close()
    (remedy,) = guard.remedies
    assert remedy["action"] == "quarantine" and remedy["cause"] == "op.masked_softmax"
    assert json.loads((tmp_path / "quarantine.json").read_text())["ids"] == [43]


def _guarded_first_trip(case) -> ng.Diagnosis:
    optimizer = torch.optim.SGD(case.model.parameters(), lr=0.01)
    guard = ng.Guard(case.model, optimizer, policy="skip")
    guard.step(lambda: case.fn(*case.args))
    assert guard.last_diagnosis is not None
    return guard.last_diagnosis


def test_a_replay_draws_what_the_step_drew_from_numpy_and_python_random() -> None:
    # The first draw hits the fault; the draws after it do not: a replay must restore the global states.
    diffusion = _guarded_first_trip(diffusion_case(DIFFUSION_BAD_SEED))
    assert (diffusion.cause, diffusion.op, diffusion.module) == ("op.division_by_zero", "aten.div.Tensor", "")
    items = _guarded_first_trip(masked_items_case(ITEMS_BAD_SEED))
    assert items.cause == "data.no_valid_targets"


def test_a_generator_of_the_step_own_is_named_instead_of_the_hardware() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    sampler = np.random.default_rng(14)  # draws 0 first, then 2, 1, 1

    def step() -> torch.Tensor:
        model.zero_grad()
        k = int(sampler.integers(0, 3))
        loss = model(torch.ones(2, 3)).sum() / k  # x / 0 only when k == 0
        loss.backward()
        return loss

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = ng.Guard(model, optimizer, policy="skip")
    guard.step(step)
    diag = guard.last_diagnosis
    assert diag is not None and diag.cause == "unknown"
    assert any("numpy Generator 'sampler'" in gap for gap in diag.evidence["unobserved"])
    assert "hardware" not in " ".join(diag.fixes)


def test_locate_and_the_guard_agree_on_a_compiled_submodule_that_miscompiles() -> None:
    located = _locate("compiled_head_miscompile")
    assert (located.cause, located.module, located.phase) == ("compile.numerics", "head", "forward")
    assert located.evidence["compiled_module"] == "head" and located.evidence["graph_modules"] == ["head.proj"]
    guarded = _guarded_first_trip(get_wild("compiled_head_miscompile").build())
    assert (guarded.cause, guarded.module, guarded.phase) == ("compile.numerics", "head", "forward")


def test_a_guard_checking_batches_rejects_an_empty_or_a_corrupt_mask() -> None:
    case = get_wild("stopword_empty_sample_tuple_batch").build()
    (batch,) = case.args
    (ids, mask), _ = batch
    for bad, cause in (
        (batch, "data.fully_masked"),
        ({"input_ids": ids, "attention_mask": torch.where(mask == 1, 2, mask)}, "data.invalid_mask"),  # 0/2
    ):
        optimizer = torch.optim.SGD(case.model.parameters(), lr=0.01)
        guard = ng.Guard(case.model, optimizer, policy="skip", check_batch=True)
        guard.step(lambda: case.fn(batch), batch=bad)
        assert guard.last_diagnosis is not None and guard.last_diagnosis.cause == cause
