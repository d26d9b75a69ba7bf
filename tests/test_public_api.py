import importlib
import json

import pytest
import torch

import nanguard as ng
from nanguard.findings import Diagnosis, Finding


def test_all_is_pinned() -> None:
    assert sorted(ng.__all__) == sorted(
        [
            "CAUSES",
            "Diagnosis",
            "Finding",
            "Guard",
            "NonFiniteError",
            "QuarantineSampler",
            "audit_model",
            "bisect",
            "check_batch",
            "load_bundle",
            "locate",
            "replay",
        ]
    )
    for name in ng.__all__:  # each public name is the object of its home module, loaded on first use
        assert getattr(ng, name) is getattr(importlib.import_module(HOMES[name]), name), name


HOMES = {
    "CAUSES": "nanguard.findings",
    "Diagnosis": "nanguard.findings",
    "Finding": "nanguard.findings",
    "Guard": "nanguard.guard",
    "NonFiniteError": "nanguard.errors",
    "QuarantineSampler": "nanguard.sampler",
    "audit_model": "nanguard.audit",
    "bisect": "nanguard.bisection",
    "check_batch": "nanguard.audit",
    "load_bundle": "nanguard.bundle",
    "locate": "nanguard.tracer",
    "replay": "nanguard.bundle",
}


def test_public_names_have_their_kinds() -> None:
    for name in ("Diagnosis", "Finding", "Guard", "QuarantineSampler"):
        assert isinstance(getattr(ng, name), type), name
    assert issubclass(ng.NonFiniteError, Exception)
    for name in ("audit_model", "bisect", "check_batch", "load_bundle", "locate", "replay"):
        fn = getattr(ng, name)
        assert callable(fn) and not isinstance(fn, type) and fn.__doc__, name
    assert all(isinstance(k, str) and isinstance(v, str) and v for k, v in ng.CAUSES.items())
    with pytest.raises(AttributeError, match="no attribute 'banana'"):
        ng.banana  # noqa: B018


def test_locate_names_a_real_fault_with_every_contract_field() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(dim=-1))
    x = torch.randn(3, 4)

    def step() -> torch.Tensor:
        probs = model(x)
        loss = -torch.log(probs * torch.tensor([1.0, 0.0, 1.0, 1.0])).mean()  # a probability zeroed: log(0)
        loss.backward()
        return loss

    before = model[0].weight.detach().clone()
    diag = ng.locate(step, model=model)
    assert isinstance(diag, ng.Diagnosis)
    assert (diag.cause, diag.kind, diag.phase, diag.op) == ("op.log_domain", "inf", "forward", "aten.log.default")
    assert diag.module is None and diag.rank is None and diag.ranks == [] and diag.step is None
    assert diag.source is not None and diag.source.split(":")[0].endswith("test_public_api.py")
    assert diag.evidence["origin"]["inputs"][0]["zeros"] >= 3  # one zeroed column of 3 rows
    assert json.loads(json.dumps(diag.to_dict()))["cause"] == "op.log_domain"
    assert diag.fixes and all(isinstance(f, str) and f for f in diag.fixes)
    assert all(a["cause"] in ng.CAUSES and a["why"] for a in diag.also)
    assert torch.equal(model[0].weight, before)  # locate steps no optimizer
    model.zero_grad(set_to_none=True)  # locate leaves the gradients as the step made them: NaN
    assert ng.locate(lambda: model(x).sum().backward(), model=model) is None


CONTRACT_CAUSES = [
    "data.nonfinite",
    "data.index_out_of_range",
    "data.fully_masked",
    "data.no_valid_targets",
    "parameters.nonfinite",
    "op.log_domain",
    "op.sqrt_domain",
    "op.division_by_zero",
    "op.exp_overflow",
    "op.masked_softmax",
    "norm.zero_variance",
    "precision.overflow",
    "precision.loss_scale",
    "optimizer.divergence",
    "optimizer.nonfinite_update",
    "init.scale",
    "distributed.replica_divergence",
    "distributed.transient",
    "unknown",
]


def test_causes_keep_every_contract_id_with_a_meaning() -> None:
    for cause in CONTRACT_CAUSES:
        assert cause in ng.CAUSES
        assert ng.CAUSES[cause]


def test_diagnosis_validates_and_round_trips_through_json() -> None:
    with pytest.raises(ValueError, match="cause must be one of"):
        Diagnosis(cause="op.banana")
    with pytest.raises(ValueError, match="phase must be one of"):
        Diagnosis(cause="unknown", phase="lunch")
    diag = Diagnosis(
        cause="op.log_domain",
        kind="inf",
        op="aten.log.default",
        module="head",
        step=3,
        evidence={"loss": float("nan"), "why": "log of 0"},
        fixes=["use log_softmax"],
    )
    data = json.loads(json.dumps(diag.to_dict()))
    assert data["evidence"]["loss"] == "nan"
    back = Diagnosis.from_dict(data)
    assert (back.cause, back.op, back.module, back.step) == ("op.log_domain", "aten.log.default", "head", 3)
    text = str(diag)
    assert "op.log_domain" in text and "head" in text and "use log_softmax" in text and "log of 0" in text


def test_finding_validates_cause() -> None:
    with pytest.raises(ValueError, match="cause must be one of"):
        Finding(cause="nope", where="x", message="m")
    assert "batch['x']" in str(Finding(cause="data.nonfinite", where="batch['x']", message="2 NaN"))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: ng.locate(42), "fn must be callable"),
        (lambda: ng.locate(lambda: None, model="gpt"), "model must be a torch.nn.Module"),
        (lambda: ng.Guard("m", torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1)), "model must be"),
        (lambda: ng.Guard(torch.nn.Linear(1, 1), "adam"), "optimizer must be"),
        (lambda: _guard(policy="retry"), "policy must be one of"),
        (lambda: _guard(max_consecutive_skips=0), "max_consecutive_skips"),
        (lambda: _guard(spike_threshold=-1.0), "spike_threshold"),
        (lambda: _guard(frobnicate=True), "unknown Guard option"),
        (lambda: _guard(lr_factor=2.0), "lr_factor"),
        (lambda: _guard(quarantine="all"), "quarantine must be one of"),
        (lambda: _guard(headroom_every=-1), "headroom_every"),
        (lambda: _guard(remedy_budget=-1), "remedy_budget"),
        (lambda: ng.QuarantineSampler(3, "runs"), "inner_sampler"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def _guard(policy: str = "skip", **config):
    model = torch.nn.Linear(2, 2)
    return ng.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy, **config)
