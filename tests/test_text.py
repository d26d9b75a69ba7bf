"""The text layer: one wording of a diagnosis for str(diag), the terminal and the HTML report."""

from __future__ import annotations

import pytest

from nanguard.findings import Diagnosis
from nanguard.text import diagnosis_text, kind_name, short_op, summary


def _diag() -> Diagnosis:
    return Diagnosis(
        cause="op.log_domain",
        kind="inf",
        op="aten.log.default",
        module="head",
        source="train.py:12",
        step=3,
        evidence={"why": "log of 0", "loss": 1.5, "origin": {"module_type": "Linear"}},
        fixes=["use log_softmax", "clamp the input"],
    )


@pytest.mark.parametrize(
    ("op", "short"),
    [
        ("aten.log.default", "log"),
        ("aten._softmax.default", "_softmax"),
        ("aten.add.Tensor", "add"),
        ("aten.log", "log"),
        ("prims.div.default", "prims.div.default"),
        ("SoftmaxBackward0", "SoftmaxBackward0"),
        (None, ""),
        ("", ""),
    ],
)
def test_short_op_drops_only_the_aten_namespace_and_overload(op, short: str) -> None:
    assert short_op(op) == short


def test_str_is_the_short_form_of_the_full_text() -> None:
    diag = _diag()
    short, full = str(diag).splitlines(), diagnosis_text(diag).splitlines()
    assert short == diagnosis_text(diag, evidence=False).splitlines()
    assert short[0] == f"nanguard: Inf created - op.log_domain ({diag.meaning})" == full[0]
    labels = [line.split()[0] for line in short[1:] if not line.split()[0][0].isdigit()]
    assert labels == ["module", "op", "your", "phase", "step", "why", "try"]
    assert "values" not in str(diag) and any(line.split()[:1] == ["values"] for line in full)
    assert set(short) <= set(full)  # the short form says nothing the full one does not
    assert short[-1].split() == ["2.", "clamp", "the", "input"]


def test_summary_and_kind_names() -> None:
    diag = _diag()
    assert diag.summary() == summary(diag) == "op.log_domain: Inf in aten.log.default module 'head' (forward) step 3"
    assert (kind_name("nan"), kind_name("inf"), kind_name("other")) == ("NaN", "Inf", "other")
