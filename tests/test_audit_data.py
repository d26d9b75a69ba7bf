"""check_batch: each data cause on real tensors, in every container shape, with one read."""

from __future__ import annotations

import json
import warnings
from collections import OrderedDict, namedtuple
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nanguard.audit import check_batch
from nanguard.audit.data import MAX_LISTED
from nanguard.findings import CAUSES

NAN, INF = float("nan"), float("inf")


@dataclass
class Batch:
    input_ids: torch.Tensor
    pixel_values: torch.Tensor


class Output(OrderedDict):  # the shape of transformers' ModelOutput: an ordered Mapping
    pass


Pair = namedtuple("Pair", ["inputs", "target"])


def _ids(rows: int = 2, cols: int = 5, vocab: int = 50) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, cols), generator=torch.Generator().manual_seed(0))


def _lm_batch() -> dict[str, torch.Tensor]:
    ids = _ids()
    labels = ids.clone()
    labels[:, :2] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _additive_mask() -> torch.Tensor:
    mask = torch.zeros(2, 1, 3, 3)
    mask[..., 2] = -INF  # last key masked for every query: intended, not a finding
    return mask


def _causes(findings: list[Any]) -> list[tuple[str, str]]:
    return [(f.cause, f.where) for f in findings]


@pytest.mark.parametrize(
    ("batch", "kwargs"),
    [
        pytest.param(_lm_batch(), {"vocab_size": 50}, id="lm-dict"),
        pytest.param(Output(_lm_batch()), {"vocab_size": 50}, id="model-output-mapping"),
        pytest.param((torch.randn(4, 3), torch.tensor([0, 2, 1, -100])), {}, id="tuple"),
        pytest.param((torch.randn(4, 3), torch.tensor([0, 2, 1, 3])), {"vocab_size": 5}, id="tuple-vocab"),
        pytest.param([{"input_ids": _ids()}, {"input_ids": _ids()}], {}, id="list-of-dicts"),
        pytest.param(Batch(_ids(), torch.randn(2, 3)), {"vocab_size": 50}, id="dataclass"),
        pytest.param(Pair(torch.randn(2, 3), torch.tensor([1, 0])), {}, id="namedtuple"),
        pytest.param({"attention_mask": _additive_mask()}, {}, id="additive-4d-mask"),
        pytest.param({"attention_mask": torch.tensor([[True, False]])}, {}, id="bool-mask"),
        pytest.param(
            {"key_padding_mask": torch.tensor([[False, True], [False, False]])},
            {},
            id="padding-mask-true-means-pad",
        ),
        pytest.param({"input_ids": torch.empty(0, 4, dtype=torch.long)}, {}, id="empty"),
        pytest.param({"text": ["no tensors"], "n": 3}, {}, id="no-tensors"),
    ],
)
def test_clean_batches_give_no_findings(batch: Any, kwargs: dict[str, Any]) -> None:
    assert check_batch(batch, **kwargs) == []


@pytest.mark.parametrize(
    ("batch", "where"),
    [
        ({"pixel_values": torch.tensor([[0.0, NAN], [INF, -INF]])}, "batch['pixel_values']"),
        ((torch.tensor([[0.0, NAN], [INF, -INF]]), torch.tensor([1, 0])), "batch[0]"),
        ({"enc": [{"x": torch.tensor([[0.0, NAN], [INF, -INF]])}]}, "batch['enc'][0]['x']"),
        (Batch(_ids(), torch.tensor([[0.0, NAN], [INF, -INF]])), "batch.pixel_values"),
        (Pair(torch.tensor([[0.0, NAN], [INF, -INF]]), torch.tensor(1)), "batch.inputs"),
        (torch.tensor([[0.0, NAN], [INF, -INF]]), "batch"),
    ],
)
def test_nonfinite_floats_are_counted_with_their_path(batch: Any, where: str) -> None:
    (finding,) = check_batch(batch)
    assert (finding.cause, finding.where) == ("data.nonfinite", where)
    details = finding.details
    assert (details["nan"], details["posinf"], details["neginf"]) == (1, 1, 1)
    assert details["samples"] == [0, 1]
    assert "3 non-finite" in finding.message


