from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import nanguard.bundle as bundle_mod
import nanguard.cli.replay as replay_cli
from nanguard._io import atomic_write_text
from nanguard.bundle import (
    Bundle,
    default_step,
    load_bundle,
    replay,
    save_bundle,
)
from nanguard.cli.replay import main_replay
from nanguard.errors import BundleError
from nanguard.findings import Diagnosis
from nanguard.guard.recorder import Recorder
from nanguard.rng import fork_rng_state, get_rng_state, set_rng_state


def _nested_batch() -> dict:
    ids = torch.randint(0, 100, (2, 5))
    return {
        "input_ids": ids,
        "labels": ids,  # same storage as input_ids: safetensors refuses shared tensors
        "prefix": ids[:, :2],
        "mask": torch.rand(2, 5) > 0.5,
        "feats": [torch.randn(3, 4), torch.randn(2).to(torch.bfloat16), torch.randn(4, 3).t()],
        "pair": (torch.tensor(7, dtype=torch.int32), 3, "text", None, float("nan")),
        "complex": torch.randn(2, dtype=torch.complex128),
        "scalar": 1.5,
        7: torch.arange(3, dtype=torch.int16),
    }


def _save(tmp_path: Path, batch=None, **kwargs) -> Path:
    kwargs.setdefault("step", 12)
    kwargs.setdefault("rank", 0)
    kwargs.setdefault("rng_state", get_rng_state())
    kwargs.setdefault("meta", {})
    return save_bundle(tmp_path, batch={"x": torch.ones(3)} if batch is None else batch, **kwargs)


def _assert_same(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b


# ----------------------------------------------------------------------------- round trip


def test_nested_batch_round_trip(tmp_path: Path) -> None:
    batch = _nested_batch()
    diag = Diagnosis(cause="op.log_domain", op="aten.log.default", module="head", step=12)
    path = _save(tmp_path, batch, rank=3, meta={"diagnosis": diag, "loss_tail": [2.0, float("inf")]})

    assert path == tmp_path / "bundles" / "step-00000012-rank-3"
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "tensors.safetensors"]
    loaded = load_bundle(path)
    assert isinstance(loaded, Bundle)
    _assert_same(batch, loaded.batch)
    assert loaded.batch_stored
    assert loaded.step == 12 and loaded.rank == 3
    assert loaded.diagnosis == diag
    assert loaded.meta["loss_tail"] == [2.0, "inf"]
    assert loaded.meta["format"] == "nanguard-bundle" and loaded.meta["version"] == 1
    assert loaded.meta["torch"] == torch.__version__

    meta = json.loads((path / "meta.json").read_text())
    keys = {item[0]: item[1]["key"] for item in meta["batch"]["items"] if "key" in item[1]}
    assert keys["input_ids"] == "batch['input_ids']" and keys[7] == "batch[7]"
    assert "batch['input_ids']" in load_file(path / "tensors.safetensors")
    assert "rng/cpu" in load_file(path / "tensors.safetensors")


def test_loading_the_meta_file_path_works_too(tmp_path: Path) -> None:
    path = _save(tmp_path)
    assert load_bundle(path / "meta.json").path == path


def test_dataclass_batch_comes_back_as_dict(tmp_path: Path) -> None:
    @dataclasses.dataclass
    class Batch:
        tokens: torch.Tensor
        weight: float

    batch = Batch(torch.arange(4), 0.5)
    loaded = load_bundle(_save(tmp_path, batch))
    _assert_same({"tokens": batch.tokens, "weight": 0.5}, loaded.batch)
    assert loaded.meta["batch"]["class"].endswith("Batch")


def test_requires_grad_and_tensor_batch(tmp_path: Path) -> None:
    x = torch.randn(3, requires_grad=True)
    loaded = load_bundle(_save(tmp_path, x))
    assert loaded.batch.requires_grad and torch.equal(loaded.batch, x.detach())


# ----------------------------------------------------------------------------- RNG


def test_rng_round_trip() -> None:
    state = get_rng_state()
    assert state["cpu"].dtype == torch.uint8
    first = torch.rand(5)
    set_rng_state(state)
    assert torch.equal(first, torch.rand(5))


def test_rng_round_trip_through_a_bundle(tmp_path: Path) -> None:
    path = _save(tmp_path, rng_state=get_rng_state())
    expected = torch.rand(4)
    set_rng_state(load_bundle(path).rng_state)
    assert torch.equal(expected, torch.rand(4))


