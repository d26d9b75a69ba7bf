"""The gradient norm the guard records under tensor parallel and a 2D mesh is ``clip_grad_norm_``'s."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nanguard as ng
from nanguard.zoo.spawn import spawn_ranks

pytestmark = pytest.mark.dist


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(16, 8)
        self.head = nn.Linear(8, 3)  # column-parallel under TP; in 2D not tensor parallel, sharded over dp only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(self.act(self.fc1(x))))


def _norms(rank, world, two_d):
    """The guard's recorded grad norm and ``clip_grad_norm_``'s returned norm, for 3 steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = _MLP()
    if two_d:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp, data_rank = mesh["tp"], mesh["dp"].get_local_rank()
    else:
        tp = mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        data_rank = 0  # every tensor-parallel rank sees the same batch
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}  # fc2's bias: Replicate on every tp rank
    if not two_d:  # clip_grad_norm_ takes no plain tensors among DTensors
        plan["head"] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model, tp, plan)
    if two_d:
        fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = ng.Guard(model, opt, module_stats=False)
    clipped = []
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(data_rank * 100 + step))

        def closure(x=x):
            opt.zero_grad(set_to_none=True)
            loss = model(x).pow(2).mean()
            loss.backward()
            clipped.append(_clip_norm(model))
            return loss

        guard.step(closure)
    return {"guard": [p.grad_norm for p in guard.history], "clip": clipped, "skipped": guard.skipped}


def _clip_norm(model: nn.Module) -> float:
    """``clip_grad_norm_``'s norm (max_norm inf: the gradients stay), per device mesh as torchtitan
    does (torch's takes one mesh at a time), combined over the meshes."""
    by_mesh: dict[object, list[nn.Parameter]] = {}
    for p in model.parameters():
        by_mesh.setdefault(p.device_mesh, []).append(p)
    squares = 0.0
    for params in by_mesh.values():
        norm = torch.nn.utils.clip_grad_norm_(params, math.inf)
        squares += float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm) ** 2
    return math.sqrt(squares)


@pytest.mark.parametrize(("two_d", "world"), [(False, 2), (True, 4)], ids=["tp2", "fsdp2xtp2"])
def test_the_recorded_grad_norm_counts_each_replicated_value_once(tmp_path, two_d, world) -> None:
    results = spawn_ranks(_norms, two_d, world=world, timeout=180)
    for r in results:
        assert r["skipped"] == 0 and len(r["guard"]) == len(r["clip"]) == 3, r
        for ours, theirs in zip(r["guard"], r["clip"], strict=True):
            assert ours == pytest.approx(theirs, rel=1e-5), r
    assert all(r["guard"] == results[0]["guard"] for r in results)  # agreed: the same on every rank