def test_nonfinite_in_a_mask_ignores_intended_neg_inf_only() -> None:
    mask = _additive_mask()
    mask[1, 0, 0, 0] = NAN
    findings = check_batch({"attention_mask": mask})
    nonfinite = [f for f in findings if f.cause == "data.nonfinite"]
    assert len(nonfinite) == 1
    assert nonfinite[0].details["nan"] == 1
    assert nonfinite[0].details["samples"] == [1]


class WithEmbeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.other = nn.Embedding(1000, 4)
        self.tok = nn.Embedding(30, 4)

    def get_input_embeddings(self) -> nn.Module:
        return self.tok


@pytest.mark.parametrize(
    ("model", "vocab_size", "source"),
    [
        (None, 30, "vocab_size argument"),
        (WithEmbeddings(), None, "model.get_input_embeddings()"),
        (nn.Sequential(nn.Linear(2, 2), nn.Embedding(30, 4)), None, "embedding '1'"),
        (WithEmbeddings(), 30, "vocab_size argument"),
    ],
)
def test_ids_past_the_vocabulary(model: nn.Module | None, vocab_size: int | None, source: str) -> None:
    ids = torch.tensor([[1, 2, 3], [4, 30, 29], [7, 8, 31]])
    (finding,) = check_batch({"input_ids": ids}, model=model, vocab_size=vocab_size)
    assert (finding.cause, finding.where) == ("data.index_out_of_range", "batch['input_ids']")
    assert finding.details["count"] == 2
    assert finding.details["max"] == 31
    assert finding.details["vocab_size"] == 30
    assert finding.details["vocab_source"] == source
    assert finding.details["samples"] == [1, 2]


def test_model_vocab_wins_over_a_larger_unrelated_embedding() -> None:
    ids = torch.tensor([[500]])
    assert _causes(check_batch({"tokens": ids}, model=WithEmbeddings())) == [
        ("data.index_out_of_range", "batch['tokens']")
    ]


@pytest.mark.parametrize("key", ["input_ids", "token_ids", "ids", "tokens", "idx"])
def test_negative_ids_are_caught_without_a_vocabulary(key: str) -> None:
    ids = torch.tensor([[5, -1, 2]], dtype=torch.int32)
    (finding,) = check_batch({key: ids})
    assert finding.cause == "data.index_out_of_range"
    assert finding.details["min"] == -1
    assert finding.details["vocab_size"] is None


@pytest.mark.parametrize(
    ("labels", "ignore_index", "bad"),
    [
        (torch.tensor([[1, -100, 3]]), -100, 0),
        (torch.tensor([[1, -1, 3]]), -100, 1),
        (torch.tensor([[1, -1, 3]]), -1, 0),
        (torch.tensor([[1, 50, 49]]), -100, 1),
        (torch.tensor([[-7, 50, 60]]), -100, 3),
    ],
)
def test_labels_range(labels: torch.Tensor, ignore_index: int, bad: int) -> None:
    findings = check_batch({"labels": labels}, vocab_size=50, ignore_index=ignore_index)
    ranged = [f for f in findings if f.cause == "data.index_out_of_range"]
    assert sum(f.details["count"] for f in ranged) == bad
    assert all(f.where == "batch['labels']" for f in ranged)


def test_unnamed_integer_tensors_are_range_checked_when_the_vocab_is_known() -> None:
    batch = (torch.tensor([[1, 2, 9]]), torch.tensor([[2, 3, -100]]))
    assert _causes(check_batch(batch, vocab_size=5)) == [("data.index_out_of_range", "batch[0]")]


@pytest.mark.parametrize(
    ("key", "mask", "rows"),
    [
        ("attention_mask", torch.tensor([[1, 1], [0, 0], [1, 0]]), [1]),
        ("attention_mask", torch.tensor([[True, False], [False, False]]), [1]),
        ("attention_mask", torch.tensor([[1.0, 0.0], [0.0, 0.0]]), [1]),
        ("decoder_attention_mask", torch.zeros(3, 4, dtype=torch.long), [0, 1, 2]),
        ("key_padding_mask", torch.tensor([[False, True], [True, True]]), [1]),
        (
            "attention_mask",
            torch.full((2, 1, 2, 2), -INF).index_fill_(0, torch.tensor([0]), 0),
            [1],
        ),
    ],
)
def test_fully_masked_samples(key: str, mask: torch.Tensor, rows: list[int]) -> None:
    (finding,) = [f for f in check_batch({key: mask}) if f.cause != "data.nonfinite"]
    assert (finding.cause, finding.where) == ("data.fully_masked", f"batch[{key!r}]")
    assert finding.details["samples"] == rows
    assert finding.details["sample_count"] == len(rows)


