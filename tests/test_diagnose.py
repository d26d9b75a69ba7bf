"""Each rule in isolation, from evidence tables."""

import copy
import json
from dataclasses import replace

import pytest

from nanguard.diagnose import (
    RULES,
    diagnose,
    loss_scale_collapse,
    nonfinite_update,
    rejected_batch,
    replica_divergence,
    transient_fault,
    with_run_facts,
)
from nanguard.evidence import Evidence, OriginEvidence, RunFacts
from nanguard.findings import Diagnosis, Finding
from nanguard.text import diagnosis_text, kind_name, summary


def _op(
    op,
    inputs=None,
    *,
    module_type=None,
    node=None,
    scalars=(),
    kind=None,
    weight_scale=None,
    initial_weight_scale=None,
    history=None,
    why=None,
    **facts,
):
    """Evidence of an op origin, built through the records: a field renamed there is a TypeError here.
    ``facts`` are the op's own facts (``OriginEvidence.extra``), which the record does not name."""
    origin = OriginEvidence(
        category="op",
        op=op,
        module="m",
        module_type=module_type,
        phase="forward",
        node=node,
        inputs=inputs or [{}],
        scalars=list(scalars),
        extra=facts,
    )
    return Evidence(
        origin=origin,
        kind=kind,
        weight_scale=weight_scale,
        initial_weight_scale=initial_weight_scale,
        history=history,
        why=why,
    )


def _at(*, kind=None, facts=None, **origin):
    """Evidence of any origin, its named fields by keyword (``facts``: the rest)."""
    return Evidence(origin=OriginEvidence(**origin, extra=facts or {}), kind=kind)


CASES = [
    (
        _at(
            category="index",
            op="aten.embedding.default",
            indexed_size=10,
            index_inputs=[{"min": 0, "max": 10, "path": "batch['input_ids']"}],
            error="IndexError",
        ),
        "data.index_out_of_range",
        "ids must be < 10",
    ),
    (
        _op("aten.nll_loss_forward.default", targets=8, valid_targets=0, ignore_index=-100),
        "data.no_valid_targets",
        "-100",
    ),
    (_at(category="data", path="batch['x']", inputs=[{"nan": 3}]), "data.nonfinite", "batch['x']"),
    (_at(category="fill", path="mask", inputs=[{"neginf": 3}]), "data.nonfinite", "mask"),
    (
        _at(category="parameters", path="fc.weight", module="fc", inputs=[{"nan": 1}]),
        "parameters.nonfinite",
        "checkpoint",
    ),
    (
        _op("aten.bmm.default", [{"absmax": 1e5}], kind="inf", weight_scale={"max_ratio": 200.0, "module": "fc"}),
        "init.scale",
        "1/sqrt(fan_in)",
    ),
    (
        _op(
            "aten.exp.default",
            input_max=300.0,
            kind="inf",
            history={"diverging": True, "metric": "loss", "growth": 50.0, "window": 4, "lr": 3.0},
        ),
        "optimizer.divergence",
        "learning rate (now 3)",
    ),
    (
        _op(
            "aten.bmm.default", fp32_recompute={"finite": True, "absmax": 1e5, "dtype": "float16", "dtype_max": 65504.0}
        ),
        "precision.overflow",
        "bfloat16",
    ),
    (_op("aten._softmax.default", fully_masked_rows=2, rows=8), "op.masked_softmax", "finfo(dtype).min"),
    (
        _op("aten.native_layer_norm.default", norm_eps=0.0, min_variance=0.0, module_type="LayerNorm"),
        "norm.zero_variance",
        "LayerNorm eps is 0.0; use >= 1e-05",
    ),
    (
        _at(category="op", op="aten.mul.Tensor", node="NativeLayerNormBackward0", inputs=[{}]),
        "norm.zero_variance",
        "eps",
    ),
    (_op("aten.log.default", [{"zeros": 4}]), "op.log_domain", "log_softmax"),
    (
        _at(category="op", op="aten.div.Tensor", node="LogBackward0", phase="backward", inputs=[{}, {"zeros": 1}]),
        "op.log_domain",
        "log_softmax",
    ),
    (_op("aten.sqrt.default", [{"negative": 2}]), "op.sqrt_domain", "clamp_min"),
    (
        _at(
            category="op",
            op="aten.div.Tensor",
            node="SqrtBackward0",
            phase="backward",
            forward_op="aten.sqrt.default",
            inputs=[{}, {"zeros": 2}],
        ),
        "op.sqrt_domain",
        "eps",
    ),
    (_op("aten.exp.default", input_max=120.0, kind="inf"), "op.exp_overflow", "max"),
    (_op("aten.div.Tensor", [{}, {"zeros": 1}]), "op.division_by_zero", "clamp_min(1)"),
    (_op("aten.mm.default"), "unknown", "input statistics"),
    (_op("aten.std.correction", reduced_elements=1, correction=1.0), "op.division_by_zero", "std(correction=0)"),
    (_op("aten.mean.default", reduced_elements=0, correction=0), "op.division_by_zero", "max(n, 1)"),
    (
        _op("aten.smooth_l1_loss.default", reduced_elements=0, correction=0, targets=0, reduction=1),
        "data.no_valid_targets",
        "reduction='sum'",
    ),
    (_op("aten.acos.default", [{"min": -0.2, "max": 1.03}], kind="nan"), "op.trig_domain", "clamp"),
    (
        _at(
            category="op",
            op="aten.sub.Tensor",
            node="LogsumexpBackward0",
            phase="backward",
            inputs=[{"neginf": 5}, {"neginf": 1}],
            kind="nan",
        ),
        "op.masked_softmax",
        "finfo(dtype).min",
    ),
    (
        _op("aten.pow.Tensor_Scalar", [{"absmax": 1e20, "negative": 0}], input_max=1e20, kind="inf"),
        "op.exp_overflow",
        "bound the argument",
    ),
]


