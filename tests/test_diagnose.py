"""Each rule in isolation, from evidence tables."""

import pytest

from nanguard.diagnose import RULES, diagnose


def _op(op, inputs=None, **extra):
    origin = {"category": "op", "op": op, "module": "m", "phase": "forward", "inputs": inputs or [{}]}
    return {"origin": {**origin, **extra}}


CASES = [
    ({"origin": {"category": "index", "op": "aten.embedding.default", "indexed_size": 10,
                 "index_inputs": [{"min": 0, "max": 10, "path": "batch['input_ids']"}], "error": "IndexError"}},
     "data.index_out_of_range", "ids must be < 10"),
    (_op("aten.nll_loss_forward.default", targets=8, valid_targets=0, ignore_index=-100),
     "data.no_valid_targets", "-100"),
    ({"origin": {"category": "data", "path": "batch['x']", "inputs": [{"nan": 3}]}}, "data.nonfinite", "batch['x']"),
    ({"origin": {"category": "fill", "path": "mask", "inputs": [{"neginf": 3}]}}, "data.nonfinite", "mask"),
    ({"origin": {"category": "parameters", "path": "fc.weight", "module": "fc", "inputs": [{"nan": 1}]}},
     "parameters.nonfinite", "checkpoint"),
    ({**_op("aten.bmm.default", [{"absmax": 1e5}]), "kind": "inf",
      "weight_scale": {"max_ratio": 200.0, "module": "fc"}}, "init.scale", "1/sqrt(fan_in)"),
    ({**_op("aten.exp.default", input_max=300.0), "kind": "inf",
      "history": {"diverging": True, "metric": "loss", "growth": 50.0, "window": 4, "lr": 3.0}},
     "optimizer.divergence", "learning rate (now 3)"),
    (_op("aten.bmm.default", fp32_recompute={"finite": True, "absmax": 1e5, "dtype": "float16", "dtype_max": 65504.0}),
     "precision.overflow", "bfloat16"),
    (_op("aten._softmax.default", fully_masked_rows=2, rows=8), "op.masked_softmax", "finfo(dtype).min"),
    (_op("aten.native_layer_norm.default", norm_eps=0.0, min_variance=0.0, module_type="LayerNorm"),
     "norm.zero_variance", "LayerNorm eps is 0.0; use >= 1e-05"),
    ({"origin": {"category": "op", "op": "aten.mul.Tensor", "node": "NativeLayerNormBackward0", "inputs": [{}]}},
     "norm.zero_variance", "eps"),
    (_op("aten.log.default", [{"zeros": 4}]), "op.log_domain", "log_softmax"),
    ({"origin": {"category": "op", "op": "aten.div.Tensor", "node": "LogBackward0", "phase": "backward",
                 "inputs": [{}, {"zeros": 1}]}}, "op.log_domain", "log_softmax"),
    (_op("aten.sqrt.default", [{"negative": 2}]), "op.sqrt_domain", "clamp_min"),
    ({"origin": {"category": "op", "op": "aten.div.Tensor", "node": "SqrtBackward0", "phase": "backward",
                 "forward_op": "aten.sqrt.default", "inputs": [{}, {"zeros": 2}]}}, "op.sqrt_domain", "eps"),
    ({**_op("aten.exp.default", input_max=120.0), "kind": "inf"}, "op.exp_overflow", "max"),
    (_op("aten.div.Tensor", [{}, {"zeros": 1}]), "op.division_by_zero", "clamp_min(1)"),
    (_op("aten.mm.default"), "unknown", "input statistics"),
]  # fmt: skip


@pytest.mark.parametrize(("evidence", "cause", "fix_text"), CASES, ids=[c[1] + f"-{i}" for i, c in enumerate(CASES)])
def test_rule_table(evidence, cause, fix_text) -> None:
    verdict = diagnose(evidence)
    assert verdict.cause == cause
    assert verdict.why
    assert any(fix_text in fix for fix in verdict.fixes), verdict.fixes


def test_data_wins_over_op_level_evidence() -> None:
    ev = {"origin": {"category": "data", "op": "aten.log.default", "path": "x", "inputs": [{"zeros": 3, "nan": 1}]}}
    assert diagnose(ev).cause == "data.nonfinite"


def test_init_rule_needs_an_overflow_not_just_big_weights() -> None:
    ev = {**_op("aten.log.default", [{"zeros": 2, "absmax": 1.0}]), "kind": "inf",
          "weight_scale": {"max_ratio": 200.0, "module": "fc"}}  # fmt: skip
    ev["kind"] = "nan"
    assert diagnose(ev).cause == "op.log_domain"


def test_initial_weight_scale_overrides_the_current_one() -> None:
    ev = {**_op("aten.bmm.default", [{"absmax": 1e6}]), "kind": "inf",
          "weight_scale": {"max_ratio": 500.0}, "initial_weight_scale": {"max_ratio": 0.2}}  # fmt: skip
    assert diagnose(ev).cause == "unknown"
    ev["initial_weight_scale"] = {"max_ratio": 500.0, "module": "fc"}
    assert diagnose(ev).cause == "init.scale"


def test_every_rule_is_pure_and_returns_none_on_empty_evidence() -> None:
    for rule in RULES:
        assert rule({}) is None, rule.__name__
