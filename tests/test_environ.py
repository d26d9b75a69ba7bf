"""NANGUARD_* environment variables: every Guard honours them, and the doctor shows them."""

import json

import pytest
import torch

from nanguard.audit.env import run as doctor
from nanguard.guard import Guard
from nanguard.guard.config import POLICIES


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _nan_closure(model: torch.nn.Module):
    def closure() -> torch.Tensor:
        model.zero_grad()
        loss = model(torch.full((2, 4), float("nan"))).sum()
        loss.backward()
        return loss

    return closure


def test_policy_variable_overrides_the_code(monkeypatch) -> None:
    monkeypatch.setenv("NANGUARD_POLICY", "rollback")
    assert Guard(*_model_and_optimizer(), policy="skip").config.policy == "rollback"


@pytest.mark.parametrize("policy", POLICIES)
def test_the_policy_variable_takes_every_policy_a_guard_takes(monkeypatch, policy: str) -> None:
    monkeypatch.setenv("NANGUARD_POLICY", policy)
    assert Guard(*_model_and_optimizer(), policy="skip").config.policy == policy


def test_a_bad_policy_variable_names_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("NANGUARD_POLICY", "ignore")
    with pytest.raises(ValueError, match="NANGUARD_POLICY must be one of"):
        Guard(*_model_and_optimizer())


def test_run_dir_variable_applies_when_the_code_sets_none(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("NANGUARD_RUN_DIR", str(tmp_path / "job"))
    guard = Guard(*_model_and_optimizer(), locate=False)
    guard.close()
    assert (tmp_path / "job" / "events-rank0.jsonl").exists()
    Guard(*_model_and_optimizer(), run_dir=tmp_path / "mine").close()
    assert (tmp_path / "mine" / "events-rank0.jsonl").exists()


def test_disable_makes_a_plain_optimizer_step(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("NANGUARD_DISABLE", "1")
    model, optimizer = _model_and_optimizer()
    guard = Guard(model, optimizer, policy="raise", run_dir=tmp_path / "run")
    loss = guard.step(_nan_closure(model))
    guard.close()
    assert torch.isnan(loss) and torch.isnan(model.weight).all()  # stepped on NaN gradients, no check
    assert guard.skipped == 0 and guard.last_diagnosis is None and not (tmp_path / "run").exists()


def test_doctor_shows_the_variables(monkeypatch, capsys) -> None:
    monkeypatch.setenv("NANGUARD_POLICY", "raise")
    monkeypatch.delenv("NANGUARD_DISABLE", raising=False)
    doctor(as_json=True)
    items = {item["name"]: item for item in json.loads(capsys.readouterr().out)["items"]}
    assert items["NANGUARD_POLICY"]["value"] == "raise" and items["NANGUARD_POLICY"]["status"] == "ok"
    assert items["NANGUARD_DISABLE"]["value"] == "unset" and "NANGUARD_RUN_DIR" in items


def test_doctor_flags_a_bad_policy_variable(monkeypatch, capsys) -> None:
    monkeypatch.setenv("NANGUARD_POLICY", "maybe")
    assert doctor(as_json=True) == 1
    items = {item["name"]: item for item in json.loads(capsys.readouterr().out)["items"]}
    assert items["NANGUARD_POLICY"]["status"] == "error"
