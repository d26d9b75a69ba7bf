"""DDP ``join()`` with uneven inputs, and ranks out of step: real gloo ranks, faults on one rank only."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nanguard as ng
from nanguard import compat
from nanguard.errors import OutOfStepError
from nanguard.zoo.spawn import spawn_ranks

pytestmark = pytest.mark.dist

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "barrier")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[float]:
    """Parameters and optimizer moments, flat: what a skip must leave bit-identical."""
    flat = [p.detach().reshape(-1) for p in model.parameters()]
    for p in model.parameters():
        st = opt.state.get(p, {})
        flat += [st[k].reshape(-1) for k in ("exp_avg", "exp_avg_sq") if k in st]
    return torch.cat(flat).tolist()


def _join_run(rank, counts, fault=None, policy=None, skip_at=(), count_calls=False, check=False, around=()):
    """``counts[rank]`` batches inside ``ddp.join()``; NaN in rank ``fault[0]``'s batch ``fault[1]``.
    ``policy`` None: the unguarded loop, which skips the optimizer step at ``skip_at``; ``check``: the
    loop owns backward and the optimizer step (``guard.check``: the agreement takes its own all-reduce);
    ``around``: the states before and after those steps are returned too."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model = _mlp()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    guard = None
    if policy is not None:
        guard = ng.Guard(ddp, opt, policy=policy, module_stats=False, snapshot_every=1, rollback_skip_batches=0)
    elif count_calls:
        ddp.register_comm_hook(None, allreduce_hook)  # the same Python all-reduce the guard wraps
    calls = {"n": 0}

    def counting(fn):
        def wrapper(*args, **kwargs):
            calls["n"] += 1
            return fn(*args, **kwargs)

        return wrapper

    actions, error, states = [], None, {}
    swap = {name: counting(getattr(tdist, name)) for name in _COLLECTIVES} if count_calls else {}
    try:
        with compat.swap_collectives(swap), ddp.join():
            for step in range(counts[rank]):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 100 + step))
                if fault == (rank, step):
                    x[0, 0] = float("nan")
                if step in around:
                    states[f"before {step}"] = _state(model, opt)

                def closure(x=x):
                    opt.zero_grad(set_to_none=True)
                    loss = ddp(x).pow(2).mean()
                    loss.backward()
                    return loss

                if guard is None:
                    closure()
                    if step not in skip_at:
                        opt.step()
                elif check:
                    if guard.check(closure(), replay=closure):
                        opt.step()
                        guard.after_step()
                    actions.append(guard.last_action)
                else:
                    guard.step(closure)
                    actions.append(guard.last_action)
                if step in around:
                    states[f"after {step}"] = _state(model, opt)
    except ng.NonFiniteError as err:
        error = err.diagnosis.cause if err.diagnosis is not None else "no diagnosis"
    d = guard.last_diagnosis if guard is not None else None
    diag = None if d is None else [d.cause, d.phase, d.rank, d.ranks, d.step]
    params = [v for p in model.parameters() for v in p.detach().reshape(-1).tolist()]
    return {
        "around": states,
        "state": _state(model, opt),
        "params": params,
        "actions": actions,
        "diag": diag,
        "error": error,
        "calls": calls["n"],
    }


def _join_cases(rank, world):
    out = {}
    # Healthy, uneven: the guarded run is the unguarded one, bit for bit, with no added collective.
    out["plain"] = _join_run(rank, [5, 3], count_calls=True)
    out["healthy"] = _join_run(rank, [5, 3], policy="skip", count_calls=True)
    # Faults inside join() while both ranks step: on rank 0 under skip, on rank 1 under rollback.
    out["ref1"] = _join_run(rank, [5, 3], skip_at=(1,))
    out["skip0"] = _join_run(rank, [5, 3], fault=(0, 1), policy="skip")
    out["rollback1"] = _join_run(rank, [5, 3], fault=(1, 1), policy="rollback")
    # A fault on rank 0 after rank 1 has joined (it ran out after 2 batches): the joined rank shadows.
    out["ref3"] = _join_run(rank, [5, 2], skip_at=(3,))
    out["late_skip"] = _join_run(rank, [5, 2], fault=(0, 3), policy="skip")
    # While a rank has joined no snapshot is taken: the rollback restores the one after step 1.
    out["ref23"] = _join_run(rank, [5, 2], skip_at=(2, 3))
    out["late_rollback"] = _join_run(rank, [5, 2], fault=(0, 3), policy="rollback")
    out["late_raise"] = _join_run(rank, [5, 2], fault=(0, 3), policy="raise")
    out["check"] = _join_run(rank, [5, 2], fault=(0, 3), policy="skip", check=True)
    return out


