"""The guard's parts on their own: health flags, history evidence, the policy table, the recorders."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nanguard.dist import CommWatch
from nanguard.findings import Diagnosis
from nanguard.guard.config import GuardConfig
from nanguard.guard.health import HealthCheck, HealthFlag
from nanguard.guard.history import History
from nanguard.guard.recorder import NullRecorder, Recorder, recorder_for
from nanguard.guard.recovery import Recovery


def _check(w: nn.Parameter) -> HealthCheck:
    return HealthCheck([w], scaler=None, comm=CommWatch(), param_check_every=1)


@pytest.mark.parametrize(
    ("grad", "loss", "flags"),
    [(1.0, 2.0, HealthFlag.OK), (float("nan"), 2.0, HealthFlag.LOCAL | HealthFlag.SYNCED),
     (1.0, float("inf"), HealthFlag.LOCAL)],
)  # fmt: skip
def test_health_flags_read_back_once(grad: float, loss: float, flags: HealthFlag) -> None:
    w = nn.Parameter(torch.zeros(3))
    w.grad = torch.full((3,), grad)
    measured = _check(w).measure(torch.tensor(loss))
    h = measured.read(7, measured.agree(sharded=False), scaled=False)
    assert h.rank_flags == (flags,) and h.step == 7 and h.scale is None
    assert h.bad_ranks == ([0] if flags & HealthFlag.LOCAL else [])


def test_a_bad_update_is_flagged_with_the_next_step() -> None:
    w = nn.Parameter(torch.zeros(3))
    check = _check(w)
    with torch.no_grad():
        w.fill_(float("nan"))
    check.after_update(0)
    w.grad = torch.ones(3)
    measured = check.measure(torch.tensor(1.0))
    assert measured.read(1, measured.agree(sharded=False), scaled=False).ranks_with(HealthFlag.PARAMS) == [0]
    measured = check.measure(torch.tensor(1.0))  # read once: the next step is clean again
    assert measured.read(2, measured.agree(sharded=False), scaled=False).ranks_with(HealthFlag.PARAMS) == []


def _history() -> History:
    return History.from_config(GuardConfig(divergence_window=5, divergence_factor=10.0))


def test_history_evidence_sees_growth_and_spikes() -> None:
    history = _history()
    assert history.evidence(0, lr=0.1) == {}
    for step, gn in enumerate([1.0, 1.0, 2.0, 40.0]):
        history.append(step, loss=2.0, grad_norm=gn)
    ev = history.evidence(4, lr=0.1)
    assert ev["diverging"] and ev["metric"] == "grad_norm" and ev["growth"] == pytest.approx(40.0)
    calm = _history()
    for step in range(4):
        calm.append(step, loss=2.0, grad_norm=1.0)
    assert not calm.evidence(4, lr=0.1)["diverging"]


@pytest.mark.parametrize(
    ("policy", "cause", "phase", "snapshot", "action"),
    [("skip", "data.nonfinite", "data", False, "skip"),
     ("skip", "optimizer.nonfinite_update", "optimizer", False, "raise"),
     ("skip", "optimizer.nonfinite_update", "optimizer", True, "rollback"),
     ("raise", "data.nonfinite", "data", False, "raise"),
     ("rollback", "op.log_domain", "forward", True, "rollback")],
)  # fmt: skip
def test_policy_table(policy: str, cause: str, phase: str, snapshot: bool, action: str) -> None:
    model = nn.Linear(2, 2)
    recovery = Recovery(model, torch.optim.SGD(model.parameters(), lr=0.1), scaler=None,
                        config=GuardConfig(policy=policy))  # fmt: skip
    if snapshot:
        recovery.take_snapshot(0)
    assert recovery.policy_for(Diagnosis(cause=cause, phase=phase)) == action


def test_null_recorder_without_run_dir_and_a_real_one_with(tmp_path) -> None:
    assert type(recorder_for(None, rank=0, max_bundle_bytes=0)) is NullRecorder
    recorder = recorder_for(tmp_path, rank=2, max_bundle_bytes=0)
    assert isinstance(recorder, Recorder)
    recorder.skip(3, "a reason")
    recorder.close()
    assert '"reason":"a reason"' in (tmp_path / "events-rank2.jsonl").read_text()
