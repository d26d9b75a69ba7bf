"""The nanguard command, run in process."""

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from nanguard.bundle import load_bundle, save_bundle
from nanguard.cli import main
from nanguard.errors import NonFiniteError
from nanguard.guard import Guard
from nanguard.rng import get_rng_state
from nanguard.zoo import SCENARIOS, build, get, train_step
from nanguard.zoo.scenarios import BY_FIRST_BAD, FIRST_BAD


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
    for command in ("demo", "zoo", "report", "replay", "bisect", "doctor"):
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


def make_nan_weight_gpt():
    """A factory for `nanguard replay --model test_cli:make_nan_weight_gpt`: finite weights."""
    torch.manual_seed(0)
    return build(get("nan_weight")).model


def _nan_weight_bundle(run_dir, **options):
    """Train the nan_weight scenario under a guard until its trip; return the trip's bundle dir."""
    torch.manual_seed(0)
    run = build(get("nan_weight"))
    guard = Guard(run.model, run.optimizer, run_dir=run_dir, module_stats=False, **options)
    with pytest.raises(NonFiniteError):  # a NaN parameter cannot be skipped past: the guard raises
        for _, batch in run.batches(6):
            guard.step(lambda b=batch: train_step(run.model, b), batch=batch)
    guard.close()
    assert guard.last_diagnosis.cause == "parameters.nonfinite"
    (bundle_dir,) = (run_dir / "bundles").iterdir()
    return bundle_dir


@pytest.fixture(scope="module")
def nan_weight_bundles(tmp_path_factory):
    """The nan_weight scenario's trip bundle with the weights and without them."""
    root = tmp_path_factory.mktemp("nan_weight")
    return _nan_weight_bundle(root / "with", bundle_weights=True), _nan_weight_bundle(root / "without")


REPLAY_NAN_WEIGHT = ["--model", "test_cli:make_nan_weight_gpt"]


def test_a_nan_weight_reproduces_from_a_bundle_with_weights(nan_weight_bundles, capsys) -> None:
    with_weights, _ = nan_weight_bundles
    assert main(["replay", str(with_weights), *REPLAY_NAN_WEIGHT]) == 0
    out = capsys.readouterr().out
    assert "weights: the bundle (weights.safetensors)" in out
    assert "parameters.nonfinite" in out and "blocks.1.mlp.fc" in out


def test_without_weights_the_finite_replay_says_the_fault_may_live_in_them(nan_weight_bundles, capsys) -> None:
    with_weights, without = nan_weight_bundles
    assert not (without / "weights.safetensors").exists()
    assert main(["replay", str(without), *REPLAY_NAN_WEIGHT]) == 1
    hint = " ".join(capsys.readouterr().out.split())  # rich may wrap the one line on a narrow terminal
    assert "the replay is finite" in hint and "the fault may live in the weights" in hint
    assert "Guard(bundle_weights=True)" in hint and "--weights PATH" in hint
    # The weights file of one bundle is a plain state dict: --weights takes it for the other.
    other = str(with_weights / "weights.safetensors")
    assert main(["replay", str(without), *REPLAY_NAN_WEIGHT, "--weights", other]) == 0
    assert "parameters.nonfinite" in capsys.readouterr().out


def test_weights_over_the_bundle_limit_are_left_out_and_the_finite_replay_says_so(
    nan_weight_bundles, tmp_path, capsys
) -> None:
    with_weights, _ = nan_weight_bundles
    bundle = load_bundle(with_weights)
    bundle_dir = save_bundle(
        tmp_path,
        step=3,
        rank=0,
        batch=bundle.batch,
        rng_state=bundle.rng_state,
        weights=bundle.load_weights(),
        max_weights_bytes=1000,
    )
    assert not (bundle_dir / "weights.safetensors").exists()
    assert main(["replay", str(bundle_dir), *REPLAY_NAN_WEIGHT]) == 1
    hint = " ".join(capsys.readouterr().out.split())
    assert "over the limit of 1000: left out" in hint and "bundle_weights=N" in hint


def test_a_corrupt_weights_file_in_a_bundle_is_one_line_naming_it(nan_weight_bundles, tmp_path, capsys) -> None:
    bundle_dir = tmp_path / "copy"
    shutil.copytree(nan_weight_bundles[0], bundle_dir)
    weights = bundle_dir / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert main(["replay", str(bundle_dir), *REPLAY_NAN_WEIGHT]) == 1
    err = capsys.readouterr().err
    assert f"{weights}: checksum mismatch" in err and "Traceback" not in err and err.count("\n") == 1


