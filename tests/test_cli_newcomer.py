"""What a newcomer meets at the command line: one line saying what to pass when the replay's step or the
``--model`` module does not fit, a killed run's cut-short log, a report pointed one folder too high, a
torch other than the one nanguard was tested with, and help that says what each command and option is."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import nanguard as ng
from nanguard import compat
from nanguard.audit import env
from nanguard.bundle import load_bundle, save_bundle
from nanguard.cli import build_parser, main
from nanguard.cli.replay import version_note
from nanguard.report.load import load_run
from nanguard.rng import get_rng_state


def linear() -> torch.nn.Module:
    """A ``--model`` factory whose forward takes one positional tensor: ``model(**batch)`` does not fit it."""
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def _one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("nanguard: replaying")]
    assert len(lines) == 1 and "Traceback" not in err and "usage:" not in err, err
    return lines[0]


def test_a_default_step_that_does_not_fit_is_one_line_naming_fn(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path.parent))
    bundle = save_bundle(tmp_path, step=0, rank=0, batch={"x": torch.ones(2, 4)}, rng_state=get_rng_state())
    monkeypatch.setitem(sys.modules, "newcomer_models", sys.modules[__name__])
    line = _one_line_exit_2(capsys, ["replay", str(bundle), "--model", "newcomer_models:linear"])
    assert "--fn: the default step (model(**batch) with keys x" in line and "pass --fn PKG.MODULE:FUNCTION" in line
    assert "TypeError" in line


def test_a_model_module_that_parses_its_command_line_on_import_is_one_line(tmp_path, capsys, monkeypatch) -> None:
    (tmp_path / "train_script.py").write_text(
        "import argparse\n"
        "parser = argparse.ArgumentParser()\n"
        "parser.add_argument('--data', required=True)\n"
        "args = parser.parse_args()\n"
        "def build():\n"
        "    return None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    bundle = save_bundle(tmp_path / "b", step=0, rank=0, batch={"x": torch.ones(2)}, rng_state=get_rng_state())
    line = _one_line_exit_2(capsys, ["replay", str(bundle), "--model", "train_script:build"])
    assert "importing 'train_script' ran its command line and exited with 2" in line
    assert "the following arguments are required: --data" in line and '__name__ == "__main__"' in line


def test_a_bundle_from_another_torch_says_so(tmp_path) -> None:
    path = save_bundle(tmp_path, step=0, rank=0, batch={"x": torch.ones(2)}, rng_state=get_rng_state())
    assert version_note(load_bundle(path)) is None
    meta = json.loads((path / "meta.json").read_text())
    meta["torch"] = "2.9.1"
    (path / "meta.json").write_text(json.dumps(meta))
    note = version_note(load_bundle(path))
    assert note is not None and "torch 2.9.1" in note and f"torch {torch.__version__}" in note


def test_doctor_says_when_torch_is_newer_than_compat_was_tested_with() -> None:
    assert env._newer_than_tested(compat.TESTED_TORCH) is None
    assert env._newer_than_tested("2.4.0") is None
    item = env._newer_than_tested("99.1.0")
    assert item is not None and item.status == "warning" and compat.TESTED_TORCH in item.advice


def _guarded_run(run_dir, steps: int = 4, bad: int = 2) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ng.Guard(model, optimizer, run_dir=run_dir)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for step in range(steps):
        xb = x.clone()
        if step == bad:
            xb[0, 0] = float("nan")

        def closure(xb: torch.Tensor = xb) -> torch.Tensor:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), y)
            loss.backward()
            return loss

        guard.step(closure, batch={"x": xb})
    guard.close()


def test_a_log_cut_short_by_a_killed_run_names_the_line_and_shows_the_trip_from_its_bundle(tmp_path) -> None:
    _guarded_run(tmp_path)
    log = tmp_path / "events-rank0.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    trip = next(i for i, line in enumerate(lines) if line.startswith('{"kind":"trip"'))
    log.write_text("".join(lines[:trip]) + lines[trip][: len(lines[trip]) // 2])  # killed while writing the trip
    with pytest.warns(UserWarning, match=rf"events-rank0.jsonl:{trip + 1}: the log's last line is cut short"):
        report = load_run(tmp_path)
    assert [(t.step, t.diagnosis.cause) for t in report.trips if t.diagnosis] == [(2, "data.nonfinite")]
    assert "from its bundle" in report.trips[0].action


def test_a_report_one_folder_too_high_names_the_folder(tmp_path, capsys) -> None:
    _guarded_run(tmp_path / "tb" / "run" / "nanguard")
    assert main(["report", str(tmp_path / "tb" / "run")]) == 1
    err = capsys.readouterr().err
    assert f"run: nanguard report {tmp_path / 'tb' / 'run' / 'nanguard'}" in err


def _help(*argv: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[argv[0]].format_help() if argv else parser.format_help()  # type: ignore[union-attr]


def test_every_command_has_a_description_and_fn_says_what_it_is() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, command in sub.choices.items():  # type: ignore[union-attr]
        assert command.description and len(command.description) > 60, name
    fn_help = " ".join(_help("replay").split())
    assert "returns step(batch)" in fn_help and "return the loss" in fn_help
