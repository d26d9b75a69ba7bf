"""Tensor parallel (DTensor), a 2D mesh (FSDP2 + TP) and pipeline parallel under the guard, on
spawned gloo ranks; and ``ng.locate`` on a DTensor model in one process (a 1-rank mesh).

The fault lands on one rank only, rank 0 or a middle rank, never only the last. Every rank must
take the same action on the same step and name the rank whose own compute made the value.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as tdist
from torch import nn

import nanguard as ng
from nanguard.zoo.parallel import ParallelMLP, parallel_rank
from nanguard.zoo.spawn import spawn_ranks

pytestmark = pytest.mark.dist

_FIELDS = ("cause", "op", "module", "phase", "rank", "ranks", "step")


def _cases(rank: int, world: int, setup: str, cases: list[tuple]) -> list[dict]:
    return [parallel_rank(rank, world, setup, *case) for case in cases]


def _counted(rank: int, world: int, setup: str, steps: int) -> dict[str, int]:
    """Collectives a healthy run issues, unguarded and guarded (counted at the dispatcher: DTensor's
    functional collectives and FSDP2's too)."""
    from _sync_count import counting

    counts = {}
    for policy in (None, "skip"):
        with counting() as counted:
            parallel_rank(rank, world, setup, None, 0, policy, steps=steps)
        counts[str(policy)] = counted.n_collectives
    return counts


def _summary(result: dict) -> dict:
    d = result["diag"]
    return {k: d[k] for k in _FIELDS} if d is not None else {}


def _check(results: list[list[dict]], cases: list[tuple], expected: list[dict]) -> None:
    """Per case: every rank took the same actions and agrees on the diagnosis, which is ``expected``."""
    for i, (case, want) in enumerate(zip(cases, expected, strict=True)):
        per_rank = [r[i] for r in results]
        policy = case[2]
        assert all(r["actions"] == per_rank[0]["actions"] for r in per_rank), (case, per_rank)
        assert all(_summary(r) == _summary(per_rank[0]) for r in per_rank), (case, [_summary(r) for r in per_rank])
        assert _summary(per_rank[0]) == {**want, "step": 1}, case
        if want["cause"] == "parameters.nonfinite" and policy == "skip":
            assert all(r["raised"] == 1 for r in per_rank), case  # a NaN weight cannot be skipped
        elif policy == "skip":
            assert per_rank[0]["actions"] == ["step", "skip", "step"], case
            assert all(r["unchanged"] for r in per_rank), case  # parameters bit-identical
        else:
            assert per_rank[0]["actions"] == ["step", "rollback", "drop_batch"], case
            assert all(r["finite"] for r in per_rank), case


def _op(rank: int, ranks: list[int] | None = None) -> dict:
    return {
        "cause": "op.sqrt_domain",
        "op": "aten.sqrt.default",
        "module": "act",
        "phase": "forward",
        "rank": rank,
        "ranks": ranks or [rank],
    }


def _grad(rank: int) -> dict:
    """The gradient of sqrt at zero: the division in SqrtBackward, attributed to the module that ran sqrt."""
    return {
        "cause": "op.sqrt_domain",
        "op": "aten.div.Tensor",
        "module": "act",
        "phase": "backward",
        "rank": rank,
        "ranks": [rank],
    }


def _weight(rank: int) -> dict:
    return {
        "cause": "parameters.nonfinite",
        "op": None,
        "module": "up",
        "phase": "parameters",
        "rank": rank,
        "ranks": [rank],
    }


def test_tensor_parallel_names_the_rank_whose_column_block_made_the_nan(tmp_path) -> None:
    cases = [
        ("sqrt", 0, "skip"),
        ("sqrt", 1, "rollback"),
        ("weight", 0, "skip"),
        ("weight", 1, "rollback"),
        ("sqrt_grad", 0, "rollback"),
        (None, 0, "skip"),
        (None, 0, None),
    ]
    results = spawn_ranks(_cases, "tp", cases, world=2, timeout=240)
    _check(results, cases[:5], [_op(0), _op(1), _weight(0), _weight(1), _grad(0)])
    for r in results:  # healthy: guarded bit-identical to unguarded, no trip
        assert r[5]["diag"] is None and r[5]["actions"] == ["step"] * 3
        assert r[5]["digest"] == r[6]["digest"]


def test_2d_mesh_names_the_activation_and_the_rank_across_both_mesh_dims(tmp_path) -> None:
    cases = [
        ("sqrt", 0, "skip"),
        ("sqrt", 2, "rollback"),
        ("sqrt", 1, "skip"),
        ("weight", 2, "skip"),
        (None, 0, "skip"),
        (None, 0, None),
    ]
    results = spawn_ranks(_cases, "2d", cases, world=4, timeout=300)
    _check(results, cases[:4], [_op(0), _op(2), _op(1), _weight(2)])
    for r in results:
        assert r[4]["diag"] is None and r[4]["digest"] == r[5]["digest"]


def test_pipeline_names_the_stage_that_created_the_value(tmp_path) -> None:
    cases = [
        ("sqrt", 0, "skip"),
        ("sqrt", 1, "rollback"),
        ("weight", 0, "skip"),
        ("weight", 1, "rollback"),
        ("input", 0, "skip"),
        ("sqrt_grad", 1, "skip"),
        (None, 0, "skip"),
        (None, 0, None),
    ]
    results = spawn_ranks(_cases, "pp", cases, world=3, timeout=300)
    # The batch is split into microbatches outside any module: named after the first module that reads it.
    data = {"cause": "data.nonfinite", "op": None, "module": "up", "phase": "data", "rank": 0, "ranks": [0]}
    _check(results, cases[:6], [_op(0), _op(1), _weight(0), _weight(1), data, _grad(1)])
    for i, stage in enumerate((0, 1, 0, 1, 0, 1)):
        assert results[0][i]["diag"]["evidence"]["stage"]["index"] == stage
    # Stage 0 made it in forward; stage 1 received finite gradients and sent non-finite ones.
    assert results[0][0]["diag"]["evidence"]["stage"]["created"] == "forward"
    assert results[0][5]["diag"]["evidence"]["stage"]["created"] == "backward"
    for r in results:
        assert r[6]["diag"] is None and r[6]["digest"] == r[7]["digest"]


@pytest.mark.parametrize(("setup", "world"), [("tp", 2), ("2d", 4), ("pp", 2)])
def test_a_healthy_step_adds_one_small_all_reduce(tmp_path, setup, world) -> None:
    steps = 3
    for r in spawn_ranks(_counted, setup, steps, world=world, timeout=240):
        assert (r["skip"] - r["None"]) == steps, r


def _locate_tp(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = ParallelMLP()
    parallelize_module(model, init_device_mesh("cpu", (world,)), {"up": ColwiseParallel(), "down": RowwiseParallel()})
    model.act.negative = rank == 0
    x, y = torch.randn(4, 8), torch.randn(4, 8)

    def closure():
        model.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss

    return ng.locate(closure, model=model).to_dict()


def test_locate_under_tensor_parallel_agrees_on_the_creating_rank(tmp_path) -> None:
    for d in spawn_ranks(_locate_tp, world=2, timeout=120):
        assert {k: d[k] for k in _FIELDS[:-1]} == _op(0)
        assert d["evidence"]["per_rank_causes"]["0"] == "op.sqrt_domain"


@contextlib.contextmanager
def _one_rank(tmp_path) -> Iterator[object]:
    from torch.distributed.device_mesh import init_device_mesh

    tdist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        tdist.destroy_process_group()


class _Crossing(nn.Module):
    """A sqrt of a negative on a local tensor, carried through DTensor ops and back."""

    def __init__(self, mesh) -> None:
        super().__init__()
        self.mesh = mesh
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial, Replicate

        h = torch.sqrt(self.proj(x) - 10.0)
        partial = DTensor.from_local(h, self.mesh, [Partial()])
        return (partial.redistribute(self.mesh, [Replicate()]) * 2.0).to_local().sum()


def test_locate_on_a_one_rank_mesh_follows_taint_through_dtensor(tmp_path) -> None:
    with _one_rank(tmp_path) as mesh:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        model = ParallelMLP()
        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        model.act.negative = True
        x = torch.randn(4, 8)
        diag = ng.locate(lambda: model(x).sum().backward(), model=model)
        assert (diag.cause, diag.op, diag.module, diag.phase, diag.rank) == (
            "op.sqrt_domain",
            "aten.sqrt.default",
            "act",
            "forward",
            0,
        )
        crossing = _Crossing(mesh)
        diag = ng.locate(lambda: crossing(torch.randn(2, 4)), model=crossing)
        assert (diag.cause, diag.op, diag.module) == ("op.sqrt_domain", "aten.sqrt.default", "")