@pytest.mark.parametrize(("evidence", "cause", "fix_text"), CASES, ids=[c[1] + f"-{i}" for i, c in enumerate(CASES)])
def test_rule_table(evidence, cause, fix_text) -> None:
    verdict = diagnose(evidence)
    assert verdict.cause == cause
    assert diagnose(json.loads(json.dumps(evidence.to_dict()))).cause == cause  # the written form reads the same
    assert verdict.why
    assert any(fix_text in fix for fix in verdict.fixes), verdict.fixes


def test_data_wins_over_op_level_evidence() -> None:
    ev = _at(category="data", op="aten.log.default", path="x", inputs=[{"zeros": 3, "nan": 1}])
    assert diagnose(ev).cause == "data.nonfinite"


def test_init_rule_needs_an_overflow_not_just_big_weights() -> None:
    ev = _op(
        "aten.log.default", [{"zeros": 2, "absmax": 1.0}], kind="inf", weight_scale={"max_ratio": 200.0, "module": "fc"}
    )
    ev = replace(ev, kind="nan")
    assert diagnose(ev).cause == "op.log_domain"


def test_initial_weight_scale_overrides_the_current_one() -> None:
    ev = _op(
        "aten.bmm.default",
        [{"absmax": 1e6}],
        kind="inf",
        weight_scale={"max_ratio": 500.0},
        initial_weight_scale={"max_ratio": 0.2},
    )
    # Grown 2500-fold since the run's start: training's doing, not the init's (issue 42).
    assert diagnose(ev).cause == "optimizer.divergence"
    ev = replace(ev, initial_weight_scale={"max_ratio": 500.0, "module": "fc"})
    assert diagnose(ev).cause == "init.scale"


def test_every_rule_is_pure_and_returns_none_on_empty_evidence() -> None:
    for rule in RULES:
        assert rule({}) is None, rule.__name__


# -- the diagnoses the guard builds from its own state ----------------------------------
NAN = float("nan")
_MASKED = Finding("data.fully_masked", "batch['attention_mask'][3]", "every position is masked", fix="drop the sample")

