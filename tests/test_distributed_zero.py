"""ZeroRedundancyOptimizer under DDP: snapshots of each rank's own shard, and the owner of a bad update."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import nanguard as ng
from nanguard import compat
from nanguard.zoo.spawn import spawn_ranks

pytestmark = pytest.mark.dist


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(rank: int, index: int, bad: bool = False) -> torch.Tensor:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 100 + index))
    if bad:
        x[0, 0] = float("nan")
    return x


def _shard_state(model: nn.Module, zero: ZeroRedundancyOptimizer) -> list[float]:
    """Parameters, then this rank's own optimizer shard (moments and step counts), flat."""
    local = compat.zero_local_optimizer(zero)
    assert local is not None
    flat = [p.detach().reshape(-1) for p in model.parameters()]
    for p in model.parameters():
        for value in local.state.get(p, {}).values():
            flat.append(torch.as_tensor(value, dtype=torch.float32).reshape(-1))
    return torch.cat(flat).tolist()


def _zero_run(rank, policy, batches, fault=None):
    """Steps over ``batches`` (batch indices). ``fault``: ("data", rank, index): NaN in that batch;
    ("update", rank, index): that rank's shard update at that step writes a NaN into a parameter it owns."""
    model = _mlp()
    ddp = DDP(model)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    guard = None
    if policy is not None:
        guard = ng.Guard(ddp, zero, policy=policy, snapshot_every=2, rollback_skip_batches=0, module_stats=False)
    owners = compat.zero_owners(zero)
    assert owners is not None
    actions = []
    for index in batches:
        handle = None
        if fault is not None and fault[0] == "update" and fault[1:] == (rank, index):
            mine = next(p for p in model.parameters() if owners[id(p)] == rank)

            def spoil(*_, mine=mine):
                with torch.no_grad():
                    mine.view(-1)[0] = float("nan")

            handle = compat.zero_local_optimizer(zero).register_step_post_hook(spoil)
        x = _batch(rank, index, bad=fault is not None and fault == ("data", rank, index))

        def closure(x=x):
            zero.zero_grad(set_to_none=True)
            loss = ddp(x).pow(2).mean()
            loss.backward()
            return loss

        if guard is None:
            closure()
            zero.step()
        else:
            guard.step(closure)
            actions.append(guard.last_action)
        if handle is not None:
            handle.remove()
    d = guard.last_diagnosis if guard is not None else None
    diag = None if d is None else [d.cause, d.rank, d.ranks, d.step]
    params = [v for p in model.parameters() for v in p.detach().reshape(-1).tolist()]
    return {
        "state": _shard_state(model, zero),
        "params": params,
        "actions": actions,
        "diag": diag,
        "owners": sorted(set(owners.values())),
    }


def _zero_cases(rank, world):
    return {
        # Batch 2 is bad; the rollback's snapshot is the one after step 1 (snapshot_every=2).
        "ref_skip": _zero_run(rank, None, [0, 1, 3]),
        "skip_data0": _zero_run(rank, "skip", [0, 1, 2, 3], ("data", 0, 2)),
        "rollback_data1": _zero_run(rank, "rollback", [0, 1, 2, 3], ("data", 1, 2)),
        "ref_rollback": _zero_run(rank, None, [0, 1, 4]),
        # The update of step 2 goes bad on the owner; step 3's check sees it; rollback to step 1's snapshot.
        "rollback_update1": _zero_run(rank, "rollback", [0, 1, 2, 3, 4], ("update", 1, 2)),
        "auto_update0": _zero_run(rank, "auto", [0, 1, 2, 3, 4], ("update", 0, 2)),
    }


def test_zero_redundancy_optimizer_under_ddp(tmp_path) -> None:
    results = spawn_ranks(_zero_cases, timeout=240)
    for rank, r in enumerate(results):
        assert r["ref_skip"]["owners"] == [0, 1]  # each rank owns a shard
        # Skips and rollbacks of a bad batch leave parameters and this rank's shard as without that batch.
        assert r["skip_data0"]["state"] == r["ref_skip"]["state"], rank
        assert r["skip_data0"]["actions"] == ["step", "step", "skip", "step"]
        assert r["skip_data0"]["diag"] == ["data.nonfinite", 0, [0], 2]
        assert r["rollback_data1"]["state"] == r["ref_skip"]["state"], rank
        assert r["rollback_data1"]["actions"] == ["step", "step", "rollback", "step"]
        assert r["rollback_data1"]["diag"] == ["data.nonfinite", 1, [1], 2]
        # A bad shard update: named on its owner, rolled back to the same state on every rank.
        c = r["rollback_update1"]
        assert c["diag"] == ["optimizer.nonfinite_update", 1, [1], 2], (rank, c["diag"])
        assert c["actions"] == ["step", "step", "step", "rollback", "step"], c["actions"]
        assert c["state"] == r["ref_rollback"]["state"], rank
        a = r["auto_update0"]
        assert a["diag"][:3] == ["optimizer.nonfinite_update", 0, [0]], (rank, a["diag"])
        assert all(v == v for v in a["params"])  # finite again after the remedy
    for case in ("skip_data0", "rollback_data1", "rollback_update1", "auto_update0"):
        assert results[0][case]["params"] == results[1][case]["params"], case
        assert results[0][case]["actions"] == results[1][case]["actions"], case
