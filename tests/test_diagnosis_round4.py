"""Diagnosis, fourth round: infinities meeting infinities, the log family, replays that draw the
same numbers, the sample behind a masked row, gradient surgery, a compiled submodule."""

import nanguard as ng
from nanguard.zoo.wild import get_wild


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
