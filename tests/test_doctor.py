"""nanguard doctor: each check under a controlled environment, and both output forms."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanguard.audit import DoctorItem, doctor, doctor_items
from nanguard.audit.env import DEBUG_VARIABLES, STATUSES

WATCHED = ("CUDA_LAUNCH_BLOCKING", "TORCH_NCCL_NAN_CHECK", *(n for n, _ in DEBUG_VARIABLES))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in WATCHED:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch, "__version__", "2.6.0")
    # Patched rather than toggled: use_deterministic_algorithms imports dynamo (~1 s).
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)


def _items() -> dict[str, DoctorItem]:
    return {item.name: item for item in doctor_items()}


def test_collect_covers_every_check_with_a_valid_status() -> None:
    items = _items()
    assert set(items) >= {
        "python",
        "torch",
        "cuda",
        "cudnn",
        "nccl",
        "gpus",
        "anomaly_mode",
        "CUDA_LAUNCH_BLOCKING",
        "deterministic_algorithms",
        "TORCH_DISTRIBUTED_DEBUG",
        "NCCL_DEBUG",
        "TORCH_SHOW_CPP_STACKTRACES",
        "TORCH_NCCL_NAN_CHECK",
        "tf32",
        "float32_matmul_precision",
    }
    assert all(item.status in STATUSES for item in items.values())
    assert items["torch"].value == "2.6.0"
    assert items["float32_matmul_precision"].value == torch.get_float32_matmul_precision()


def test_a_clean_environment_has_no_warnings() -> None:
    # cuda/gpus/nccl depend on the machine; everything else is under the fixture's control.
    machine = {"cuda", "gpus", "nccl", "cudnn"}
    assert [i.name for i in doctor_items() if i.status != "ok" and i.name not in machine] == []


@pytest.mark.parametrize(("value", "status"), [("1", "warning"), ("0", "ok")])
def test_cuda_launch_blocking(monkeypatch: pytest.MonkeyPatch, value: str, status: str) -> None:
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", value)
    item = _items()["CUDA_LAUNCH_BLOCKING"]
    assert (item.status, item.value) == (status, value)


def test_anomaly_mode_left_on_is_a_warning() -> None:
    with torch.autograd.set_detect_anomaly(True):
        item = _items()["anomaly_mode"]
    assert (item.status, item.value) == ("warning", "enabled")
    assert "set_detect_anomaly(False)" in item.advice


@pytest.mark.parametrize(("algorithms", "cudnn"), [(True, False), (False, True)])
def test_deterministic_algorithms_cost_speed(monkeypatch: pytest.MonkeyPatch, algorithms: bool, cudnn: bool) -> None:
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: algorithms)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", cudnn)
    item = _items()["deterministic_algorithms"]
    assert item.status == "warning"
    assert item.value == f"use_deterministic_algorithms={algorithms}, cudnn.deterministic={cudnn}"


@pytest.mark.parametrize("name", [n for n, _ in DEBUG_VARIABLES])
def test_debug_variables_show_their_value_and_advice(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    assert _items()[name].value == "unset"
    monkeypatch.setenv(name, "DETAIL")
    item = _items()[name]
    assert (item.status, item.value) == ("ok", "DETAIL")
    assert item.advice


@pytest.mark.parametrize(
    ("version", "value", "status", "shown"),
    [
        ("2.4.1", None, "ok", "not available (torch < 2.5)"),
        ("2.4.1", "1", "warning", "1 (ignored: needs torch >= 2.5)"),
        ("2.5.0", None, "ok", "unset; supported by torch 2.5.0"),
        ("2.10.0", "1", "ok", "1; supported by torch 2.10.0"),
    ],
)
def test_nccl_nan_check_depends_on_the_torch_version(
    monkeypatch: pytest.MonkeyPatch, version: str, value: str | None, status: str, shown: str
) -> None:
    monkeypatch.setattr(torch, "__version__", version)
    if value is not None:
        monkeypatch.setenv("TORCH_NCCL_NAN_CHECK", value)
    item = _items()["TORCH_NCCL_NAN_CHECK"]
    assert item.status == status
    assert item.value.startswith(shown)


@pytest.mark.parametrize(("version", "status"), [("2.3.1", "error"), ("2.4.0", "ok")])
def test_torch_older_than_supported_is_an_error(monkeypatch: pytest.MonkeyPatch, version: str, status: str) -> None:
    monkeypatch.setattr(torch, "__version__", version)
    assert _items()["torch"].status == status


@pytest.mark.parametrize(("version", "code"), [("2.6.0", 0), ("1.13.1", 1)])
def test_json_output_and_exit_code(monkeypatch: pytest.MonkeyPatch, version: str, code: int) -> None:
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    out = io.StringIO()
    assert doctor(as_json=True, file=out) == code
    data = json.loads(out.getvalue())
    statuses = [item["status"] for item in data["items"]]
    assert data["summary"] == {s: statuses.count(s) for s in STATUSES}
    assert data["summary"]["warning"] >= 1
    assert data["summary"]["error"] == code
    assert set(data["items"][0]) == {"name", "status", "value", "advice"}


def test_table_output_lists_every_item(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_DEBUG", "[bold]INFO")  # not swallowed as rich markup
    out = io.StringIO()
    assert doctor(file=out) == 0
    text = out.getvalue()
    for item in doctor_items():
        assert item.name in text
    assert "[bold]INFO" in text
    assert text.rstrip().endswith("0 error")


def test_a_failing_probe_becomes_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> bool:
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    items = _items()
    assert items["cuda"].status == "warning"
    assert "driver exploded" in items["cuda"].value
    assert items["torch"].status == "ok"


def test_doctor_item_rejects_unknown_status() -> None:
    with pytest.raises(ValueError, match="status"):
        DoctorItem("x", "info", "v", "")
    assert DoctorItem("x", "ok", "v", "a").to_dict() == {
        "name": "x",
        "status": "ok",
        "value": "v",
        "advice": "a",
    }


@pytest.mark.parametrize("value", ["bogus", "", " DETAIL"])
def test_an_invalid_torch_distributed_debug_is_reported_not_a_crash(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", value)
    item = next(i for i in doctor_items() if i.name == "TORCH_DISTRIBUTED_DEBUG")
    assert item.status == "error" and repr(value) in item.value and "DETAIL" in item.advice


@pytest.mark.parametrize("value", ["detail", "OFF"])
def test_a_valid_torch_distributed_debug_in_any_case_is_fine(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", value)
    item = next(i for i in doctor_items() if i.name == "TORCH_DISTRIBUTED_DEBUG")
    assert item.status == "ok" and item.value == value


def test_doctor_command_reports_an_invalid_torch_distributed_debug(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "TORCH_DISTRIBUTED_DEBUG": "bogus"}
    probe = subprocess.run(
        [sys.executable, "-c", "import nanguard.cli, sys; print('torch' in sys.modules)"],
        env={**env, "TORCH_DISTRIBUTED_DEBUG": "OFF"},
        capture_output=True,
        text=True,
    )
    if probe.stdout.strip() != "False":
        pytest.skip("`import nanguard` imports torch eagerly, which itself fails under this variable")
    done = subprocess.run(
        [sys.executable, "-m", "nanguard", "doctor", "--json"], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert "Traceback" not in done.stderr, done.stderr
    items = {i["name"]: i for i in json.loads(done.stdout)["items"]}
    assert items["TORCH_DISTRIBUTED_DEBUG"]["status"] == "error" and done.returncode == 1