def test_fully_masked_sample_list_is_capped_but_counted() -> None:
    mask = torch.zeros(20, 3, dtype=torch.long)
    mask[5] = 1
    (finding,) = check_batch({"attention_mask": mask})
    assert finding.details["sample_count"] == 19
    assert finding.details["samples"] == [0, 1, 2, 3, 4, 6, 7, 8][:MAX_LISTED]
    assert "and 11 more" in finding.message


@pytest.mark.parametrize(
    ("labels", "ignore_index"),
    [
        (torch.full((2, 4), -100), -100),
        (torch.full((3,), 0), 0),
        (torch.empty(0, dtype=torch.long), -100),
    ],
)
def test_no_valid_targets(labels: torch.Tensor, ignore_index: int) -> None:
    findings = check_batch({"labels": labels}, ignore_index=ignore_index)
    assert _causes(findings) == [("data.no_valid_targets", "batch['labels']")]


@pytest.mark.parametrize(
    ("mask", "causes"),
    [
        (torch.tensor([[1, 0], [0, 0]]), []),
        (torch.zeros(2, 2, dtype=torch.bool), ["data.no_valid_targets"]),
        (torch.tensor([0.0, 0.0]), ["data.no_valid_targets"]),
        (torch.tensor([[0, 3]]), ["data.invalid_mask"]),
    ],
)
def test_loss_masks_need_one_kept_position_not_one_per_row(mask: torch.Tensor, causes: list[str]) -> None:
    findings = check_batch({"loss_mask": mask})
    assert [f.cause for f in findings] == causes
    assert all(f.where == "batch['loss_mask']" for f in findings)


def test_one_valid_target_is_enough() -> None:
    labels = torch.full((2, 4), -100)
    labels[1, 3] = 7
    assert check_batch({"labels": labels}) == []


@pytest.mark.parametrize(
    ("mask", "low", "high"),
    [
        (torch.tensor([[1, 2, 0]]), 0, 2),
        (torch.tensor([[0.5, 1.0]]), 0.5, 1.0),
        (torch.tensor([[255, 0]], dtype=torch.uint8), 0, 255),
        (torch.tensor([1.0, 3.0]), 1.0, 3.0),
    ],
)
def test_invalid_mask_values(mask: torch.Tensor, low: float, high: float) -> None:
    (finding,) = check_batch({"padding_mask": mask})
    assert (finding.cause, finding.where) == ("data.invalid_mask", "batch['padding_mask']")
    assert (finding.details["min"], finding.details["max"]) == (low, high)