GUARD_CASES = [
    (
        lambda: nonfinite_update(
            step=3,
            optimizer="Adam",
            hyperparameters={"eps": 0.0, "lr": 1e-3},
            bad_parameters=["h.0.fc.weight", "h.0.fc.bias"],
            rank=None,
            ranks=[],
        ),
        ("optimizer.nonfinite_update", "optimizer", "nan", "h.0.fc", None),
        "eps is 0.0",
    ),
    (
        lambda: nonfinite_update(
            step=3, optimizer="SGD", hyperparameters={"lr": 0.5}, bad_parameters=["w"], rank=1, ranks=[1]
        ),
        ("optimizer.nonfinite_update", "optimizer", "nan", "", 1),
        "now 0.5",
    ),
    (
        lambda: transient_fault(step=2, loss=NAN, grad_norm=1.0, flagged_ranks=[1], located=True, distributed=True),
        ("distributed.transient", "communication", "nan", None, 1),
        "TORCH_NCCL_NAN_CHECK",
    ),
    (
        lambda: transient_fault(
            step=2, loss=1.0, grad_norm=float("inf"), flagged_ranks=[0], located=False, distributed=False
        ),
        ("unknown", "backward", "inf", None, None),
        "hardware",
    ),
    # distributed.* needs torch.distributed: a single process that does not reproduce says just that
    (
        lambda: transient_fault(step=2, loss=NAN, grad_norm=NAN, flagged_ranks=[0], located=True, distributed=False),
        ("step.not_reproduced", "backward", "nan", None, None),
        "hardware",
    ),
    (
        lambda: loss_scale_collapse(step=9, scale=2.0**-10, floor=2.0**-8, streak=7, overflows=9, rank=None),
        ("precision.loss_scale", "backward", "inf", None, None),
        "bfloat16",
    ),
    (
        lambda: replica_divergence(step=4, ranks=[1, 3], first_parameter="h.0.fc.weight"),
        ("distributed.replica_divergence", "parameters", "invalid", "h.0.fc", 1),
        "broadcast",
    ),
    (
        lambda: rejected_batch([_MASKED], step=0, rank=None, ranks=[]),
        ("data.fully_masked", "data", "invalid", None, None),
        "drop the sample",
    ),
]


@pytest.mark.parametrize(
    ("build", "expected", "fix_text"), GUARD_CASES, ids=[c[1][0] + f"-{i}" for i, c in enumerate(GUARD_CASES)]
)
def test_guard_diagnosis_table(build, expected, fix_text) -> None:
    diag = build()
    assert (diag.cause, diag.phase, diag.kind, diag.module, diag.rank) == expected
    assert diag.evidence["why"]
    assert any(fix_text in fix for fix in diag.fixes), diag.fixes
    assert Diagnosis.from_dict(json.loads(json.dumps(diag.to_dict()))).cause == diag.cause


def test_nonfinite_update_names_what_it_counted() -> None:
    diag = nonfinite_update(
        step=0, optimizer="Adam", hyperparameters={}, bad_parameters=[f"p{i}" for i in range(20)], rank=None, ranks=[]
    )
    assert diag.evidence["nonfinite_parameters"] == 20 and diag.evidence["parameters"] == [f"p{i}" for i in range(16)]
    assert diag.op == "Adam.step" and "20 parameter tensor(s)" in diag.evidence["why"]


DIVERGING = {"diverging": True, "metric": "grad_norm", "growth": 80.0, "window": 5, "lr": 3.0}
CALM = {"diverging": False, "metric": "grad_norm", "growth": 1.1, "window": 5, "lr": 1e-3}
_LOG = _op("aten.log.default", [{"zeros": 4}]).origin
_BMM = _op("aten.bmm.default", [{"absmax": 1e6}]).origin


def _located(cause, origin, kind="nan"):
    evidence = Evidence(origin=origin, why="op").to_dict()
    return Diagnosis(cause=cause, kind=kind, op=origin.op, module="m", evidence=evidence)


def _update():
    return nonfinite_update(
        step=5, optimizer="Adam", hyperparameters={"lr": 3.0}, bad_parameters=["w"], rank=None, ranks=[]
    )


def _transient():
    return transient_fault(step=5, loss=NAN, grad_norm=NAN, flagged_ranks=[0], located=True, distributed=True)


# (diagnosis, history, initial weight scale, cause after, op_cause after, why replaced)
REJUDGE_CASES = [
    (lambda: _located("op.log_domain", _LOG), DIVERGING, None, "optimizer.divergence", "op.log_domain", True),
    (lambda: _located("op.log_domain", _LOG), CALM, None, "op.log_domain", None, False),
    (lambda: _located("op.log_domain", _LOG), {}, None, "op.log_domain", None, False),
    (lambda: _located("unknown", _BMM, "inf"), {}, {"max_ratio": 500.0, "module": "fc"}, "init.scale", "unknown", True),
    (lambda: _located("unknown", _BMM, "inf"), {}, {"max_ratio": 0.5}, "unknown", None, False),
    (_update, DIVERGING, None, "optimizer.divergence", "optimizer.nonfinite_update", False),
    (_update, CALM, None, "optimizer.nonfinite_update", None, False),
    (_transient, DIVERGING, None, "optimizer.divergence", "distributed.transient", True),
    (_transient, CALM, None, "distributed.transient", None, False),
]


