"""The guard's parts on their own: health flags, history evidence, the policy table, the recorders."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from nanguard.dist import CommWatch
from nanguard.findings import Diagnosis
from nanguard.guard.config import GuardConfig
from nanguard.guard.health import HealthCheck, HealthFlag
from nanguard.guard.history import UNAGREED, History
from nanguard.guard.policy import Policy
from nanguard.guard.recorder import NullRecorder, Recorder, recorder_for
from nanguard.guard.recovery import Recovery
from nanguard.guard.verdict import Verdict


def _check(w: nn.Parameter) -> HealthCheck:
    return HealthCheck([w], scaler=None, comm=CommWatch(), param_check_every=1)


@pytest.mark.parametrize(
    ("grad", "loss", "flags"),
    [
        (1.0, 2.0, HealthFlag.OK),
        (float("nan"), 2.0, HealthFlag.LOCAL | HealthFlag.SYNCED),
        (1.0, float("inf"), HealthFlag.LOCAL),
    ],
)
def test_health_flags_read_back_once(grad: float, loss: float, flags: HealthFlag) -> None:
    w = nn.Parameter(torch.zeros(3))
    w.grad = torch.full((3,), grad)
    measured = _check(w).on_device(torch.tensor(loss))
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
    measured = check.on_device(torch.tensor(1.0))
    assert measured.read(1, measured.agree(sharded=False), scaled=False).ranks_with(HealthFlag.PARAMS) == [0]
    measured = check.on_device(torch.tensor(1.0))  # read once: the next step is clean again
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


def test_a_loss_no_collective_agreed_warns_on_its_rank_and_decides_nothing() -> None:
    """Two ranks' histories on riding steps (``UNAGREED``: no mean loss; the same grad norms, as DDP's averaged
    gradients make them), one rank's own loss spiking tenfold at step 12: that rank alone warns, and every
    decision (the spikes the policy reads, their count, the divergence trip, the snapshot's hold) is alike."""
    ranks = [History.from_config(GuardConfig(spike_warmup=5)) for _ in range(2)]
    seen: list[list[object]] = [[], []]
    for step in range(14):
        norm = 1.0 + 0.01 * (step % 3)
        for r, history in enumerate(ranks):
            own = 40.0 if (r, step) == (0, 12) else 2.0 + 0.01 * ((step + r) % 4)
            spikes = history.observe(step, loss=UNAGREED, grad_norm=norm)
            own_spike = history.own_spike(loss=UNAGREED, own_loss=own)
            runaway = history.runaway(step, loss=UNAGREED, grad_norm=norm)
            history.append(step, loss=UNAGREED, grad_norm=norm)
            seen[r].append((spikes, runaway, history.growing(None), own_spike is not None))
    decisions = [[s[:3] for s in rank] for rank in seen]
    assert decisions[0] == decisions[1] and ranks[0].spikes == ranks[1].spikes == 0
    assert [s[3] for s in seen[0]] == [step == 12 for step in range(14)] and not any(s[3] for s in seen[1])
    # An agreed loss (2 ranks, or a collective): its spikes are the run's, none is this rank's own.
    assert ranks[1].own_spike(loss=2.0, own_loss=400.0) is None


@pytest.mark.parametrize(
    ("policy", "cause", "phase", "snapshot", "action"),
    [
        ("skip", "data.nonfinite", "data", False, "skip"),
        ("skip", "optimizer.nonfinite_update", "optimizer", False, "raise"),
        ("skip", "optimizer.nonfinite_update", "optimizer", True, "rollback"),
        ("raise", "data.nonfinite", "data", False, "raise"),
        ("rollback", "op.log_domain", "forward", True, "rollback"),
    ],
)
def test_policy_table(policy: str, cause: str, phase: str, snapshot: bool, action: str) -> None:
    model = nn.Linear(2, 2)
    recovery = Recovery(
        model, torch.optim.SGD(model.parameters(), lr=0.1), scaler=None, config=GuardConfig(policy=policy)
    )
    if snapshot:
        recovery.take_snapshot(0)
    state = _State(has_snapshot=recovery.snapshot is not None)
    verdict = Verdict("trip", 3, diagnosis=Diagnosis(cause=cause, phase=phase))
    assert Policy(GuardConfig(policy=policy)).decide(verdict, state).kind == action


@dataclass
class _State:
    """The parts' state the policy reads (``policy.State``), set by hand."""

    has_snapshot: bool = False
    consecutive_skips: int = 0
    upcast: list[str] = field(default_factory=list)
    last_diagnosis: Diagnosis | None = None
    why_not_upcast: str | None = None

    def can_upcast(self, module: str | None) -> str | None:
        return self.why_not_upcast


def test_null_recorder_without_run_dir_and_a_real_one_with(tmp_path) -> None:
    assert type(recorder_for(None, rank=0, max_bundle_bytes=0)) is NullRecorder
    recorder = recorder_for(tmp_path, rank=2, max_bundle_bytes=0)
    assert isinstance(recorder, Recorder)
    recorder.skip(3, "a reason")
    recorder.close()
    assert '"reason":"a reason"' in (tmp_path / "events-rank2.jsonl").read_text()


# -- the fused health check against a plain per-tensor reference ---------------------------------
def _reference(tensors: list[torch.Tensor]) -> tuple[float, bool]:
    """The slow path: every tensor's values in float64, one by one."""
    vals = [(t.coalesce().values() if t.is_sparse else t).detach().double().flatten() for t in tensors]
    flat = torch.cat(vals) if vals else torch.zeros(0, dtype=torch.float64)
    return float(flat.norm()), bool(torch.isfinite(flat).all())


def _params(dtype: torch.dtype, bad: float | None, where: str) -> list[nn.Parameter]:
    torch.manual_seed(0)
    # the third is empty (an empty gradient); the last is float32 beside the others, as norms often are
    params = [nn.Parameter(torch.randn(n).to(dtype)) for n in (5, 7, 0)] + [nn.Parameter(torch.randn(4))]
    for p in params:
        p.grad = torch.randn_like(p)
    params[1].grad = None  # a parameter without a gradient
    if bad is not None:
        target = params[0].grad if where == "grad" else params[3]
        with torch.no_grad():
            target[2] = bad
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("bad", "where"),
    [(None, "grad"), (float("nan"), "grad"), (float("inf"), "grad"), (float("-inf"), "param"), (float("nan"), "param")],
)
def test_fused_check_flags_what_the_slow_path_flags(dtype: torch.dtype, bad: float | None, where: str) -> None:
    params = _params(dtype, bad, where)
    check = HealthCheck(params, scaler=None, comm=CommWatch(), param_check_every=1)
    check.after_update(0)
    measured = check.on_device(torch.tensor(1.0))
    h = measured.read(1, measured.agree(sharded=False), scaled=False)
    norm, grads_finite = _reference([p.grad for p in params if p.grad is not None])
    _, params_finite = _reference(params)
    assert (h.bad_ranks == [0]) == (not grads_finite) and h.synced_bad == (not grads_finite)
    assert (h.ranks_with(HealthFlag.PARAMS) == [0]) == (not params_finite)
    if grads_finite:
        assert h.grad_norm == pytest.approx(norm, rel=1e-5)