def test_a_bad_batch_reports_every_problem_with_a_fix() -> None:
    batch = {
        "input_ids": torch.tensor([[1, 2, 99], [3, 4, 5]]),
        "attention_mask": torch.tensor([[1, 1, 1], [0, 0, 0]]),
        "labels": torch.full((2, 3), -100),
        "features": torch.tensor([[NAN, 1.0]]),
    }
    findings = check_batch(batch, vocab_size=10)
    assert sorted(f.cause for f in findings) == [
        "data.fully_masked",
        "data.index_out_of_range",
        "data.no_valid_targets",
        "data.nonfinite",
    ]
    for finding in findings:
        assert finding.cause in CAUSES
        assert finding.severity == "error"
        assert len(finding.fix) > 20
        json.dumps(finding.to_dict())


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_one_host_read_for_a_whole_batch(host_reads: list[int]) -> None:
    reads = host_reads
    batch = {
        "input_ids": torch.tensor([[1, 2, 99], [3, 4, 5]]),
        "attention_mask": torch.tensor([[1.0, 1.0, 0.5], [0.0, 0.0, 0.0]]),
        "labels": torch.full((2, 3), -100),
        "x": [torch.tensor([NAN]), torch.randn(3, 2)],
    }
    with _CountOps() as mode:
        findings = check_batch(batch, vocab_size=10)
    assert sorted(f.cause for f in findings) == [
        "data.index_out_of_range",
        "data.invalid_mask",
        "data.no_valid_targets",
        "data.nonfinite",
    ]
    assert len(reads) == 1
    syncing = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.item.default"}
    assert syncing.isdisjoint(mode.ops)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"vocab_size": -3}, "vocab_size"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"vocab_size": "50"}, "vocab_size"),
        ({"vocab_size": True}, "vocab_size"),
        ({"model": "gpt2"}, "model"),
        ({"ignore_index": None}, "ignore_index"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        check_batch({"input_ids": _ids()}, **kwargs)


@pytest.mark.parametrize("batch", [None, 3, "input_ids"])
def test_a_batch_without_structure_is_rejected(batch: Any) -> None:
    with pytest.raises(ValueError, match="batch must be"):
        check_batch(batch)


# --------------------------------------------------------------------------- numpy, nesting, sparse, memory


def test_nan_in_a_numpy_array_is_found() -> None:
    import numpy as np

    pixels = np.zeros((4, 3), dtype=np.float32)
    pixels[2, 1] = np.nan
    findings = check_batch({"pixel_values": pixels, "names": np.array(["a", "b"])})
    assert [(f.cause, f.where) for f in findings] == [("data.nonfinite", "batch['pixel_values']")]
    assert findings[0].details["samples"] == [2]


def test_nan_nested_deeper_than_32_levels_is_found() -> None:
    batch: object = torch.tensor([1.0, float("nan")])
    for _ in range(40):
        batch = [batch]
    findings = check_batch(batch)
    assert [f.cause for f in findings] == ["data.nonfinite"] and findings[0].where.count("[0]") == 40


def test_nesting_past_the_limit_says_where_it_stopped() -> None:
    from nanguard.audit.data import MAX_DEPTH

    batch: object = torch.tensor([float("nan")])
    for _ in range(MAX_DEPTH + 5):
        batch = {"x": batch}
    with pytest.warns(UserWarning, match=f"stopped at nesting depth {MAX_DEPTH}.*not checked"):
        assert check_batch(batch) == []


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_nan_in_a_sparse_tensor_is_found(layout: str) -> None:
    dense = torch.zeros(4, 5)
    dense[1, 2] = float("nan")
    dense[3, 0] = float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "Sparse CSR tensor support is in beta"
        sparse = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
        findings = check_batch({"features": sparse})
    assert [(f.cause, f.where) for f in findings] == [("data.nonfinite", "batch['features'] (sparse values)")]
    assert (findings[0].details["nan"], findings[0].details["posinf"]) == (1, 1)


@pytest.mark.parametrize("shape", [(7, 5), (3, 40), (50,), (2, 3, 11)])
def test_checking_in_chunks_finds_exactly_what_one_pass_finds(monkeypatch: pytest.MonkeyPatch, shape) -> None:
    import nanguard.audit.data as data_mod

    torch.manual_seed(0)
    x = torch.randn(shape)
    x.view(-1)[torch.randperm(x.numel())[:9]] = float("nan")
    x.view(-1)[torch.randperm(x.numel())[:4]] = float("-inf")
    ids = torch.randint(-3, 120, shape)
    whole = [f.to_dict() for f in check_batch({"x": x, "input_ids": ids}, vocab_size=100)]
    monkeypatch.setattr(data_mod, "CHUNK_ELEMENTS", 6)
    assert [f.to_dict() for f in check_batch({"x": x, "input_ids": ids}, vocab_size=100)] == whole
    assert {f["cause"] for f in whole} == {"data.nonfinite", "data.index_out_of_range"}


_PEAK = """
import resource, sys, torch
from nanguard.audit.data import check_batch
torch.set_num_threads(1)
x = torch.randn(32 * 2**20)  # 128 MiB of float32, written so every page is resident
x[12345] = float("nan")
ids = torch.randint(0, 50, (16 * 2**20,), dtype=torch.int8)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
findings = check_batch({"pixel_values": x, "input_ids": ids}, vocab_size=100)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(len(findings), (peak - base) * 1024)
"""


def test_checking_a_large_batch_streams(tmp_path) -> None:
    import os
    import subprocess
    import sys

    # Every allocation of 64 KiB or more gets its own mapping, returned when freed: the peak resident
    # size then follows what is alive, not what glibc's heap happened to keep.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run([sys.executable, "-c", _PEAK], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found, extra = map(int, done.stdout.split())
    assert found == 1
    # The old check held several full-size masks (and an int64 copy of the ids): many times this.
    assert extra <= 0.5 * 128 * 2**20, f"check_batch grew the peak by {extra / 2**20:.0f} MiB"
