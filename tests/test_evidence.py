"""The evidence records (``nanguard.evidence``) against what the tracer writes: every key they name is
written by the tracer, real evidence reads back exactly, and a misnamed key is not silently read;
a trip is diagnosed once, with the run's facts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import nanguard as ng
from nanguard.diagnose import diagnose
from nanguard.evidence import Evidence, OriginEvidence, RunFacts
from nanguard.guard.remedies import bad_rows


def _origin(fn, *args, model=None) -> dict:
    diag = ng.locate(fn, *args, model=model)
    assert diag is not None
    return diag.evidence["origin"]


def test_a_traced_op_origin_reads_back_exactly_through_the_record() -> None:
    model = nn.Linear(3, 1)
    written = _origin(lambda x: torch.log(model(x) - 100).sum(), torch.ones(2, 3), model=model)
    origin = OriginEvidence.from_dict(written)
    assert origin.to_dict() == written
    assert (origin.category, origin.op, origin.phase) == ("op", "aten.log.default", "forward")
    assert origin.inputs and origin.located


def test_every_key_the_record_names_is_one_the_tracer_writes() -> None:
    emb = nn.Embedding(5, 2)
    ids = torch.tensor([[1, 7]])
    index = OriginEvidence.from_dict(_origin(lambda batch: emb(batch["ids"]).sum(), {"ids": ids}, model=emb))
    data = OriginEvidence.from_dict(
        _origin(lambda batch: (batch["x"] * 2).sum(), {"x": torch.tensor([1.0, float("nan")])})
    )
    op = OriginEvidence.from_dict(_origin(lambda x: torch.log(x - 5).sum(), torch.ones(2)))
    seen = set(index.given) | set(data.given) | set(op.given)
    named = {f.name for f in dataclasses.fields(OriginEvidence)} - {"extra", "given"}
    assert named <= seen, sorted(named - seen)
    assert index.category == "index" and index.indexed_size == 5 and index.index_inputs[0]["path"] == "batch['ids']"
    assert data.path == "batch['x']"


def test_bad_rows_reads_the_rows_through_the_record() -> None:
    x = torch.tensor([[1.0], [float("nan")], [2.0]])
    diag = ng.locate(lambda batch: (batch["x"] * 2).sum(), {"x": x})
    assert diag is not None and diag.cause == "data.nonfinite"
    assert bad_rows(diag, {"x": x}, n_rows=3) == [1]
    renamed = {k: v for k, v in diag.evidence["origin"].items() if k != "path"} | {"input_path": "batch['y']"}
    record = OriginEvidence.from_dict(renamed)
    assert record.path is None and record.extra["input_path"] == "batch['y']"  # kept, never read as the path


def test_the_evidence_record_reads_a_traced_diagnosis_back_exactly_in_order() -> None:
    model = nn.Linear(3, 1)
    diag = ng.locate(lambda x: torch.log(model(x) - 100).sum(), torch.ones(2, 3), model=model)
    assert diag is not None
    record = Evidence.from_dict(diag.evidence)
    assert record.to_dict() == diag.evidence and list(record.to_dict()) == list(diag.evidence)
    assert record.kind == "nan" and record.why == diag.evidence["why"] and record.weight_scale is not None
    assert isinstance(record.origin, OriginEvidence) and record.origin.op == "aten.log.default"
    with pytest.raises(KeyError, match=r"read \.op"):
        record.origin.get("op")  # a named key is read as the field, never by its string


def test_a_value_of_the_wrong_kind_is_kept_but_not_read_as_the_field() -> None:
    written = {"kind": 3, "history": "grew", "why": "w", "where": {"host": "n"}}
    record = Evidence.from_dict(written)
    assert record.kind is None and record.history is None and record.why == "w"
    assert record.get("where") == {"host": "n"} and record.to_dict() == written


def _counting(monkeypatch) -> list[int]:
    import nanguard.diagnose as rules
    import nanguard.tracer.api as api

    calls: list[int] = []
    real = rules.diagnose

    def counted(evidence):
        calls.append(1)
        return real(evidence)

    monkeypatch.setattr(rules, "diagnose", counted)
    monkeypatch.setattr(api, "diagnose", counted)
    return calls


def test_a_trip_is_diagnosed_once_with_the_run_history(monkeypatch) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    guard = ng.Guard(model, torch.optim.SGD(model.parameters(), lr=0.01), policy="raise")
    x = torch.randn(8, 4)

    def closure(shift: float):
        model.zero_grad(set_to_none=True)
        loss = torch.log(model(x).abs() * 0 + shift).sum() + model(x).square().mean()
        loss.backward()
        return loss

    for _ in range(3):
        guard.step(lambda: closure(1.0))
    calls = _counting(monkeypatch)
    with pytest.raises(ng.NonFiniteError) as info:
        guard.step(lambda: closure(0.0))  # log(0): -inf, its gradient 1/0
    diag = info.value.diagnosis
    assert diag.cause == "op.log_domain" and diag.op == "aten.log.default"
    assert len(calls) == 1  # the tracer's diagnose, with the guard's facts; no second reading
    record = Evidence.from_dict(diag.evidence)
    assert "initial_weight_scale" in record.given and record.history and record.history["window"] == 3
    assert record.op_cause is None  # the history did not overrule the op


def test_the_history_overrules_a_traced_op_in_the_one_diagnosis() -> None:
    ev = {"origin": {"category": "op", "op": "aten.exp.default", "inputs": [{}], "input_max": 300.0}, "kind": "inf"}
    grew = RunFacts(history={"diverging": True, "metric": "loss", "growth": 40.0, "window": 5})
    verdict = diagnose({**ev, **grew.written()})
    assert verdict.cause == "optimizer.divergence" and verdict.op_cause == "op.exp_overflow"
    assert diagnose(ev).op_cause is None  # no facts given: nothing to compare with
    calm = RunFacts(history={"diverging": False, "metric": "loss", "growth": 1.1, "window": 5})
    assert diagnose({**ev, **calm.written()}).op_cause is None