def test_python_and_numpy_global_states_round_trip_through_a_bundle_as_bytes(tmp_path: Path) -> None:
    import random

    import numpy as np

    random.gauss(0.0, 1.0), np.random.standard_normal()  # a cached gaussian in each
    path = _save(tmp_path, rng_state=get_rng_state())
    expected = (random.random(), random.gauss(0.0, 1.0), np.random.randint(1000), np.random.standard_normal())
    loaded = load_bundle(path).rng_state
    assert loaded["python"].dtype == torch.uint8 and loaded["numpy"].dtype == torch.uint8  # stored as bytes
    set_rng_state(loaded)
    assert (random.random(), random.gauss(0.0, 1.0), np.random.randint(1000), np.random.standard_normal()) == expected
    with pytest.raises(ValueError, match="numpy"):
        set_rng_state({"numpy": torch.zeros(3, dtype=torch.uint8)})


def test_fork_rng_state_puts_the_callers_stream_back() -> None:
    state = get_rng_state()
    with fork_rng_state():
        torch.manual_seed(123)
        torch.rand(10)
    after = torch.rand(3)
    set_rng_state(state)
    assert torch.equal(after, torch.rand(3))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_cuda_states_are_skipped_with_a_warning_without_cuda() -> None:
    state = {**get_rng_state(), "cuda:0": torch.zeros(16, dtype=torch.uint8)}
    with pytest.warns(UserWarning, match="cuda:0"):
        set_rng_state(state)


def test_invalid_rng_state_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="cpu"):
        set_rng_state({"cpu": torch.zeros(3, dtype=torch.uint8)})


# ----------------------------------------------------------------------------- size limit


def test_oversize_batch_stores_shapes_only(tmp_path: Path) -> None:
    batch = {"x": torch.randn(4, 8), "ids": [torch.zeros(2, 3, dtype=torch.int64)]}
    path = _save(tmp_path, batch, max_batch_bytes=64)
    loaded = load_bundle(path)
    assert not loaded.batch_stored
    assert loaded.meta["batch_stored"] is False
    assert "max_batch_bytes" in loaded.meta["batch_reason"]
    assert loaded.batch["x"].device.type == "meta"
    assert loaded.batch["x"].shape == (4, 8) and loaded.batch["ids"][0].dtype == torch.int64
    assert set(load_file(path / "tensors.safetensors")) == {"rng/cpu", "rng/python", "rng/numpy"}
    assert "cpu" in loaded.rng_state
    with pytest.raises(BundleError, match="batch not stored"):
        replay(loaded, torch.nn.Linear(8, 1), locate_fn=lambda fn, *a, **k: None)


# ----------------------------------------------------------------------------- atomic writes


def test_no_temporary_dirs_and_existing_bundle_replaced(tmp_path: Path) -> None:
    _save(tmp_path, {"x": torch.zeros(3)})
    path = _save(tmp_path, {"y": torch.ones(2)})
    assert [p.name for p in (tmp_path / "bundles").iterdir()] == [path.name]
    assert list(load_bundle(path).batch) == ["y"]


def test_failed_write_keeps_the_old_bundle(tmp_path: Path, monkeypatch) -> None:
    path = _save(tmp_path, {"x": torch.zeros(3)})

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(bundle_mod, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, {"y": torch.ones(2)})
    assert [p.name for p in (tmp_path / "bundles").iterdir()] == [path.name]
    assert list(load_bundle(path).batch) == ["x"]


def test_reserved_meta_keys_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="reserved"):
        _save(tmp_path, meta={"step": 3})


# ----------------------------------------------------------------------------- broken bundles


def _raises_naming(path: Path, file: str, match: str = "") -> BundleError:
    with pytest.raises(BundleError, match=match) as info:
        load_bundle(path)
    err = info.value
    assert Path(err.path).name == file or err.path == str(path)
    assert file in str(err)
    # no traceback from inside a library chained on
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)
    return err


def test_corrupt_meta_json(tmp_path: Path) -> None:
    path = _save(tmp_path)
    (path / "meta.json").write_bytes(b"\x00\xff\x13garbage{{")
    _raises_naming(path, "meta.json", "JSON")


