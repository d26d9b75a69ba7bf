"""audit_model and the dtype table: each model cause on tiny seeded models."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from nanguard.audit import audit_model
from nanguard.dtypes import DTYPES, dtype_facts


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.relu(self.fc(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.head = nn.Linear(d, vocab, bias=False)


def _convnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.LazyLinear(10))


class T5Norm(nn.Module):
    """A hand-written RMSNorm in the Hugging Face style (``variance_epsilon``)."""

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps


def _audit(model: nn.Module) -> list[tuple[str, str, str]]:
    return [(f.cause, f.where, f.severity) for f in audit_model(model, data_parallel=False)]


@pytest.mark.parametrize(
    "build",
    [
        TinyLM,
        lambda: TinyLM().half(),
        lambda: TinyLM().to(torch.bfloat16),
        lambda: TinyLM().double(),
        _convnet,
        lambda: nn.Sequential(nn.ConvTranspose1d(4, 2, 5), nn.GroupNorm(1, 2)),
        lambda: nn.Sequential(nn.Linear(4, 4), nn.CosineSimilarity(eps=0.0), nn.RMSNorm(4)),
        lambda: nn.Linear(1, 1),
    ],
)
def test_sound_models_have_no_findings(build: Callable[[], nn.Module]) -> None:
    assert _audit(build()) == []


@pytest.mark.parametrize(
    ("build", "dtype", "where", "flagged"),
    [
        (lambda: nn.LayerNorm(8, eps=0.0), torch.float32, "", True),
        (lambda: nn.LayerNorm(8, eps=1e-12), torch.float32, "", False),
        (lambda: nn.LayerNorm(8, eps=1e-5), torch.float16, "", False),
        (lambda: nn.LayerNorm(8, eps=1e-6), torch.float16, "", True),
        (lambda: nn.LayerNorm(8, eps=1e-6), torch.bfloat16, "", False),
        (lambda: nn.LayerNorm(8, eps=1e-12), torch.bfloat16, "", True),
        (lambda: nn.GroupNorm(2, 8, eps=0), torch.float32, "", True),
        (lambda: nn.BatchNorm1d(8, eps=0.0), torch.float32, "", True),
        (lambda: nn.InstanceNorm1d(8, eps=1e-9, affine=True), torch.float16, "", True),
        (lambda: nn.RMSNorm(8, eps=1e-8), torch.float16, "", True),
        (lambda: nn.Sequential(nn.Linear(8, 8), T5Norm(8, 1e-12)), torch.float16, "1", True),
        (lambda: nn.Sequential(nn.Linear(8, 8), T5Norm(8, 1e-6)), torch.float32, "1", False),
    ],
)
def test_norm_eps_against_the_parameter_dtype(
    build: Callable[[], nn.Module], dtype: torch.dtype, where: str, flagged: bool
) -> None:
    findings = audit_model(build().to(dtype), data_parallel=False)
    expected = [("norm.zero_variance", where)] if flagged else []
    assert [(f.cause, f.where) for f in findings] == expected


def test_norm_eps_message_names_dtype_floor_and_module() -> None:
    model = nn.Sequential(Block(8), Block(8)).half()
    model[1].norm.eps = 0.0
    (finding,) = audit_model(model, data_parallel=False)
    assert finding.where == "1.norm"
    assert finding.message.startswith("LayerNorm eps is 0.0; use >= 1e-5 (float16 resolves no smaller)")
    assert "eps=1e-5" in finding.fix


def test_eps_that_rounds_to_zero_in_the_dtype_says_so() -> None:
    (finding,) = audit_model(nn.LayerNorm(4, eps=1e-9).half(), data_parallel=False)
    assert finding.details["rounds_to_zero"] is True
    assert "rounds to 0 in float16" in finding.message


def test_a_norm_without_parameters_takes_the_model_dtype() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8, eps=1e-7, elementwise_affine=False))
    assert _audit(model) == []
    assert _audit(model.half()) == [("norm.zero_variance", "1", "error")]


@pytest.mark.parametrize(
    ("scale", "severity", "text"),
    [
        (100.0, "error", "x 1/sqrt(fan_in=16)"),
        (1e-5, "warning", "vanish"),
        (0.0, "warning", "all zeros"),
    ],
)
def test_linear_init_scale(scale: float, severity: str, text: str) -> None:
    model = TinyLM()
    with torch.no_grad():
        model.blocks[0].fc.weight.mul_(scale)
    (finding,) = audit_model(model, data_parallel=False)
    assert (finding.cause, finding.where, finding.severity) == (
        "init.scale",
        "blocks.0.fc",
        severity,
    )
    assert text in finding.message
    assert finding.details["fan_in"] == 16


def test_conv_fan_in_counts_the_kernel() -> None:
    model = _convnet()
    with torch.no_grad():
        model[0].weight.normal_(0, 1.0)  # ratio sqrt(3*3*3) ~ 5: large but not wrong
    assert _audit(model) == []
    with torch.no_grad():
        model[0].weight.mul_(4.0)
    (finding,) = audit_model(model, data_parallel=False)
    assert (finding.cause, finding.where) == ("init.scale", "0")
    assert finding.details["fan_in"] == 27
    assert finding.details["ratio"] == pytest.approx(20.8, rel=0.2)


def test_embeddings_and_weights_tied_to_them_are_exempt() -> None:
    model = TinyLM(vocab=64, d=256)
    with torch.no_grad():
        model.emb.weight.normal_(0, 1.0)  # nn.Embedding's default: ratio 16 as a Linear
    model.head.weight = model.emb.weight
    assert _audit(model) == []


@pytest.mark.parametrize(
    ("dtype", "value", "flagged"),
    [
        (torch.float16, 30000.0, True),
        (torch.float16, 4000.0, False),
        (torch.bfloat16, 1e38, True),
        (torch.float32, 1e38, False),
    ],
)
def test_low_precision_values_near_the_dtype_max(dtype: torch.dtype, value: float, flagged: bool) -> None:
    model = TinyLM().to(dtype)
    with torch.no_grad():
        model.blocks[1].norm.weight[3] = value
    findings = audit_model(model, data_parallel=False)
    expected = [("precision.overflow", "blocks.1.norm")] if flagged else []
    assert [(f.cause, f.where) for f in findings] == expected
    if flagged:
        assert findings[0].details["tensor"] == "blocks.1.norm.weight"


def test_nonfinite_parameters_and_buffers_are_counted_and_nothing_else_is_said() -> None:
    model = _convnet()
    model(torch.randn(2, 3, 6, 6))  # materialize the LazyLinear
    with torch.no_grad():
        model[0].weight[0, 0, 0, :2] = float("nan")
        model[0].weight[1, 0, 0, 0] = float("inf")
        model[1].running_var[2] = float("inf")
    findings = audit_model(model, data_parallel=False)
    got = {(f.cause, f.where, f.details["tensor"]): f.details for f in findings}
    assert set(got) == {
        ("parameters.nonfinite", "0", "0.weight"),
        ("parameters.nonfinite", "1", "1.running_var"),
    }
    weight = got[("parameters.nonfinite", "0", "0.weight")]
    assert (weight["nan"], weight["inf"], weight["kind"]) == (2, 1, "parameter")
    assert "reset_running_stats" in findings[1].fix


@pytest.mark.parametrize(
    ("data_parallel", "world_size", "expected"),
    [
        (True, 1, ["0", "2"]),
        (False, 4, []),
        (None, 4, ["0", "2"]),
        (None, 1, []),
    ],
)
def test_batchnorm_under_data_parallelism(
    monkeypatch: pytest.MonkeyPatch,
    data_parallel: bool | None,
    world_size: int,
    expected: list[str],
) -> None:
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world_size)
    model = nn.Sequential(nn.BatchNorm1d(4), nn.SyncBatchNorm(4), nn.BatchNorm2d(4), nn.LayerNorm(4))
    findings = audit_model(model, data_parallel=data_parallel)
    assert [f.where for f in findings] == expected
    assert all(f.cause == "distributed.replica_divergence" for f in findings)
    assert all(f.severity == "warning" for f in findings)
    assert all("convert_sync_batchnorm" in f.fix for f in findings)


def test_few_host_reads(host_reads: list[int]) -> None:
    reads = host_reads
    model = nn.Sequential(*[Block(8) for _ in range(6)])
    assert audit_model(model, data_parallel=False) == []
    assert len(reads) == 1
    with torch.no_grad():
        model[3].fc.bias[0] = float("nan")
    assert [f.where for f in audit_model(model, data_parallel=False)] == ["3.fc"]
    assert len(reads) == 3  # the second read counts NaN/Inf only in the non-finite tensor


def test_every_finding_is_json_safe_and_has_a_fix() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, eps=0.0)).half()
    with torch.no_grad():
        model[0].weight.mul_(1000)
        model[1].running_mean[0] = float("nan")
    findings = audit_model(model, data_parallel=True)
    assert {f.cause for f in findings} == {
        "parameters.nonfinite",
        "norm.zero_variance",
        "init.scale",
        "distributed.replica_divergence",
    }
    for finding in findings:
        assert len(finding.fix) > 20
        json.dumps(finding.to_dict())


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"model": "resnet"}, "model"),
        ({"model": nn.Linear(2, 2), "data_parallel": 1}, "data_parallel"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        audit_model(**kwargs)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_dtype_table_matches_finfo_and_its_eps_floor_is_representable(dtype: torch.dtype) -> None:
    facts = dtype_facts(dtype)
    assert facts is not None
    assert facts.max == torch.finfo(dtype).max
    assert facts.resolution == torch.finfo(dtype).eps
    assert 0 < facts.overflow_threshold < facts.max
    assert torch.tensor(facts.min_norm_eps, dtype=dtype).item() > 0
    assert facts.low_precision == (torch.finfo(dtype).bits == 16)


def test_dtype_table_skips_non_float_dtypes() -> None:
    assert dtype_facts(torch.int64) is None