def test_sparse_and_missing_gradients_are_measured_like_dense_ones() -> None:
    emb, lin = nn.Embedding(10, 3, sparse=True), nn.Linear(3, 2)
    params = [*emb.parameters(), *lin.parameters(), nn.Parameter(torch.ones(2))]  # the last never gets a grad
    check = HealthCheck(params, scaler=None, comm=CommWatch(), param_check_every=1)
    for ids in ([1, 1, 4], [2, 9, 9]):  # repeated ids: an uncoalesced sparse gradient
        lin(emb(torch.tensor(ids))).sum().backward()
        measured = check.on_device(torch.tensor(1.0))
        h = measured.read(0, measured.agree(sharded=False), scaled=False)
        assert emb.weight.grad.is_sparse and h.rank_flags == (HealthFlag.OK,)
        assert h.grad_norm == pytest.approx(_reference([p.grad for p in params if p.grad is not None])[0], rel=1e-5)
    check.after_update(0)  # the parameter check works on the slow path too
    assert check.on_device(torch.tensor(1.0)).flags.item() == 0


def test_no_gradients_at_all() -> None:
    check = HealthCheck([nn.Parameter(torch.ones(2))], scaler=None, comm=CommWatch(), param_check_every=1)
    measured = check.on_device(torch.tensor(float("nan")))
    h = measured.read(0, measured.agree(sharded=False), scaled=False)
    assert h.grad_norm == 0.0 and h.bad_ranks == [0]


@pytest.mark.parametrize("scale", [1e20, 1e30])
def test_finite_huge_gradients_do_not_overflow_the_norm(scale: float) -> None:
    w = nn.Parameter(torch.zeros(1000))
    w.grad = torch.full((1000,), scale)  # the float32 sum of squares would be >= 1e43
    check = _check(w)
    check.after_update(0)
    measured = check.on_device(torch.tensor(1.0))
    h = measured.read(0, measured.agree(sharded=False), scaled=False)
    assert h.rank_flags == (HealthFlag.OK,)
    assert h.grad_norm == pytest.approx(scale * 1000**0.5, rel=1e-5)