def test_truncated_meta_json(tmp_path: Path) -> None:
    path = _save(tmp_path)
    text = (path / "meta.json").read_bytes()
    (path / "meta.json").write_bytes(text[: len(text) // 2])
    _raises_naming(path, "meta.json", "JSON")


def _drop_checksums(path: Path) -> None:
    meta = json.loads((path / "meta.json").read_text())
    del meta["checksums"]
    (path / "meta.json").write_text(json.dumps(meta))


def test_truncated_safetensors(tmp_path: Path) -> None:
    path = _save(tmp_path, {"x": torch.randn(100)})
    data = (path / "tensors.safetensors").read_bytes()
    (path / "tensors.safetensors").write_bytes(data[: len(data) // 2])
    _raises_naming(path, "tensors.safetensors", "checksum mismatch")
    _drop_checksums(path)  # a bundle from before checksums: safetensors itself finds the truncation
    _raises_naming(path, "tensors.safetensors", "corrupt or truncated")


@pytest.mark.parametrize("target", ["batch", "rng"])
def test_a_flipped_byte_in_tensors_or_rng_state_is_found(tmp_path: Path, target: str) -> None:
    path = _save(tmp_path, {"x": torch.zeros(64)})
    data = bytearray((path / "tensors.safetensors").read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    offsets = json.loads(data[8:header])["batch['x']" if target == "batch" else "rng/cpu"]["data_offsets"]
    data[header + offsets[0] + 3] ^= 0x10  # one bit inside that tensor's bytes
    (path / "tensors.safetensors").write_bytes(bytes(data))
    _raises_naming(path, "tensors.safetensors", "checksum mismatch")
    _drop_checksums(path)
    assert isinstance(load_bundle(path), Bundle)  # without the checksum, the flip would go unseen


def test_errors_in_meta_json_name_meta_json(tmp_path: Path) -> None:
    path = _save(tmp_path, {"x": torch.zeros(4)})
    meta = json.loads((path / "meta.json").read_text())
    meta["batch"]["items"][0][1]["shape"] = [2, 3]  # 6 elements where the file holds 4
    meta["batch"]["items"][0][1]["stored_as"] = "uint8"
    (path / "meta.json").write_text(json.dumps(meta))
    _raises_naming(path, "meta.json", "meta.json says")  # the tensors file passed its checksum


def test_missing_tensors_file(tmp_path: Path) -> None:
    path = _save(tmp_path)
    (path / "tensors.safetensors").unlink()
    _raises_naming(path, "tensors.safetensors", "missing")


def test_missing_bundle_dir(tmp_path: Path) -> None:
    missing = tmp_path / "bundles" / "nope"
    with pytest.raises(BundleError, match="no such bundle") as info:
        load_bundle(missing)
    assert info.value.path == str(missing)


def test_foreign_directories(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    _raises_naming(empty, "meta.json", "not a nanguard bundle")

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "meta.json").write_text(json.dumps({"hello": 1}))
    _raises_naming(foreign, "meta.json", "not a nanguard bundle")

    path = _save(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "version": 99}))
    _raises_naming(path, "meta.json", "version 99")


def test_tensor_named_in_meta_missing_from_file(tmp_path: Path) -> None:
    path = _save(tmp_path, {"x": torch.ones(2), "y": torch.zeros(2)})
    tensors = load_file(path / "tensors.safetensors")
    del tensors["batch['y']"]
    save_file(tensors, path / "tensors.safetensors")
    _raises_naming(path, "tensors.safetensors", "checksum mismatch")
    _drop_checksums(path)
    _raises_naming(path, "tensors.safetensors", r"batch\['y'\].*missing")


def test_tensor_with_wrong_shape_or_malformed_structure(tmp_path: Path) -> None:
    path = _save(tmp_path, {"x": torch.ones(2)})
    tensors = load_file(path / "tensors.safetensors")
    tensors["batch['x']"] = torch.ones(5)
    save_file(tensors, path / "tensors.safetensors")
    _drop_checksums(path)
    _raises_naming(path, "tensors.safetensors", "meta.json says")

    meta = json.loads((path / "meta.json").read_text())
    meta["batch"] = {"type": "pickle", "value": "cos\nsystem\n"}
    (path / "meta.json").write_text(json.dumps(meta))
    _raises_naming(path, "meta.json", "unknown node type")


class _Pair(NamedTuple):
    a: int
    b: str


class _Opaque:
    def __repr__(self) -> str:
        return "<opaque>"


def test_each_kind_of_batch_value_has_its_node_in_meta_json(tmp_path: Path) -> None:
    """The batch description's format, one node per kind of value, and what each loads back as."""
    batch = {
        "array": np.arange(3, dtype=np.int64),
        "objects": np.array([_Opaque()], dtype=object),
        "np_scalar": np.float32(2.5),
        "pair": _Pair(1, "x"),
        "ordered": collections.OrderedDict(k=None),
        "list": [True, -float("inf")],
        "opaque": _Opaque(),
    }
    path = _save(tmp_path, batch)
    nodes = dict(json.loads((path / "meta.json").read_text())["batch"]["items"])
    assert nodes["array"] == {
        "type": "tensor",
        "key": "batch['array']",
        "dtype": "torch.int64",
        "shape": [3],
        "device": "cpu",
        "numpy": True,
    }
    assert nodes["objects"] == {"type": "repr", "class": "numpy.ndarray", "value": repr(batch["objects"])}
    assert nodes["np_scalar"] == {"type": "value", "value": 2.5}
    assert nodes["pair"] == {
        "type": "tuple",
        "items": [{"type": "value", "value": 1}, {"type": "value", "value": "x"}],
        "class": f"{__name__}._Pair",
    }
    assert nodes["ordered"] == {
        "type": "dict",
        "items": [["k", {"type": "value", "value": None}]],
        "class": "collections.OrderedDict",
    }
    assert nodes["list"] == {
        "type": "list",
        "items": [{"type": "value", "value": True}, {"type": "float", "value": "-inf"}],
    }
    assert nodes["opaque"] == {"type": "repr", "class": f"{__name__}._Opaque", "value": "<opaque>"}
    loaded = load_bundle(path).batch
    assert isinstance(loaded["array"], np.ndarray) and loaded["array"].tolist() == [0, 1, 2]
    assert loaded["objects"] == repr(batch["objects"]) and loaded["opaque"] == "<opaque>"
    assert loaded["pair"] == (1, "x") and loaded["ordered"] == {"k": None} and loaded["np_scalar"] == 2.5
    assert loaded["list"] == [True, -math.inf]


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda m: m.pop("format"), "not a nanguard bundle: no \"format\": 'nanguard-bundle' marker"),
        (lambda m: m.update(version=True), "bundle format version True is not supported (reads 1)"),
        (lambda m: m.update(step="12"), "malformed: 'step' missing or not int"),
        (lambda m: m.pop("rank"), "malformed: 'rank' missing or not int"),
        (lambda m: m.update(batch_stored=1), "malformed: 'batch_stored' missing or not bool"),
        (lambda m: m.pop("batch"), "malformed: 'batch' description missing"),
        (lambda m: m.update(rng=["cpu", 0]), "malformed: 'rng' must be a list of device names"),
        (lambda m: m.update(weights={"stored": "yes"}), "malformed: 'weights' must be an object with a bool 'stored'"),
        (lambda m: m.update(checksums=["sha256:0"]), "malformed: 'checksums' must map file names to 'sha256:<hex>'"),
    ],
)
def test_each_malformed_field_of_meta_json_is_named(tmp_path: Path, change, problem: str) -> None:
    path = _save(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    change(meta)
    (path / "meta.json").write_text(json.dumps(meta))
    err = _raises_naming(path, "meta.json", re.escape(problem))
    assert err.problem == problem


def test_meta_json_without_weights_or_checksums_is_read_unchecked(tmp_path: Path) -> None:
    path = _save(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    del meta["weights"], meta["checksums"]
    (path / "meta.json").write_text(json.dumps(meta))
    assert torch.equal(load_bundle(path).batch["x"], torch.ones(3))


@pytest.mark.parametrize(
    ("node", "problem"),
    [
        ([], "node [] has no 'type'"),
        (
            {"type": "dict", "items": [[[1], {"type": "value", "value": 1}]]},
            "a dict node needs 'items' as [key, node] pairs",
        ),
        ({"type": "tuple"}, "a tuple node needs 'items'"),
        ({"type": "value", "value": [1]}, "value [1] is not a JSON scalar"),
        ({"type": "float", "value": "many"}, "bad float node {'type': 'float', 'value': 'many'}"),
        ({"type": "tensor", "key": "k"}, "tensor node {'type': 'tensor', 'key': 'k'} needs 'key' and 'shape'"),
        ({"type": "tensor", "key": "k", "shape": [True]}, "tensor 'k' has a bad shape [True]"),
        (
            {"type": "tensor", "key": "k", "shape": [1], "dtype": "torch.nope"},
            "tensor 'k' has an unknown dtype 'torch.nope'",
        ),
        ({"type": "set", "items": []}, "unknown node type 'set'"),
    ],
)
def test_each_malformed_batch_node_is_named(tmp_path: Path, node: object, problem: str) -> None:
    path = _save(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    meta["batch"] = {"type": "list", "items": [{"type": "repr", "value": "kept"}, node]}
    (path / "meta.json").write_text(json.dumps(meta))
    err = _raises_naming(path, "meta.json", re.escape(problem))
    assert err.problem == f"malformed batch description: {problem}"


def test_a_batch_node_of_each_type_loads_back(tmp_path: Path) -> None:
    path = _save(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    value = {"type": "value", "value": 3}
    meta["batch"] = {
        "type": "dict",
        "items": [
            ["t", {"type": "tuple", "items": [value]}],
            [5, {"type": "list", "items": [{"type": "float", "value": "nan"}, {"type": "repr", "value": 7}]}],
            [None, {"type": "dict", "items": []}],
        ],
    }
    (path / "meta.json").write_text(json.dumps(meta))
    batch = load_bundle(path).batch
    assert batch["t"] == (3,) and batch[None] == {} and batch[5][1] == "7" and math.isnan(batch[5][0])


def test_unreadable_diagnosis_warns_and_keeps_the_batch(tmp_path: Path) -> None:
    path = _save(tmp_path, meta={"diagnosis": {"cause": "data.from_the_future"}})
    with pytest.warns(UserWarning, match="diagnosis"):
        loaded = load_bundle(path)
    assert loaded.diagnosis is None and loaded.meta["diagnosis"]["cause"] == "data.from_the_future"


# ----------------------------------------------------------------------------- replay


class _Noisy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(self.lin(x), 0.5).sum()


def _draw_step(draws: list[torch.Tensor]):
    def step(batch):
        draws.append(torch.rand(3))
        return batch["x"].sum()

    return step


def test_replay_restores_rng_with_a_stub_locate(tmp_path: Path) -> None:
    path = _save(tmp_path, {"x": torch.ones(2)}, rng_state=get_rng_state())
    expected = torch.rand(3)
    draws: list[torch.Tensor] = []
    seen = {}

    def fake_locate(fn, *args, model=None, **kwargs):
        seen["model"] = model
        fn(*args, **kwargs)
        return None

    model = torch.nn.Linear(2, 1)
    after = get_rng_state()
    assert replay(load_bundle(path), model, _draw_step(draws), locate_fn=fake_locate) is None
    assert torch.equal(draws[0], expected)
    assert seen["model"] is model
    assert torch.equal(get_rng_state()["cpu"], after["cpu"])  # caller's stream untouched


def test_replay_restores_rng_with_locate(tmp_path: Path) -> None:
    path = _save(tmp_path, {"x": torch.ones(2)}, rng_state=get_rng_state())
    expected = torch.rand(3)
    draws: list[torch.Tensor] = []
    assert replay(load_bundle(path), torch.nn.Linear(2, 1), _draw_step(draws)) is None
    assert torch.equal(draws[0], expected)


class _LogOfNegative(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.lin(x) - 100).mean()


def test_replay_with_default_step_names_the_cause(tmp_path: Path) -> None:
    path = _save(tmp_path, {"x": torch.randn(2, 3)})
    diag = replay(load_bundle(path), _LogOfNegative())
    assert diag is not None and diag.cause == "op.log_domain"


def test_replay_copies_the_batch(tmp_path: Path) -> None:
    loaded = load_bundle(_save(tmp_path, {"x": torch.ones(2)}))

    def mutate(batch):
        batch["x"].add_(1)
        return batch["x"].sum()

    replay(loaded, torch.nn.Linear(2, 1), mutate, locate_fn=lambda fn, b, model: fn(b))
    assert torch.equal(loaded.batch["x"], torch.ones(2))


def test_default_step_finds_the_loss_and_backwards() -> None:
    model = _Noisy()
    loss = default_step(model)({"x": torch.randn(2, 4)})
    assert loss.ndim == 0 and model.lin.weight.grad is not None

    class Outputs(torch.nn.Module):
        def __init__(self, kind: str) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))
            self.kind = kind

        def forward(self, a, b):
            y = (a + b) * self.w
            if self.kind == "dict":
                return {"logits": y, "loss": y.sum()}
            if self.kind == "tuple":
                return y, y.pow(2).sum()
            return y

    for kind, expected in (("dict", 6.0), ("tuple", 12.0), ("tensor", 2.0)):
        model = Outputs(kind)
        loss = default_step(model)((torch.ones(3), torch.ones(3)))
        assert loss.item() == expected
        assert model.w.grad is not None


# ----------------------------------------------------------------------------- main_replay


def _user_module(tmp_path: Path, monkeypatch) -> str:
    name = f"user_model_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            import torch

            def build():
                return torch.nn.Linear(2, 1)

            def not_a_model():
                return 3

            def step(model):
                def run(batch):
                    return model(batch["x"]).sum()
                return run
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_main_replay_builds_the_model_and_loads_weights(tmp_path: Path, monkeypatch, suffix: str) -> None:
    name = _user_module(tmp_path, monkeypatch)
    path = _save(tmp_path, {"x": torch.ones(2)})
    state = {"weight": torch.full((1, 2), 3.0), "bias": torch.zeros(1)}
    weights = tmp_path / f"w{suffix}"
    if suffix == ".pt":
        torch.save({"state_dict": state}, weights)
    else:
        save_file(state, weights)
    calls = {}

    def fake_replay(bundle, model, fn):
        calls.update(bundle=bundle, model=model, fn=fn)
        return None

    monkeypatch.setattr(replay_cli, "replay", fake_replay)
    loaded, diag, source = main_replay(str(path), f"{name}:build", str(weights), f"{name}:step")
    assert diag is None and loaded.path == path and calls["bundle"] is loaded and source == str(weights)
    assert torch.equal(calls["model"].weight, state["weight"])
    assert calls["fn"]({"x": torch.ones(2)}).item() == 6.0


def test_main_replay_bad_specs_name_the_argument(tmp_path: Path, monkeypatch) -> None:
    name = _user_module(tmp_path, monkeypatch)
    path = str(_save(tmp_path))
    with pytest.raises(ValueError, match=r"--model must look like 'pkg\.module:factory'"):
        main_replay(path, "no_colon", None, None)
    with pytest.raises(ValueError, match="--fn must look like"):
        main_replay(path, f"{name}:build", None, "bad spec:x")
    with pytest.raises(ValueError, match="--model: no module named"):
        main_replay(path, "surely_not_a_module_xyz:build", None, None)
    with pytest.raises(ValueError, match=r"--model: .* has no attribute"):
        main_replay(path, f"{name}:missing", None, None)
    with pytest.raises(ValueError, match=r"--model: .*not a torch\.nn\.Module"):
        main_replay(path, f"{name}:not_a_model", None, None)
    with pytest.raises(ValueError, match="--weights: no such file"):
        main_replay(path, f"{name}:build", str(tmp_path / "nope.pt"), None)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="--weights: cannot load"):
        main_replay(path, f"{name}:build", str(garbage), None)


# --------------------------------------------------------------------------- weights in bundles


class _WithBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.register_buffer("phase", torch.randn(4, dtype=torch.complex128))  # not a safetensors dtype


def test_weights_round_trip_as_a_plain_safetensors_state_dict(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _WithBuffer()
    with torch.no_grad():
        model.lin.weight[1, 2] = float("nan")
    assert torch.complex128 not in bundle_mod._NATIVE_DTYPES  # else the raw-bytes path is not exercised
    path = _save(tmp_path, weights=model.state_dict())
    bundle = load_bundle(path)
    assert bundle.weights_stored and bundle.weights_note == ""
    state = bundle.load_weights()
    assert sorted(state) == sorted(model.state_dict())
    for key, value in model.state_dict().items():
        assert state[key].dtype == value.dtype and torch.equal(state[key].nan_to_num(), value.nan_to_num())
    assert state["lin.weight"].isnan().sum().item() == 1
    fresh = _WithBuffer()
    fresh.load_state_dict(state)  # the names are the model's own
    plain = load_file(path / "weights.safetensors")  # readable without nanguard, under the same names
    assert torch.equal(plain["lin.bias"], model.lin.bias.detach())


def test_weights_over_the_limit_are_left_out_and_the_bundle_says_why(tmp_path: Path) -> None:
    weights = {"w": torch.zeros(100)}  # 400 bytes
    path = _save(tmp_path, weights=weights, max_weights_bytes=399)
    bundle = load_bundle(path)
    assert not bundle.weights_stored and not (path / "weights.safetensors").exists()
    assert "400 bytes, over the limit of 399" in bundle.weights_note
    with pytest.raises(BundleError, match=r"carries no weights.*400 bytes"):
        bundle.load_weights()
    assert load_bundle(_save(tmp_path, step=13, weights=weights, max_weights_bytes=400)).weights_stored
    with pytest.raises(ValueError, match="max_weights_bytes must be an int >= 0"):
        _save(tmp_path, weights=weights, max_weights_bytes=-1)


def test_a_bundle_without_weights_says_how_to_record_them(tmp_path: Path) -> None:
    bundle = load_bundle(_save(tmp_path))
    assert not bundle.weights_stored and "bundle_weights=True" in bundle.weights_note
    with pytest.raises(BundleError, match="carries no weights"):
        bundle.load_weights()


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage_unchecked", "delete"])
def test_a_corrupt_weights_file_is_an_error_naming_it(tmp_path: Path, damage: str) -> None:
    path = _save(tmp_path, weights={"w": torch.arange(64, dtype=torch.float32)})
    target = path / "weights.safetensors"
    data = bytearray(target.read_bytes())
    if damage == "flip":
        data[-5] ^= 0xFF
        target.write_bytes(bytes(data))
        problem = "checksum mismatch"
    elif damage == "truncate":
        target.write_bytes(bytes(data[: len(data) // 2]))
        problem = "checksum mismatch"
    elif damage == "garbage_unchecked":  # a bundle edited by hand: no checksum to catch it
        meta = json.loads((path / "meta.json").read_text())
        del meta["checksums"]["weights.safetensors"]
        (path / "meta.json").write_text(json.dumps(meta))
        target.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
        problem = "corrupt or truncated safetensors file"
    else:
        target.unlink()
        with pytest.raises(BundleError, match=r"weights\.safetensors: missing"):
            load_bundle(path)
        return
    bundle = load_bundle(path)  # the batch stays replayable; only the weights are bad
    with pytest.raises(BundleError) as err:
        bundle.load_weights()
    assert err.value.path == str(target) and problem in err.value.problem


def test_malformed_weights_entry_in_meta_json(tmp_path: Path) -> None:
    path = _save(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    meta["weights"] = {"stored": "yes"}
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(BundleError, match=r"meta\.json: malformed: 'weights'"):
        load_bundle(path)


def test_recorder_stores_the_users_names_and_nothing_without_bundle_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    inner = torch.nn.Linear(2, 2)
    compiled = torch.nn.Module()
    compiled._orig_mod = inner  # where torch.compile's wrapper keeps the user's module (compiling costs seconds)
    wrapped = torch.nn.DataParallel(compiled)
    assert sorted(wrapped.state_dict()) == ["module._orig_mod.bias", "module._orig_mod.weight"]
    for run, limit in (("on", 2**20), ("off", 0)):
        recorder = Recorder(tmp_path / run, rank=0, max_bundle_bytes=2**20, model=wrapped, max_weights_bytes=limit)
        recorder.bundle(Diagnosis(cause="unknown", step=1), 1, {"x": torch.ones(2)}, None, {})
        recorder.close()
    state = load_bundle(tmp_path / "on" / "bundles" / "step-00000001-rank-0").load_weights()
    assert sorted(state) == ["bias", "weight"] and torch.equal(state["weight"], inner.weight.detach())
    assert not load_bundle(tmp_path / "off" / "bundles" / "step-00000001-rank-0").weights_stored


_SHARDED = """
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from nanguard.findings import Diagnosis
from nanguard.guard.recorder import Recorder
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
model = torch.nn.Linear(4, 2)
for name, param in list(model.named_parameters()):  # as FSDP2's fully_shard leaves them
    setattr(model, name, torch.nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)])))
recorder = Recorder(sys.argv[1], rank=0, max_bundle_bytes=2**20, model=model, max_weights_bytes=2**20)
recorder.bundle(Diagnosis(cause="unknown", step=1), 1, {"x": torch.ones(4)}, None, {})
recorder.close()
torch.save({k: v.full_tensor() for k, v in model.state_dict().items()}, sys.argv[1] + "/full.pt")
dist.destroy_process_group()
"""


@pytest.mark.dist
def test_dtensor_weights_are_stored_as_this_ranks_shards_and_replay_says_so(tmp_path: Path, monkeypatch) -> None:
    if not hasattr(pytest.importorskip("torch.distributed.tensor"), "distribute_tensor"):
        pytest.skip("DTensor is public from torch 2.5")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run(
        [sys.executable, "-c", _SHARDED, str(tmp_path), str(tmp_path / "store")], env=env, check=True, timeout=120
    )
    path = tmp_path / "bundles" / "step-00000001-rank-0"
    bundle = load_bundle(path)
    assert bundle.weights_stored and "rank 0's local shards of a sharded (DTensor/FSDP2) model" in bundle.weights_note
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert all(torch.equal(bundle.load_weights()[key], value) for key, value in full.items())  # one rank: all of it

    name = _user_module(tmp_path, monkeypatch)  # a Linear(2, 1): shards of Linear(4, 2) would not even fit
    monkeypatch.setattr(replay_cli, "replay", lambda bundle, model, fn: None)
    result = main_replay(str(path), f"{name}:build", None, None)
    assert result.weights is None  # one rank's shards are not loaded into a one-process model
    assert "which one process cannot load: pass --weights PATH" in result.finite_hint()


def test_recorder_for_takes_true_or_a_byte_limit(tmp_path: Path) -> None:
    from nanguard.guard.recorder import recorder_for

    model = torch.nn.Linear(2, 2)
    for option, limit in ((True, bundle_mod.MAX_WEIGHTS_BYTES), (1000, 1000), (False, 0)):
        recorder = recorder_for(tmp_path, rank=0, max_bundle_bytes=0, model=model, bundle_weights=option)
        assert isinstance(recorder, Recorder) and recorder.max_weights_bytes == limit
        assert (recorder.model is model) == bool(limit)
        recorder.close()


def test_bundle_weights_that_do_not_fit_the_model_name_them(tmp_path: Path, monkeypatch) -> None:
    name = _user_module(tmp_path, monkeypatch)
    path = _save(tmp_path, weights={"w": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"--model: the bundle's weights\.safetensors does not fit the model"):
        main_replay(str(path), f"{name}:build", None, None)


@pytest.mark.parametrize("value", ["yes", -1, 1.5, None])
def test_bundle_weights_must_be_a_bool_or_a_byte_limit(value) -> None:
    from nanguard.guard import Guard

    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="bundle_weights must be True, False or a byte limit"):
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), bundle_weights=value)


# --------------------------------------------------------------------------- files on disk


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_bundles_and_atomic_files_honour_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        path = _save(tmp_path)
        page = atomic_write_text(tmp_path / "report.html", "<html></html>")
    finally:
        os.umask(old)
    for file in (path / "meta.json", path / "tensors.safetensors", page):
        assert stat.S_IMODE(file.stat().st_mode) == 0o666 & ~umask, file
    assert stat.S_IMODE(path.stat().st_mode) == 0o777 & ~umask


_WRITER = """
import sys, torch
from nanguard.bundle import save_bundle
from nanguard.rng import get_rng_state
batch = {"x": torch.zeros(4_000_000)}  # 16 MB: most of each save is spent in the temporary directory
step = 0
while True:
    save_bundle(sys.argv[1], step=step % 3, rank=0, batch=batch, rng_state=get_rng_state())
    step += 1
"""


def _stale(folder: Path, rank: int) -> list[Path]:
    return [p for p in folder.glob(f".step-*-rank-{rank}.*") if p.name.endswith((".tmp", ".old"))]


def test_bundles_half_written_when_sigkilled_are_cleaned_on_the_next_start(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    folder = run_dir / "bundles"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for _attempt in range(5):
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(run_dir)], env=env)
        try:
            deadline = time.monotonic() + 60
            while not _stale(folder, 0) and time.monotonic() < deadline and writer.poll() is None:
                time.sleep(0.002)
            writer.send_signal(signal.SIGKILL)
        finally:
            writer.kill()
            writer.wait()
        if _stale(folder, 0):
            break
    assert _stale(folder, 0), "a SIGKILL during a write leaves the bundle's temporary directory"
    other = folder / ".step-00000001-rank-1.0123456789ab.tmp"  # another rank's: it may be writing it now
    other.mkdir()

    Recorder(run_dir, rank=0, max_bundle_bytes=2**20).close()
    assert _stale(folder, 0) == [] and other.is_dir()
    for bundle in folder.glob("step-*-rank-0"):
        assert load_bundle(bundle).batch["x"].shape == (4_000_000,)  # the completed ones are untouched


@pytest.mark.parametrize("spec", ["os:system", "os:getcwd", "json:loads", "builtins:int.from_bytes"])
def test_replay_cli_bad_model_values_get_one_line_and_a_nonzero_exit(
    tmp_path: Path, spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from nanguard.cli import main as cli_main

    path = str(_save(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["replay", path, "--model", spec])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert err.startswith("nanguard replay: error: --model: ") and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_replay_cli_names_a_module_that_fails_to_import(tmp_path: Path, monkeypatch, capsys) -> None:
    from nanguard.cli import main as cli_main

    (tmp_path / "broken_factory_mod.py").write_text("import surely_missing_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = str(_save(tmp_path))
    with pytest.raises(SystemExit):
        cli_main(["replay", path, "--model", "broken_factory_mod:build"])
    err = capsys.readouterr().err
    assert "--model: importing 'broken_factory_mod' failed" in err and "surely_missing_dependency_xyz" in err