def test_ddp_join_with_uneven_inputs(tmp_path) -> None:
    results = spawn_ranks(_join_cases, timeout=240)
    for rank, r in enumerate(results):
        assert r["healthy"]["state"] == r["plain"]["state"], rank  # bit-identical to the unguarded run
        assert r["healthy"]["calls"] == r["plain"]["calls"] > 0, (rank, r["healthy"]["calls"], r["plain"]["calls"])
        assert r["healthy"]["actions"] == ["step"] * [5, 3][rank] and r["healthy"]["diag"] is None
        for case, bad in (("skip0", 0), ("rollback1", 1)):
            c = r[case]
            assert c["state"] == r["ref1"]["state"], (rank, case)  # the same as not stepping that batch
            action = "skip" if case == "skip0" else "rollback"
            assert c["actions"] == ["step", action] + ["step"] * ([5, 3][rank] - 2), (rank, case, c["actions"])
            assert c["diag"] == ["data.nonfinite", "data", bad, [bad], 1], (rank, case, c["diag"])
        for case, ref in (("late_skip", "ref3"), ("late_rollback", "ref23")):
            c = r[case]
            assert c["state"] == r[ref]["state"], (rank, case)
            assert c["diag"] == ["data.nonfinite", "data", 0, [0], 3], (rank, case, c["diag"])
            assert c["error"] is None
        assert r["late_raise"]["error"] == "data.nonfinite", (rank, r["late_raise"])
        assert r["check"]["state"] == r["ref3"]["state"] and r["check"]["diag"] == r["late_skip"]["diag"], rank
    assert results[0]["late_skip"]["actions"] == ["step", "step", "step", "skip", "step"]
    assert results[0]["late_rollback"]["actions"] == ["step", "step", "step", "rollback", "step"]
    for case in ("healthy", "skip0", "rollback1", "late_skip", "late_rollback"):
        # DDP's join broadcasts the last joiner's parameters (not its optimizer state) at the end.
        assert results[0][case]["params"] == results[1][case]["params"], case


def _middle_rank(rank, world):
    """3 ranks; rank 2 runs out after 2 batches; the middle rank's batch 3 is bad."""
    counts = [5, 5, 2]
    return {
        "skip": _join_run(rank, counts, fault=(1, 3), policy="skip", around=(2, 3)),
        "rollback": _join_run(rank, counts, fault=(1, 3), policy="rollback", around=(2, 3)),
    }


def test_ddp_join_fault_on_a_middle_rank_after_the_last_joined(tmp_path) -> None:
    # The run is compared with itself (the unguarded comparison at 3+ ranks is tests/test_distributed_exact.py):
    # a skip leaves the state as it was before the bad step; a rollback restores the snapshot after
    # step 1 (none is taken while rank 2 has joined).
    results = spawn_ranks(_middle_rank, world=3, timeout=240)
    for rank, r in enumerate(results[:2]):
        skip, rollback = r["skip"]["around"], r["rollback"]["around"]
        assert skip["after 3"] == skip["before 3"] and rollback["after 3"] == rollback["before 2"], rank
        assert rollback["before 3"] != rollback["before 2"], rank  # step 2 did update
        for case in ("skip", "rollback"):
            assert r[case]["actions"] == ["step"] * 3 + [case, "step"], (rank, case, r[case]["actions"])
    for rank, r in enumerate(results):
        for case in ("skip", "rollback"):
            assert r[case]["diag"] == ["data.nonfinite", "data", 1, [1], 3], (rank, case, r[case]["diag"])
    for case in ("skip", "rollback"):
        assert results[0][case]["params"] == results[1][case]["params"] == results[2][case]["params"], case
        assert results[0][case]["actions"] == results[1][case]["actions"], case