@pytest.mark.parametrize(
    ("build", "history", "scale", "cause", "op_cause", "new_why"),
    REJUDGE_CASES,
    ids=[f"{i}-{c[3]}" for i, c in enumerate(REJUDGE_CASES)],
)
def test_rejudge_table(build, history, scale, cause, op_cause, new_why) -> None:
    diag = build()
    before = copy.deepcopy(diag)
    after = with_run_facts(diag, RunFacts(history, scale))
    assert diag == before, "rejudge must not change its argument"
    assert after.cause == cause and after.evidence.get("op_cause") == op_cause
    assert (after.evidence["why"] != before.evidence["why"]) == new_why
    if cause != before.cause:
        assert after.fixes != before.fixes
    if "origin" in before.evidence:
        assert after.evidence["origin"] == before.evidence["origin"]  # the op-level origin is kept
        assert after.evidence.get("history") == (history or None)


# -- issue 11: reductions, low precision with large weights, domains; diag.also ----------
def test_reductions_with_enough_elements_are_not_a_division_by_zero() -> None:
    # n - correction = 1 > 0: std of two elements is finite, whatever else made the NaN.
    assert diagnose(_op("aten.std.correction", reduced_elements=2, correction=1.0)).cause == "unknown"
    assert diagnose(_op("aten.mean.default", reduced_elements=3, correction=0)).cause == "unknown"


def test_a_mean_loss_over_some_targets_is_not_no_valid_targets() -> None:
    ev = _op("aten.mse_loss.default", reduced_elements=0, correction=0, targets=4, reduction=1)
    assert diagnose(ev).cause == "op.division_by_zero"


def test_division_by_zero_evidence_names_count_and_correction() -> None:
    why = diagnose(_op("aten.var.correction", reduced_elements=1, correction=1.0)).why
    assert "1 element(s)" in why and "correction 1" in why and "n - correction = 0" in why


def test_low_precision_overflow_with_large_weights_is_precision_with_init_scale_also() -> None:
    fp32 = {"finite": True, "absmax": 1.0e5, "dtype": "float16", "dtype_max": 65504.0}
    ev = _op(
        "aten.mm.default",
        [{"absmax": 160.0}],
        fp32_recompute=fp32,
        kind="inf",
        weight_scale={"max_ratio": 300.0, "module": "ff.wo"},
    )
    verdict = diagnose(ev)
    assert verdict.cause == "precision.overflow"
    assert [a["cause"] for a in verdict.also] == ["init.scale"]
    assert "ff.wo" in verdict.also[0]["why"] and "300x" in verdict.also[0]["why"]
    # The same overflow where float32 overflows as well is the init's.
    ev = replace(ev, origin=replace(ev.origin, extra={"fp32_recompute": {**fp32, "finite": False}}))
    assert diagnose(ev).cause == "init.scale"


def test_log_of_zero_next_to_large_weights_is_log_domain_without_init_hint() -> None:
    ev = _op(
        "aten.log.default", [{"zeros": 1, "absmax": 1.0}], kind="inf", weight_scale={"max_ratio": 17.0, "module": "fc"}
    )
    verdict = diagnose(ev)
    assert verdict.cause == "op.log_domain" and verdict.also == []


def test_log_rule_matches_log_nodes_only() -> None:
    for node in ("LogsumexpBackward0", "LogSigmoidBackward0", "LogSoftmaxBackward0"):
        ev = _at(category="op", op="aten.mul.Tensor", node=node, phase="backward", inputs=[{}, {"zeros": 1}])
        assert diagnose(ev).cause != "op.log_domain", node
    for node in ("LogBackward0", "Log2Backward0", "Log10Backward0"):
        ev = _at(category="op", op="aten.div.Tensor", node=node, phase="backward", inputs=[{}, {"zeros": 1}])
        assert diagnose(ev).cause == "op.log_domain", node


def test_pow_of_a_huge_finite_value_is_not_a_sqrt_domain_error() -> None:
    ev = _op("aten.pow.Tensor_Scalar", [{"absmax": 1e20, "negative": 0}], input_max=1e20, kind="inf")
    assert diagnose(ev).cause != "op.sqrt_domain"
    ev = _op("aten.pow.Tensor_Scalar", [{"min": -3.0, "negative": 1}], kind="nan")
    assert diagnose(ev).cause == "op.sqrt_domain"


def test_acos_inside_its_domain_is_not_trig_domain() -> None:
    ev = _op("aten.acos.default", [{"min": -0.5, "max": 0.5}], kind="nan")
    assert diagnose(ev).cause == "unknown"


