"""The origin record (``nanguard.evidence``) against what the tracer writes: every key it names is
written by the tracer, a real origin reads back exactly, and a misnamed key is not silently read."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

import nanguard as ng
from nanguard.evidence import OriginEvidence
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
