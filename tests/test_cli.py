"""The nanguard command, run in process."""

import json
import re
import subprocess
import sys

import pytest
import torch

from nanguard.bundle import load_bundle
from nanguard.cli import main
from nanguard.guard import Guard
from nanguard.zoo import build, get, train_step


def test_demo_default_breaks_skips_and_explains(capsys, tmp_path) -> None:
    assert main(["demo", "--steps", "5", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "op.masked_softmax" in out and "blocks.0.attn" in out and "1 skipped" in out
    assert "step   3" in out and "skip" in out
    assert (tmp_path / "events-rank0.jsonl").exists()


@pytest.mark.dist
def test_demo_on_two_gloo_ranks_names_the_rank(capsys) -> None:
    assert main(["demo", "--ranks", "2", "--fault", "nan_pixels", "--steps", "5"]) == 0
    out = capsys.readouterr().out
    assert "rank 0: 1, rank 1: 1" in out and "data.nonfinite" in out
    assert re.search(r"rank\s+1\n", out)


def test_demo_list_names_every_fault(capsys) -> None:
    assert main(["demo", "--list"]) == 0
    out = capsys.readouterr().out
    assert "nan_pixels" in out and "huge_init" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--fault", "gremlins"], "unknown scenario 'gremlins'"),
        (["demo", "--steps", "0"], "steps must be >= 1"),
        (["zoo", "--ranks", "0"], "ranks must be >= 1"),
        (["replay", "nowhere", "--model", "no_colon"], "--model must look like 'pkg.module:factory'"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_bundle_is_a_clear_error_not_a_traceback(tmp_path, capsys) -> None:
    assert main(["replay", str(tmp_path / "nope"), "--model", "test_cli:make_vision_gpt"]) == 1
    err = capsys.readouterr().err
    assert "nope" in err and "Traceback" not in err


def test_help_lists_every_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "nanguard", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for command in ("demo", "zoo", "report", "replay", "doctor"):
        assert command in out


def make_vision_gpt():
    """A factory for `nanguard replay --model tests.test_cli:make_vision_gpt`."""
    torch.manual_seed(0)
    return build(get("nan_pixels")).model


def test_a_real_guard_bundle_replays_offline_to_the_same_diagnosis(tmp_path, capsys, monkeypatch) -> None:
    run = build(get("nan_pixels"))
    guard = Guard(run.model, run.optimizer, run_dir=tmp_path)
    for _, batch in run.batches(5):
        guard.step(lambda b=batch: train_step(run.model, b), batch=batch)
    guard.close()
    original = guard.last_diagnosis
    (bundle_dir,) = (tmp_path / "bundles").iterdir()
    bundle = load_bundle(bundle_dir)
    assert bundle.step == original.step == 3 and bundle.diagnosis.cause == original.cause
    torch.save(run.model.state_dict(), tmp_path / "weights.pt")
    monkeypatch.syspath_prepend(str(tmp_path.parent))
    code = main(
        ["replay", str(bundle_dir), "--model", "test_cli:make_vision_gpt", "--weights", str(tmp_path / "weights.pt")]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "data.nonfinite" in out and "batch['pixel_values']" in out and "vis_proj" in out


def test_doctor_json(capsys) -> None:
    code = main(["doctor", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code in (0, 1) and {"items", "summary"} <= data.keys()
    assert any(item["name"].lower().startswith("torch") for item in data["items"])