def test_also_lists_other_fitting_causes_most_likely_first_without_the_winner() -> None:
    ev = _op(
        "aten.exp.default",
        [{"absmax": 1e5}],
        input_max=1e5,
        kind="inf",
        history={"diverging": True, "metric": "loss", "growth": 50.0, "window": 4},
        weight_scale={"max_ratio": 40.0, "module": "fc"},
    )
    verdict = diagnose(ev)
    causes = [a["cause"] for a in verdict.also]
    assert verdict.cause == "init.scale"
    assert causes == ["optimizer.divergence", "op.exp_overflow"]
    assert all(a["why"] for a in verdict.also)


def test_also_round_trips_and_shows_in_text() -> None:
    diag = Diagnosis(
        cause="precision.overflow",
        kind="inf",
        op="aten.mm.default",
        module="ff.wo",
        evidence={"why": "overflowed"},
        also=[{"cause": "init.scale", "why": "weights of 'ff.wo' are 300x the fan-in scale"}],
    )
    back = Diagnosis.from_dict(json.loads(json.dumps(diag.to_dict())))
    assert back == diag
    assert "also" in str(diag) and "init.scale: weights of 'ff.wo' are 300x the fan-in" in str(diag)
    with pytest.raises(ValueError, match="also"):
        Diagnosis(cause="unknown", also=[{"cause": "no.such", "why": ""}])


def test_rejudged_divergence_keeps_the_op_cause_in_also() -> None:
    ev = _op("aten.exp.default", input_max=300.0, kind="inf", why="exp overflowed")
    diag = Diagnosis(cause="op.exp_overflow", kind="inf", op="aten.exp.default", evidence=ev.to_dict())
    out = with_run_facts(diag, RunFacts({"diverging": True, "metric": "loss", "growth": 40.0, "window": 5}))
    assert out.cause == "optimizer.divergence"
    assert out.also and out.also[0]["cause"] == "op.exp_overflow"


@pytest.mark.filterwarnings("ignore:.*degrees of freedom is <= 0:UserWarning")
def test_located_pow_overflow_and_one_sample_std() -> None:
    import torch

    import nanguard as ng

    x = torch.tensor([1.0, -2.0], requires_grad=True)
    diag = ng.locate(lambda: ((1e20 * x) ** 2).sum(), model=None)
    assert diag is not None and diag.op == "aten.pow.Tensor_Scalar" and diag.cause != "op.sqrt_domain"
    adv = torch.tensor([0.7], requires_grad=True)
    diag = ng.locate(lambda: ((adv - adv.mean()) / (adv.std() + 1e-8)).sum())
    assert diag is not None and diag.cause == "op.division_by_zero" and diag.op == "aten.std.correction"
    assert diag.evidence["origin"]["reduced_elements"] == 1 and diag.evidence["origin"]["correction"] == 1


def test_kind_is_invalid_only_where_nothing_non_finite_exists() -> None:
    finite = replica_divergence(step=4, ranks=[1], first_parameter="h.0.fc.weight", source=0)
    nonfinite = replica_divergence(step=4, ranks=[1], first_parameter="h.0.fc.weight", source=0, nonfinite_ranks=[1])
    assert (finite.kind, nonfinite.kind) == ("invalid", "nan")
    nan_input = Finding("data.nonfinite", "batch['x']", "3 NaN values", fix="drop the sample")
    assert rejected_batch([nan_input], step=0, rank=None, ranks=[]).kind == "nan"
    assert rejected_batch([_MASKED], step=0, rank=None, ranks=[]).kind == "invalid"


def test_kind_is_validated_and_worded() -> None:
    diag = Diagnosis(cause="data.index_out_of_range", kind="invalid", phase="data", op="aten.embedding.default")
    assert kind_name("invalid") == "invalid value" and kind_name("nan") == "NaN"
    assert "invalid value" in summary(diag) and "NaN" not in summary(diag)
    assert "invalid value created" in diagnosis_text(diag)
    with pytest.raises(ValueError, match="kind must be one of"):
        Diagnosis(cause="unknown", kind="finite")


@pytest.mark.parametrize(
    ("attempted", "why"),
    [(False, "locate is off, so no replay was run"), (True, "its replay failed")],
)
def test_a_step_without_a_finished_replay_says_why(attempted, why) -> None:
    d = transient_fault(
        step=2, loss=NAN, grad_norm=1.0, flagged_ranks=[0], located=False, distributed=True, attempted=attempted
    )
    assert d.cause == "unknown" and why in d.evidence["why"]
    assert "locate is off" not in d.evidence["why"] or not attempted