def _out_of_step(rank, world, tmp):
    """Rank 1's loop loses one batch at iteration 2 (an exception it catches and carries on from)."""
    model = _mlp()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    guard = ng.Guard(ddp, opt, module_stats=False, fingerprint_every=0)
    done = []
    for it in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 100 + it))

        def closure(x=x, it=it):
            opt.zero_grad(set_to_none=True)
            if (rank, it) == (1, 2):
                raise ValueError("a bad sample")  # rank 0 is already on its way into the all-reduce
            loss = ddp(x).pow(2).mean()
            loss.backward()
            return loss

        try:
            guard.step(closure)
            done.append(it)
        except ValueError:
            continue
        except OutOfStepError as err:
            return {"done": done, "steps": {str(k): v for k, v in err.steps.items()}, "text": str(err)}
    return {"done": done, "steps": None, "text": None}


def test_ranks_out_of_step_raise_on_every_rank(tmp_path) -> None:
    results = spawn_ranks(_out_of_step, tmp_path, timeout=120)
    assert results[0]["steps"] == results[1]["steps"] == {"0": 2, "1": 3}, results
    assert results[0]["done"] == results[1]["done"] == [0, 1], results
    assert "rank 0 at call 2" in results[0]["text"] and "rank 1 at call 3" in results[0]["text"]


def _stop_while_joined(rank, world, uneven, case):
    """3 ranks; rank ``uneven`` runs out after 2 batches (joins), the others go on. ``collapse``: from
    batch 2 every step's scaled gradients overflow (finite loss), and the GradScaler's scale
    collapses at the 3rd overflow in a row (policy skip: raise). ``spikes``: from batch 5 the loss
    spikes, skipped (``skip_spikes``) until ``max_consecutive_skips=2`` stops the run. The joined
    rank holds neither the grad norm nor the loss history these stops are decided on."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.5)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    if case == "collapse":
        scaler = torch.amp.GradScaler("cpu")
        guard = ng.Guard(ddp, opt, scaler=scaler, module_stats=False, max_overflow_streak=3, fingerprint_every=0)
        bad_from, steps = 2, 8
    else:
        scaler = None
        options = {"spike_window": 8, "spike_warmup": 3, "max_consecutive_skips": 2, "fingerprint_every": 0}
        guard = ng.Guard(ddp, opt, skip_spikes=True, module_stats=False, **options)
        bad_from, steps = 5, 9
    error, cause, actions = None, None, []
    try:
        with ddp.join():
            for step in range(2 if rank == uneven else steps):
                x = torch.randn(4, 2, generator=torch.Generator().manual_seed(rank * 100 + step))
                if step >= bad_from and case == "collapse":
                    x = torch.tensor([[1e36, -1e36]]).repeat(4, 1)  # output 0, gradient 1e36: x65536 is Inf
                elif step >= bad_from:
                    x = x * 1e4

                def closure(x=x):
                    opt.zero_grad(set_to_none=True)
                    loss = ddp(x).pow(2).mean() if case == "spikes" else ddp(x).mean()
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                    return loss

                guard.step(closure)
                actions.append(guard.last_action)
    except ng.NonFiniteError as err:
        error, cause = str(err), err.diagnosis.cause if err.diagnosis is not None else None
    return {"error": error, "cause": cause, "actions": actions}


def _stops(rank, world):
    cases = [(case, uneven) for case in ("collapse", "spikes") for uneven in (0, 1)]
    return {f"{case}@{uneven}": _stop_while_joined(rank, world, uneven, case) for case, uneven in cases}


def test_ddp_join_stops_the_joined_rank_cannot_foresee_reach_it(tmp_path) -> None:
    # Before: the stepping ranks raised and the joined rank waited in its join hook until the deadline.
    results = spawn_ranks(_stops, world=3, timeout=240)
    for key in ("collapse@0", "collapse@1", "spikes@0", "spikes@1"):
        uneven = int(key[-1])
        stepping = [r[key] for rank, r in enumerate(results) if rank != uneven]
        joined = results[uneven][key]
        for r in stepping:
            assert r["error"] is not None and r["actions"] == stepping[0]["actions"], (key, r)
        if key.startswith("collapse"):
            assert stepping[0]["cause"] == "precision.loss_scale", stepping[0]
            assert stepping[0]["actions"] == ["step", "step", "overflow", "overflow"], stepping[0]
        else:
            assert "max_consecutive_skips=2" in stepping[0]["error"], stepping[0]
            assert stepping[0]["actions"][-1] == "skip", stepping[0]
        assert joined["error"] is not None and "stopped" in joined["error"], (key, joined)
        assert joined["actions"] == ["step", "step"], (key, joined)