def test_growing_finite_gradients_then_a_nan_are_divergence() -> None:
    import nanguard as ng

    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    guard = ng.Guard(model, torch.optim.SGD(model.parameters(), lr=0.0), policy="raise")
    x = torch.randn(4, 8)
    # Gradients ~1e13 .. 1e17: finite, each step 10x the last, below float32's squared range (past
    # 1.8e19 a float32 clip computes an Inf norm, and the guard trips first: tests/test_loop_faults.py).
    for k in range(5):
        guard.step(lambda k=k: _scaled_loss(model, x, 10.0 ** (13 + k)))
    assert guard.skipped == 0
    assert all(1e12 < p.grad_norm < 1e19 for p in guard.history)
    with pytest.raises(ng.NonFiniteError) as info:
        guard.step(lambda: _scaled_loss(model, x, 1e39))  # float32 overflow: a real Inf at last
    diag = info.value.diagnosis
    assert diag.cause == "optimizer.divergence" and diag.evidence["history"]["growth"] >= 1e3


def _scaled_loss(model: nn.Module, x: torch.Tensor, scale: float) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean() * scale
    loss.backward()
    return loss


# -- non-reproduction outside torch.distributed ----------------------------------------------------
def test_a_single_process_step_that_does_not_reproduce_claims_no_distribution() -> None:
    from nanguard.diagnose import transient_fault, with_run_facts
    from nanguard.evidence import RunFacts
    from nanguard.findings import CAUSES

    assert "distribut" not in CAUSES["step.not_reproduced"]
    diag = transient_fault(step=3, loss=float("nan"), grad_norm=1.0, flagged_ranks=[0], located=True, distributed=False)
    assert diag.cause == "step.not_reproduced" and diag.rank is None and diag.ranks == []
    assert not any("NCCL" in fix for fix in diag.fixes)
    grew = {"diverging": True, "metric": "loss", "growth": 50.0, "window": 4, "lr": 1.0}
    after = with_run_facts(diag, RunFacts(grew))
    assert after.cause == "optimizer.divergence" and after.evidence["op_cause"] == "step.not_reproduced"
    assert with_run_facts(diag, RunFacts({**grew, "diverging": False})).cause == "step.not_reproduced"


def test_history_evidence_counts_updates_not_skipped_steps() -> None:
    # Skipped steps leave the parameters as the last updates made them: the growth that led
    # there is still the evidence, however many steps were skipped since.
    history = _history()
    for step, gn in enumerate([1.0, 3.0, 9.0, 27.0, 81.0]):
        history.append(step, loss=2.0, grad_norm=gn)
    for later in (5, 8, 60):
        ev = history.evidence(later, lr=0.1)
        assert ev["diverging"] and ev["window"] == 5 and ev["growth"] == pytest.approx(81.0)
    for step in range(5, 11):  # six calm updates: the growth leaves the window
        history.append(step, loss=2.0, grad_norm=1.0)
    assert not history.evidence(11, lr=0.1)["diverging"]


def test_a_spike_stays_evidence_while_steps_are_skipped() -> None:
    history = _history()
    for step in range(30):  # past the detectors' warm-up, with a little noise
        gn = 1.0 + 0.01 * (step % 3)
        history.observe(step, loss=2.0, grad_norm=gn)
        history.append(step, loss=2.0, grad_norm=gn)
    assert history.observe(30, loss=2.0, grad_norm=1e4)  # a spike; the step is then skipped
    assert history.evidence(31, lr=0.1)["spike"]
    assert history.evidence(90, lr=0.1)["spike"]  # 59 skipped steps later: no update since the spike
    for step in range(31, 37):
        history.append(step, loss=2.0, grad_norm=1.0)
    assert not history.evidence(37, lr=0.1)["spike"]  # six updates since: out of the window


def test_an_engines_own_verdict_is_replayed_judged_and_recorded_through_the_seam(tmp_path) -> None:
    import math

    import nanguard as ng
    from nanguard.events import read_events

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ng.Guard(model, opt, run_dir=tmp_path)
    x = torch.ones(2, 3)

    def rerun(bad: bool) -> torch.Tensor:
        model.zero_grad()
        loss = model(x).sum()
        (loss * (math.inf if bad else 1.0)).backward()
        return loss

    assert guard.engine_verdict(4, lambda: rerun(False), action="overflow", batch=x, scale=2.0) is None
    diag = guard.engine_verdict(4, lambda: rerun(True), action="overflow", batch=x, scale=2.0)
    guard.close()
    assert diag is not None and diag.step == 4 and diag.phase == "backward"
    trips = [e for e in read_events(tmp_path / "events-rank0.jsonl") if e["kind"] == "trip"]
    assert [(t["step"], t["action"], t["scale"], t["diagnosis"]["cause"]) for t in trips] == [
        (4, "overflow", 2.0, diag.cause)
    ]
    assert guard.last_diagnosis is None and guard.skipped == 0  # the engine's verdict changes nothing else
