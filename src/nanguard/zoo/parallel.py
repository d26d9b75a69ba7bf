"""Guarded runs under tensor parallel (DTensor), a 2D mesh (FSDP2 over dp + TP over tp) and
pipeline parallel (``torch.distributed.pipelining``), with a fault on one rank.

The model is a Megatron-style MLP: ``up`` split by columns (``ColwiseParallel``), an activation
on each rank's column block, ``down`` split by rows (``RowwiseParallel``). Under pipeline
parallel each rank holds one stage of the same shape. One rank's fault, at ``fault_step``:

- ``"sqrt"``: the activation takes the square root of ``h - 10``, negative for every value
  this tiny model makes (an op-made NaN in that rank's column block or stage);
- ``"sqrt_grad"``: the activation takes the square root of ``0 * h``: finite forward, and
  the gradient of sqrt at zero makes the NaN in backward;
- ``"weight"``: a NaN lands in that rank's own shard of ``up.weight`` (a bad checkpoint);
- ``"input"``: the batch holds a NaN (pipeline: only the first stage reads it).

Used by ``tests/test_parallel.py`` and the distributed zoo scenarios; each rank calls
``parallel_rank`` under an initialized gloo process group.

Example:
    >>> spawn_ranks(parallel_rank, "tp", "sqrt", 0, "skip", world=2)[0]["diag"]["cause"]
    'op.sqrt_domain'
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanguard.errors import NonFiniteError
from nanguard.findings import Diagnosis
from nanguard.guard import Guard
from nanguard.stats import local

__all__ = ["SETUPS", "Activation", "ParallelMLP", "parallel_rank"]

SETUPS = ("tp", "2d", "pp")
FAULTS = ("sqrt", "sqrt_grad", "weight", "input", None)
_DIM, _HIDDEN, _ROWS = 8, 16, 4


class Activation(nn.Module):
    """GELU, or with ``negative`` set the square root of a value that went negative, or with
    ``zero`` set the square root of zeros (whose gradient is infinite)."""

    def __init__(self) -> None:
        super().__init__()
        self.negative = False
        self.zero = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.zero:
            return torch.sqrt(h * 0.0) + h
        return torch.sqrt(h - 10.0) if self.negative else F.gelu(h)


class ParallelMLP(nn.Module):
    """``down(act(up(x)))``: one tensor-parallel MLP, or one pipeline stage."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(_DIM, _HIDDEN)
        self.act = Activation()
        self.down = nn.Linear(_HIDDEN, _DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _tensor_parallel(model: ParallelMLP, mesh: Any) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def _build(setup: str, rank: int, world: int) -> tuple[ParallelMLP, Any, int]:
    """The model (this rank's part of it), the pipeline schedule (None but under ``pp``) and the
    index of this rank's data-parallel replica (the batch it reads)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0 if setup != "pp" else rank)  # TP ranks start from one full model
    model = ParallelMLP()
    if setup == "tp":
        _tensor_parallel(model, init_device_mesh("cpu", (world,)))
        return model, None, 0
    if setup == "2d":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        from torch.distributed.fsdp import fully_shard

        _tensor_parallel(model, mesh["tp"])
        fully_shard(model, mesh=mesh["dp"])
        coordinate = mesh.get_coordinate()
        assert coordinate is not None  # every rank of the run is in the mesh
        return model, None, coordinate[0]
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    stage = PipelineStage(model, rank, world, torch.device("cpu"))
    return model, ScheduleGPipe(stage, n_microbatches=2, loss_fn=_loss), 0


def _closure(
    setup: str, model: nn.Module, schedule: Any, opt: Any, x: torch.Tensor, y: torch.Tensor, rank: int, world: int
) -> Any:
    def closure() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        if schedule is None:
            loss = _loss(model(x), y)
            loss.backward()
            return loss
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        # Only the last stage has a loss; the others' health is their gradients'.
        return torch.stack(losses).mean().detach() if losses else torch.zeros(())

    return closure


def _digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(local(p).detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def parallel_rank(
    rank: int,
    world: int,
    setup: str,
    fault: str | None,
    fault_rank: int,
    policy: str | None,
    steps: int = 3,
    fault_step: int = 1,
) -> dict[str, Any]:
    """One rank's guarded run (``policy=None``: the same loop unguarded).

    Returns each step's action, the first diagnosis (a dict) with its step, the step that
    raised, whether the skipped step left the parameters bit-identical, and a digest of the
    final parameters (this rank's shards)."""
    if setup not in SETUPS:
        raise ValueError(f"setup must be one of {SETUPS}, got {setup!r}")
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
    model, schedule, replica = _build(setup, rank, world)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(model, opt, policy=policy, snapshot_every=1, fingerprint_every=0) if policy else _Unguarded(opt)
    record = _Record()
    for step in range(steps):
        x, y = _data(replica, step)
        _arm(model, fault, here=step == fault_step and rank == fault_rank)
        if step == fault_step and fault == "input":
            x[0, 0] = float("nan")
        before = _digest(model)
        try:
            guard.step(_closure(setup, model, schedule, opt, x, y, rank, world), batch={"x": x})
        except NonFiniteError as err:
            record.raised_at(step, err.diagnosis)
            break
        record.took(step, guard.last_action, guard.last_diagnosis)
        if guard.last_action == "skip" and step == fault_step:
            record.unchanged = _digest(model) == before
    finite = all(bool(torch.isfinite(local(p)).all()) for p in model.parameters())
    return {**asdict(record), "finite": finite, "digest": _digest(model)}


def _data(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's inputs and targets, the same on every rank of one data-parallel replica."""
    gen = torch.Generator().manual_seed(1000 * replica + step)
    return torch.randn(_ROWS, _DIM, generator=gen), torch.randn(_ROWS, _DIM, generator=gen)


def _arm(model: ParallelMLP, fault: str | None, *, here: bool) -> None:
    """The step's fault when it is ``here`` (this rank, the fault step): the activation's flags, reset on every
    other step, or a NaN in this rank's shard of ``up.weight``."""
    model.act.negative = here and fault == "sqrt"
    model.act.zero = here and fault == "sqrt_grad"
    if here and fault == "weight":
        with torch.no_grad():
            local(model.up.weight).view(-1)[0] = float("nan")


class _Unguarded:
    """The loop's own step where no guard is: the closure, then the optimizer."""

    last_action = "step"
    last_diagnosis: Diagnosis | None = None

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self, closure: Callable[[], torch.Tensor], batch: Any = None) -> None:
        closure()
        self.optimizer.step()


@dataclass
class _Record:
    """What one rank's run reports: each step's action, the first diagnosis and its step, the step that raised
    and whether the skipped fault step left the parameters bit-identical."""

    actions: list[str | None] = field(default_factory=list)
    diag: dict[str, Any] | None = None
    diag_step: int | None = None
    raised: int | None = None
    unchanged: bool | None = None

    def took(self, step: int, action: str | None, diagnosis: Diagnosis | None) -> None:
        self.actions.append(action)
        if self.diag is None and diagnosis is not None:
            self.diag, self.diag_step = diagnosis.to_dict(), step

    def raised_at(self, step: int, diagnosis: Diagnosis | None) -> None:
        self.actions.append("raise")
        self.raised = step
        self.diag, self.diag_step = (diagnosis.to_dict() if diagnosis else None), step