# -- a normalization whose statistics overflow is not a zero variance (issue 27, item 4) ----
_LN_OVERFLOW = {
    "op": "aten.native_layer_norm.default",
    "module_type": "LayerNorm",
    "norm_eps": 1e-5,
    "min_variance": 3.0,
    "max_variance": float("inf"),
    "inputs": [{"absmax": 8e20, "dtype": "float32"}],
}


def test_a_norm_whose_variance_overflowed_after_the_weights_grew_is_divergence() -> None:
    ev = _op(
        **_LN_OVERFLOW,
        kind="nan",
        weight_scale={"max_ratio": 2e7, "module": "blocks.0.mlp.proj"},
        initial_weight_scale={"max_ratio": 0.45, "module": "blocks.0.mlp.proj"},
    )
    verdict = diagnose(ev)
    assert verdict.cause == "optimizer.divergence"
    assert "not a zero variance" in verdict.why and "blocks.0.mlp.proj" in verdict.why
    assert any("learning rate" in fix for fix in verdict.fixes)
    assert not any("eps" in fix for fix in verdict.fixes)


def test_a_norm_whose_variance_overflowed_without_grown_weights_names_no_eps() -> None:
    # locate alone (no scale from the run's start), or weights at their start scale: not a zero variance either
    for extra in ({}, {"weight_scale": {"max_ratio": 0.5}, "initial_weight_scale": {"max_ratio": 0.45}}):
        verdict = diagnose(_op(**_LN_OVERFLOW, kind="nan", **extra))
        assert verdict.cause == "unknown" and "overflows float32" in verdict.why
    # the backward of such a norm: its input's squares overflow float32
    node = {
        "op": "aten.native_layer_norm_backward.default",
        "node": "NativeLayerNormBackward0",
        "inputs": [{"absmax": 1.0}, {"absmax": 5e19}],
    }
    assert diagnose(_op(**node, kind="nan")).cause == "unknown"
    # a finite variance, however small, is still the eps's business
    assert diagnose(_op(**{**_LN_OVERFLOW, "max_variance": 4.0, "inputs": [{"absmax": 3.0}]})).cause == (
        "norm.zero_variance"
    )


@pytest.mark.parametrize("op", ["aten.div.Tensor", "aten.div_.Tensor"])
def test_a_tensor_divided_by_the_number_zero_is_a_division_by_zero(op) -> None:
    verdict = diagnose(_op(op, [{"zeros": 0, "absmax": 2.0}], scalars=[0.0]))
    assert verdict.cause == "op.division_by_zero" and "the number 0" in verdict.why
    assert diagnose(_op(op, [{"zeros": 0, "absmax": 2.0}], scalars=[2.0])).cause == "unknown"


def test_an_optimizer_eps_that_is_zero_in_the_parameters_dtype_is_named() -> None:
    def fixes(dtype):
        return nonfinite_update(
            step=0,
            optimizer="AdamW",
            hyperparameters={"eps": 1e-8, "lr": 1e-3},
            bad_parameters=["wte.weight"],
            rank=None,
            ranks=[],
            dtype=dtype,
        ).fixes

    assert "eps=1e-08 is 0 in float16" in fixes("float16")[0]
    for dtype in ("bfloat16", "float32", None):  # 1e-8 is a normal bfloat16 and float32 value
        assert not any("is 0 in" in fix for fix in fixes(dtype))


def test_loaded_nonfinite_parameters_name_their_rows_and_module() -> None:
    from nanguard.diagnose import loaded_nonfinite

    found = [{"name": "wte.weight", "module": "wte", "nan": 128, "inf": 0, "rows": [0]}]
    diag = loaded_nonfinite(step=0, found=found, rank=None, ranks=[])
    assert (diag.cause, diag.phase, diag.kind, diag.module) == ("parameters.nonfinite", "parameters", "nan", "wte")
    assert diag.evidence["loaded"] and diag.evidence["rows"] == [0] and "rows [0] of wte.weight" in diag.evidence["why"]
    only_optimizer = [
        {"name": "optimizer.param_groups[0]['params'][2]", "module": None, "nan": 0, "inf": 3, "rows": []}
    ]
    diag = loaded_nonfinite(step=4, found=only_optimizer, rank=1, ranks=[1])
    assert (diag.module, diag.kind, diag.rank) == (None, "inf", 1)