def needs_arguments(width, depth=2):
    """Not a valid --model factory: it needs an argument."""
    return torch.nn.Linear(width, depth)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("test_cli:needs_arguments", "--model: 'test_cli:needs_arguments' needs argument(s) width but is called"),
        ("tests/test_cli.py:make_nan_weight_gpt", "a module's import name, not a file path"),
        ("test_cli:no_such_factory", "--model: 'test_cli' has no attribute 'no_such_factory'"),
        ("no_such_module_xyz.models:build", "--model: no module named 'no_such_module_xyz'"),
    ],
)
def test_model_errors_are_one_line_and_exit_2(tmp_path, capsys, spec, message) -> None:
    bundle_dir = save_bundle(tmp_path, step=0, rank=0, batch={"x": torch.ones(2)}, rng_state=get_rng_state())
    with pytest.raises(SystemExit) as exit_info:
        main(["replay", str(bundle_dir), "--model", spec])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_doctor_json(capsys) -> None:
    code = main(["doctor", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code in (0, 1) and {"items", "summary"} <= data.keys()
    assert any(item["name"].lower().startswith("torch") for item in data["items"])


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**os.environ, **env}
    )


def test_help_of_every_command_and_the_version_never_import_torch() -> None:
    code = """
import sys
from nanguard.cli import main
for argv in (["--help"], ["--version"], ["demo", "--help"], ["zoo", "--help"], ["report", "--help"],
             ["replay", "--help"], ["bisect", "--help"], ["doctor", "--help"]):
    try:
        main(argv)
    except SystemExit as exit:
        assert exit.code == 0, argv
    assert "torch" not in sys.modules, argv
print("no torch")
"""
    out = _run_python(code).stdout
    version = importlib.metadata.version("nanguard")  # pyproject.toml's, as installed
    assert "no torch" in out and "NANGUARD_POLICY" in out and f"nanguard {version}" in out
    assert "seed of the model's init" in out


def test_import_nanguard_loads_neither_matplotlib_nor_rich() -> None:
    code = "import sys, nanguard as ng\nng.Guard\nprint(sorted(m for m in ('rich', 'matplotlib') if m in sys.modules))"
    assert _run_python(code).stdout.strip() == "[]"


def test_zoo_only_takes_commas_and_repeats(monkeypatch) -> None:
    import nanguard.zoo.runner as runner

    seen = {}
    monkeypatch.setattr(runner, "run_zoo", lambda **kwargs: seen.update(kwargs) or 0)
    assert main(["zoo", "--only", "nan_weight,huge_init", "--only", "nan_pixels", "--seed", "3"]) == 0
    assert seen["only"] == ["nan_weight", "huge_init", "nan_pixels"] and seen["seed"] == 3


def test_piped_zoo_table_keeps_whole_cells(capsys) -> None:
    assert main(["zoo", "--only", "token_id_out_of_range,all_labels_ignored"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if " data " in line]  # the table's rows, not the progress lines
    assert len(rows) == 2
    assert "data.index_out_of_range" in rows[0] and "aten.embedding.default" in rows[0] and "wte" in rows[0]
    assert "data.no_valid_targets" in rows[1] and "aten.nll_loss_forward.default" in rows[1]
    assert all(row.rstrip().endswith("ok") for row in rows)
    assert max(len(line) for line in out.splitlines()) > 80  # rich would have folded these rows at 80 columns


def test_default_demo_writes_runs_demo_narrates_the_replay_and_points_at_the_report(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "replaying step 3 under the tracer" in out
    assert out.rstrip().endswith("see `nanguard report runs/demo`")
    assert (tmp_path / "runs" / "demo" / "events-rank0.jsonl").exists()


def _slow_demo(s):
    if s.ranks > 1:
        return pytest.param(s, marks=pytest.mark.dist)
    return pytest.param(s, marks=pytest.mark.slow) if s.run_steps > 100 else s  # grows for hundreds of steps


@pytest.mark.parametrize("scenario", [_slow_demo(s) for s in SCENARIOS], ids=lambda s: s.name)
def test_the_demo_shows_a_diagnosis_for_every_fault(scenario, capsys) -> None:
    code = main(["demo", "--fault", scenario.name, "--no-run-dir"])
    out = capsys.readouterr().out
    assert code == 0, out
    if scenario.expect.cause is None:
        assert "nanguard stayed quiet" in out
    else:
        assert f"created - {scenario.expect.cause} (" in out, out
        if scenario.trip_step not in (FIRST_BAD, BY_FIRST_BAD):  # else the plain run's first non-finite one (or before)
            assert re.search(rf"\bstep\s+{scenario.trip_step}\n", out), out


def test_report_html_without_matplotlib_names_the_extra(tmp_path) -> None:
    model = torch.nn.Linear(2, 1)
    Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), run_dir=tmp_path).close()
    code = f"""
import sys
sys.modules["matplotlib"] = None  # as if the [report] extra were not installed
from nanguard.cli import main
print("exit", main(["report", {str(tmp_path)!r}, "--html", {str(tmp_path / "r.html")!r}]))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "exit 1" in done.stdout and "pip install 'nanguard[report]'" in done.stderr
    assert not (tmp_path / "r.html").exists()
