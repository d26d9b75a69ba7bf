"""The guard's fast paths against their slow references: the precomputed-group norms, the flag
lookup, and the deferred read (``sync="deferred"``, forced on the CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nanguard as ng
from nanguard import stats
from nanguard.dist import CommWatch
from nanguard.guard.health import HealthCheck, HealthFlag, StepHealth, _flag_table
from nanguard.zoo import GPT, GPTConfig, synthetic_batch, train_step

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
NAN, INF = float("nan"), float("inf")


def _params(dtype: torch.dtype) -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(shape).to(dtype)) for shape in [(4, 3), (5,), (2, 2, 2)]]


def _read_both_ways(check: HealthCheck, loss: float = 1.0) -> StepHealth:
    """The step read by the device flags (``measure``, what ranks agree on and the deferred path
    copies) and by the host lookup of a process alone (``read_alone``): the two must say the same."""
    queued = check._param_norm  # each read takes the queued parameter check
    measured = check.on_device(torch.tensor(loss))
    device = measured.read(0, measured.agree(sharded=False), scaled=check.scaler is not None)
    check._param_norm = queued
    assert check.alone
    host = check.read_alone(torch.tensor(loss), 0)
    assert repr(host) == repr(device)  # repr: NaN reads equal to NaN
    return host


def _flags(check: HealthCheck, loss: float = 1.0) -> HealthFlag:
    return _read_both_ways(check, loss).rank_flags[0]


def _reference(params: list[nn.Parameter], loss: float, checked: bool) -> HealthFlag:
    """What the flags must say, from one isfinite per tensor."""
    grads_bad = any(not torch.isfinite(p.grad).all() for p in params if p.grad is not None)
    params_bad = checked and any(not torch.isfinite(p.detach()).all() for p in params)
    flags = HealthFlag.OK
    if grads_bad or not math.isfinite(loss):
        flags |= HealthFlag.LOCAL
    if grads_bad:
        flags |= HealthFlag.SYNCED
    return flags | (HealthFlag.PARAMS if params_bad else HealthFlag.OK)


CASES = {
    "healthy": (None, None, 1.0),
    "nan grad": ((0, 1, NAN), None, 1.0),
    "inf grad": ((2, 0, -INF), None, 1.0),
    "nan param": (None, (1, 2, NAN), 1.0),
    "inf param and bad loss": (None, (0, 3, INF), INF),
    "both": ((1, 0, NAN), (2, 1, INF), 1.0),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("slow", [False, True], ids=["fused", "slow"])
def test_the_fused_pass_flags_what_each_tensor_holds(dtype: torch.dtype, case: str, slow: bool) -> None:
    bad_grad, bad_param, loss = CASES[case]
    params = _params(dtype)
    for p in params[:2]:  # the last parameter has no gradient (frozen, or unused this step)
        p.grad = torch.ones_like(p)
    if bad_grad:
        params[bad_grad[0] % 2].grad.view(-1)[bad_grad[1]] = bad_grad[2]
    if bad_param:
        with torch.no_grad():
            params[bad_param[0]].view(-1)[bad_param[1]] = bad_param[2]
    check = HealthCheck(params, scaler=None, comm=CommWatch(), param_check_every=1)
    if slow:
        check._groups = None
    check.after_update(0)  # the check is taken now, right after the update
    assert _flags(check, loss) == _reference(params, loss, checked=True)
    # Without a queued check the parameters are not looked at: that step's flags are the gradients' alone.
    assert _flags(check, loss) == _reference(params, loss, checked=False)


@pytest.mark.parametrize("case", CASES)
def test_both_reads_agree_under_a_grad_scaler(case: str) -> None:
    bad_grad, bad_param, loss = CASES[case]
    params = _params(torch.float32)
    for p in params:
        p.grad = torch.full_like(p, 1024.0)
    if bad_grad:
        params[bad_grad[0]].grad.view(-1)[bad_grad[1]] = bad_grad[2]
    if bad_param:
        with torch.no_grad():
            params[bad_param[0]].view(-1)[bad_param[1]] = bad_param[2]
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # makes its scale tensor
    check = HealthCheck(params, scaler=scaler, comm=CommWatch(), param_check_every=1)
    check.after_update(0)
    health = _read_both_ways(check, loss)
    assert health.scale == 1024.0
    # With a scaler, overflowing gradients are its business: only the loss and the parameters trip.
    bad_loss = HealthFlag.LOCAL if not math.isfinite(loss) else HealthFlag.OK
    assert health.rank_flags[0] == bad_loss | (HealthFlag.PARAMS if bad_param else HealthFlag.OK)


def test_a_parameter_changed_after_the_check_is_not_blamed_on_the_update() -> None:
    params = _params(torch.float32)
    check = HealthCheck(params, scaler=None, comm=CommWatch(), param_check_every=1)
    check.after_update(0)
    with torch.no_grad():
        params[0].view(-1)[0] = NAN  # written between steps, not by the optimizer
    assert _flags(check) == HealthFlag.OK


def test_params_check_with_no_gradients_at_all() -> None:
    params = _params(torch.float32)
    check = HealthCheck(params, scaler=None, comm=CommWatch(), param_check_every=1)
    assert _flags(check) == HealthFlag.OK
    with torch.no_grad():
        params[2].view(-1)[0] = NAN
    check.after_update(0)
    assert _flags(check) == HealthFlag.PARAMS


def test_sparse_gradients_take_the_slow_path_with_the_same_flags() -> None:
    emb = nn.Embedding(10, 4, sparse=True)
    lin = nn.Linear(4, 1)
    params = [emb.weight, *lin.parameters()]
    check = HealthCheck(params, scaler=None, comm=CommWatch(), param_check_every=1)
    lin(emb(torch.tensor([1, 2, 2]))).sum().backward()
    assert emb.weight.grad.is_sparse
    check.after_update(0)
    assert _flags(check) == HealthFlag.OK and check._groups is None
    with torch.no_grad():
        emb.weight[7, 0] = NAN  # a row no batch picked: only the parameter check can see it
    check.after_update(1)
    assert _flags(check) == HealthFlag.PARAMS
    lin.weight.grad[0, 0] = INF
    assert _flags(check) == HealthFlag.LOCAL | HealthFlag.SYNCED


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_total_norm_is_the_float64_norm(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    tensors = [torch.randn(7).to(dtype), torch.randn(3, 3).to(dtype), torch.randn(6)]  # two groups for most
    norm = stats.total_norm(stats.float_groups(tensors))
    exact = torch.cat([t.double().reshape(-1) for t in tensors]).norm().float()
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm, exact, rtol=1e-5, atol=0)


def test_total_norm_stays_finite_past_the_float32_square_range() -> None:
    # 1e20 squared overflows float32: a finite parameter set must not read as bad.
    norm = stats.total_norm([[torch.ones(3)], [torch.full((4,), 1e20, dtype=torch.bfloat16)]])
    assert 1.9e20 < norm.item() < 2.1e20
    assert stats.total_norm([]).item() == 0.0


def test_the_flag_table_matches_each_mode() -> None:
    local, synced, params = HealthFlag.LOCAL, HealthFlag.SYNCED, HealthFlag.PARAMS
    # index = loss_bad + 2 * grads_bad + 4 * params_bad
    assert _flag_table(scaled=False, merge=True) == [
        0,
        local,
        local | synced,
        local | synced,
        params,
        params | local,
        params | local | synced,
        params | local | synced,
    ]
    # Under torch.distributed without a comm watch, gradients (already averaged) are not the rank's own.
    assert _flag_table(scaled=False, merge=False)[2] == synced
    # With a GradScaler an overflowing gradient is the scaler's business.
    assert _flag_table(scaled=True, merge=True)[2] == 0 and _flag_table(scaled=True, merge=True)[5] == local | params


# -- the deferred read ---------------------------------------------------------------------


def _run(seed: int = 0) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vision_dim=16))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def _batch(model: GPT, step: int, bad: bool = False) -> dict[str, torch.Tensor]:
    batch = synthetic_batch(model.config, torch.Generator().manual_seed(step))
    return {**batch, "pixel_values": torch.full((8, 4, 16), NAN)} if bad else batch


def _step(guard: ng.Guard, model: GPT, step: int, bad: bool = False):
    batch = _batch(model, step, bad)
    return guard.step(lambda: train_step(model, batch), batch=batch)


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_deferred_healthy_run_is_bit_identical_to_immediate() -> None:
    finals = []
    for sync in ("immediate", "deferred"):
        model, opt = _run()
        guard = ng.Guard(model, opt, sync=sync)
        assert guard._deferred == (sync == "deferred")
        for step in range(4):
            assert _step(guard, model, step) is not None
        guard.close()
        assert guard.step_count == 4 and guard.skipped == 0 and len(guard.history.points) == 4
        finals.append(_weights(model))
    assert all(torch.equal(a, b) for a, b in zip(*finals, strict=True))


def test_deferred_rollback_restores_the_snapshot_and_drops_the_next_batch() -> None:
    model, opt = _run()
    guard = ng.Guard(model, opt, policy="rollback", sync="deferred", snapshot_every=2)
    for step in range(4):
        _step(guard, model, step)
    _step(guard, model, 4, bad=True)  # step 3's verdict (good) is read here: a snapshot after 4 good steps
    snapshot = guard.recovery.snapshot
    assert snapshot["step"] == 4
    assert guard.step(lambda: pytest.fail("a dropped batch must not run")) is None
    assert guard.last_action == "drop_batch" and guard.rollbacks == 1
    assert (guard.last_diagnosis.step, guard.last_diagnosis.cause) == (4, "data.nonfinite")
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in snapshot["model"].items())


def test_deferred_raise_comes_with_the_next_call() -> None:
    model, opt = _run()
    guard = ng.Guard(model, opt, policy="raise", sync="deferred")
    _step(guard, model, 0)
    _step(guard, model, 1, bad=True)
    with pytest.raises(ng.NonFiniteError) as err:
        guard.close()
    assert err.value.diagnosis.step == 1


def test_deferred_needs_an_optimizer_that_skips_on_the_device() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="sync='deferred' needs"):
        ng.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), sync="deferred")
    with pytest.raises(ValueError, match="sync must be one of"):
        ng.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), sync="later")
    # "auto" on the CPU reads immediately, so every existing behaviour stays.
    assert not ng.Guard(model, torch.optim.AdamW(model.parameters(), fused=True))._deferred


def test_a_rollback_restores_the_gradscaler_as_the_snapshot_held_it() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # growth_interval=2: the scale doubles every second good step, so each step leaves a different state.
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    guard = ng.Guard(model, opt, "rollback", scaler=scaler, snapshot_every=2, rollback_skip_batches=0, locate=False)
    x = torch.ones(2, 4)

    def closure(bad: bool = False) -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).sum() * (NAN if bad else 1.0)
        scaler.scale(loss).backward()
        return loss

    guard.step(closure)
    guard.step(closure)  # the second good step: a snapshot, its scaler state with it
    saved = scaler.state_dict()
    guard.step(closure)
    assert scaler.state_dict() != saved  # the growth tracker moved on
    guard.step(lambda: closure(bad=True))  # abandoned: the scaler's own update would halve the scale
    assert guard.rollbacks == 1 and guard.last_action == "rollback"
    assert scaler.state_dict() == saved and scaler.get_scale() == 2048.0
