"""Distributed scenarios at the edges: a NaN in one rank's FSDP2 shard, a compression hook whose
cast overflows, a replica whose weight turned NaN behind DDP's back, a NaN made in one rank's
forward under a loop that toggles DDP's gradient sync itself, a NaN batch inside DDP's ``join()``
after another rank ran out of inputs, a ZeroRedundancyOptimizer shard update gone bad, and an op-made
NaN or a NaN weight on one rank under tensor parallel, a 2D mesh and pipeline parallel (``zoo/parallel.py``).

Each runs on spawned gloo ranks (``nanguard zoo --ranks 4``); ``edge_rank`` is one rank's run.
The expected fields follow from the fault: the rank and parameter it hits, and the phase
where the non-finite value is made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from nanguard.errors import NonFiniteError
from nanguard.findings import Diagnosis
from nanguard.guard import Guard
from nanguard.zoo.gpt import GPT
from nanguard.zoo.parallel import parallel_rank
from nanguard.zoo.scenario import Batch, Expect, Run, Scenario, build

__all__ = ["EDGE_FAULTS", "EDGE_SCENARIOS", "edge_rank"]


def _corrupt_image(model: GPT, batch: Batch) -> Batch:
    pixels = batch["pixel_values"].clone()
    pixels[2, 1, :5] = float("nan")  # a corrupt image, as the zoo's nan_pixels
    return {**batch, "pixel_values": pixels}


_WEIGHT = "blocks.1.mlp.fc"

EDGE_SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "fsdp2_shard_nan",
        "4 ranks under FSDP2; rank 2 writes a NaN into its own shard of blocks.1.mlp.fc.weight",
        Expect("parameters.nonfinite", None, _WEIGHT, "parameters", "nan", rank=2),
        ranks=4,
        dist_fault="shard",
    ),
    Scenario(
        "fp16_compress_overflow",
        "2 ranks under DDP with fp16_compress_hook; rank 0's blocks.1.mlp.fc.weight gradient is x1e9, "
        "finite in float32 but past float16's 65504",
        Expect("precision.overflow", "fp16_compress_hook", _WEIGHT, "communication", "inf", rank=0),
        ranks=2,
        dist_fault="wire",
    ),
    Scenario(
        "nan_replica_resync",
        "2 ranks under DDP; rank 0's copy of blocks.1.mlp.fc.weight turns NaN behind DDP's back: "
        "the resync must copy rank 1's finite weights",
        Expect("distributed.replica_divergence", None, _WEIGHT, "parameters", "nan", rank=0),
        ranks=2,
        dist_fault="nan_replica",
    ),
    Scenario(
        "ddp_join_uneven_nan",
        "2 ranks under DDP join() with uneven inputs (the DDP uneven-inputs tutorial's setup): rank 1 runs "
        "out after 2 batches; at step 3 rank 0's image batch holds NaN pixels, while rank 1 only shadows",
        Expect("data.nonfinite", None, "vis_proj", "data", "nan", rank=0, ranks=(0,)),
        config={"vision_dim": 16},
        fault=_corrupt_image,
        ranks=2,
        dist_fault="join",
    ),
    Scenario(
        "zero_shard_update_nan",
        "2 ranks under DDP with ZeroRedundancyOptimizer(AdamW); at step 3 the update of rank 1's own shard "
        "writes a NaN into a parameter rank 1 owns, which ZeRO then broadcasts to every rank",
        Expect("optimizer.nonfinite_update", None, None, "optimizer", "nan", rank=1, ranks=(1,)),
        ranks=2,
        dist_fault="zero",
    ),
    Scenario(
        "tp_sqrt_column_block",
        "2 ranks, tensor parallel MLP (ColwiseParallel up, RowwiseParallel down): the activation of rank 0's "
        "column block takes the sqrt of a negative (a one-pass variance gone negative; Fast-LLM#59 saw "
        "tensor-parallel NaNs made on some ranks only); the all-reduce carries it to rank 1",
        Expect("op.sqrt_domain", "aten.sqrt.default", "act", "forward", "nan", rank=0, ranks=(0,)),
        ranks=2,
        dist_fault="tp_sqrt",
        fault_step=1,
        steps=3,
    ),
    Scenario(
        "2d_sqrt_middle_rank",
        "4 ranks, FSDP2 over dp x tensor parallel over tp: the activation of rank 2 (dp 1, tp 0) takes the "
        "sqrt of a negative; its tp peer gets it through the all-reduce, FSDP2 all-gathers around it",
        Expect("op.sqrt_domain", "aten.sqrt.default", "act", "forward", "nan", rank=2, ranks=(2,)),
        ranks=4,
        dist_fault="2d_sqrt",
        fault_step=1,
        steps=3,
    ),
    Scenario(
        "pp_nan_weight_stage0",
        "2 pipeline stages (ScheduleGPipe, 2 microbatches): stage 0's up.weight holds a NaN (a corrupt "
        "checkpoint shard; NeMo#5928 saw NaN losses only with pipeline parallel on); the last stage only "
        "receives NaN activations",
        Expect("parameters.nonfinite", None, "up", "parameters", "nan", rank=0, ranks=(0,)),
        ranks=2,
        dist_fault="pp_weight",
        fault_step=1,
        steps=3,
    ),
)
EDGE_SCENARIOS += (
    Scenario(
        "ddp_sync_toggle_forward_nan",
        "2 ranks under DDP, nanoGPT's accumulation: the closure sets require_backward_grad_sync itself "
        "over 2 micro-batches; on rank 1 a forward hook of blocks.1.mlp.fc takes the log of negative values",
        Expect("op.log_domain", "aten.log.default", _WEIGHT, "forward", "nan", rank=1, ranks=(1,)),
        ranks=2,
        dist_fault="toggle",
    ),
)
EDGE_FAULTS = frozenset(s.dist_fault for s in EDGE_SCENARIOS)
_JOIN_BATCHES = (None, 2)  # rank 1 has 2 batches; rank 0 runs the whole scenario

_Outcome = tuple[Diagnosis | None, int | None]


def edge_rank(s: Scenario, rank: int, seed: int) -> _Outcome:
    """One rank of an edge scenario: the first diagnosis and the step it came at."""
    return _RUNS[s.dist_fault](s, rank, seed)


def _parallel_run(setup: str, fault: str, fault_rank: int, s: Scenario, rank: int, seed: int) -> _Outcome:
    """A ``zoo.parallel`` run (tensor parallel, a 2D mesh or pipeline parallel) with its fault on ``fault_rank``."""
    world = torch.distributed.get_world_size()
    out = parallel_rank(rank, world, setup, fault, fault_rank, "skip", steps=s.run_steps, fault_step=s.fault_step)
    return (Diagnosis.from_dict(out["diag"]) if out["diag"] else None), out["diag_step"]


@dataclass
class _Wrapped:
    """The tiny GPT wrapped for its ranks, its optimizer and guard, and the weight the faults reach."""

    model: GPT
    net: torch.nn.Module
    optimizer: torch.optim.Optimizer
    guard: Guard
    weight: Any  # blocks.1.mlp.fc.weight: a DTensor once sharded


def _fsdp2(s: Scenario, run: Run) -> _Wrapped:
    from torch.distributed.fsdp import fully_shard

    model = run.model
    for block in model.blocks:
        fully_shard(block)
    net: torch.nn.Module = fully_shard(model)  # type: ignore[assignment]  # FSDPModule: a Module at run time
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr)
    guard = Guard(net, optimizer, policy="skip", max_consecutive_skips=10**6)
    return _Wrapped(model, net, optimizer, guard, model.blocks[1].mlp.fc.weight)


def _ddp(s: Scenario, run: Run) -> _Wrapped:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel

    net = DistributedDataParallel(run.model)
    hook = (None, fp16_compress_hook) if s.dist_fault == "wire" else None
    guard = Guard(
        net,
        run.optimizer,
        policy="skip",
        comm_hook=hook,
        max_consecutive_skips=10**6,
        fingerprint_every=1 if s.dist_fault == "nan_replica" else 100,
    )
    return _Wrapped(run.model, net, run.optimizer, guard, run.model.blocks[1].mlp.fc.weight)


def _nan_in_own_shard(w: _Wrapped) -> None:
    with torch.no_grad():
        w.weight.to_local().view(-1)[0] = float("nan")


def _gradient_times_1e9(w: _Wrapped) -> Any:
    return w.weight.register_hook(lambda g: g * 1e9)  # through the step and its replay


def _update_turns_nan(w: _Wrapped) -> Any:
    # The update itself goes bad on this rank only, just before the fingerprint check.
    return w.optimizer.register_step_post_hook(lambda *_: _spoil(w.weight))


def _forward_log_of_negative(w: _Wrapped) -> Any:
    return w.model.blocks[1].mlp.fc.register_forward_hook(_log_of_negative)


def _wrapped_run(plant: Callable[[_Wrapped], Any], fault_rank: int, s: Scenario, rank: int, seed: int) -> _Outcome:
    """The tiny GPT under FSDP2 (``shard``) or DDP; at the fault step ``plant`` runs on ``fault_rank``
    (a hook it returns is removed after that step)."""
    run = build(s, seed, rank=rank)
    w = (_fsdp2 if s.dist_fault == "shard" else _ddp)(s, run)
    run.optimizer = w.optimizer
    for step in range(s.run_steps):
        handle = plant(w) if step == s.fault_step and rank == fault_rank else None
        closure, batch = _step_inputs(s, run, w.net, w.optimizer, step)
        try:
            w.guard.step(closure, batch=batch)
        except NonFiniteError as err:  # what a skip cannot repair escalates at once
            return err.diagnosis, step
        if handle is not None:
            handle.remove()
        if w.guard.last_diagnosis is not None:
            return w.guard.last_diagnosis, step
    return None, None


def _step_inputs(
    s: Scenario, run: Run, net: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int
) -> tuple[Callable[[], torch.Tensor], Any]:
    """The step's closure and batch, or under ``toggle`` the closure over its 2 micro-batches and them."""
    if s.dist_fault == "toggle":
        micro = [run.batch(2 * step + m, faulty=False) for m in range(2)]
        return _toggling_closure(net, optimizer, micro), micro
    batch = run.batch(step, faulty=False)
    return run.closure(batch, net), batch


def _toggling_closure(net: Any, optimizer: torch.optim.Optimizer, micro: list[Any]) -> Any:
    """nanoGPT's micro-step loop: gradient sync on the last micro-batch only, set by hand."""

    def closure() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(micro):
            net.require_backward_grad_sync = i == len(micro) - 1
            _, loss = net(**batch)
            (loss / len(micro)).backward()
        return loss

    return closure


def _log_of_negative(module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    return torch.log(out - out.detach().abs().max() - 1.0)  # every value negative: NaN made here


def _spoil(weight: torch.Tensor) -> None:
    with torch.no_grad():
        weight.view(-1)[0] = float("nan")


def _join_rank(s: Scenario, rank: int, seed: int) -> _Outcome:
    """Uneven inputs inside ``ddp.join()``; the joined rank learns the diagnosis while it shadows."""
    from torch.nn.parallel import DistributedDataParallel

    run = build(s, seed, rank=rank)
    net = DistributedDataParallel(run.model)
    guard = Guard(net, run.optimizer, policy="skip", max_consecutive_skips=10**6, module_stats=False)
    steps = _JOIN_BATCHES[rank] or s.run_steps
    with net.join():
        for step in range(steps):
            batch = run.batch(step, faulty=rank == 0)
            guard.step(run.closure(batch, net), batch=batch)
    diag = guard.last_diagnosis
    return diag, diag.step if diag is not None else None


def _zero_rank(s: Scenario, rank: int, seed: int) -> _Outcome:
    """ZeRO under DDP: rank 1's local optimizer spoils one parameter it owns after its update of the fault step."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from nanguard import compat

    run = build(s, seed, rank=rank)
    net = DistributedDataParallel(run.model)
    zero = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=s.lr)
    run.optimizer = zero
    guard = Guard(net, zero, policy="rollback", snapshot_every=1, max_consecutive_skips=10**6, module_stats=False)
    owners = compat.zero_owners(zero) or {}
    local = compat.zero_local_optimizer(zero)
    assert local is not None
    mine = [p for p in run.model.parameters() if owners.get(id(p)) == rank]
    for step in range(s.run_steps):
        handle: Any = None
        if step == s.fault_step and rank == 1 and mine:
            handle = local.register_step_post_hook(lambda *_: _spoil(mine[-1]))
        batch = run.batch(step, faulty=False)
        guard.step(run.closure(batch, net), batch=batch)
        if handle is not None:
            handle.remove()
        if guard.last_diagnosis is not None:
            return guard.last_diagnosis, step
    return None, None


# dist_fault -> one rank's run: the rank a fault hits and what it does there, or a whole run of its own.
_RUNS: dict[str | None, Callable[[Scenario, int, int], _Outcome]] = {
    "shard": partial(_wrapped_run, _nan_in_own_shard, 2),
    "wire": partial(_wrapped_run, _gradient_times_1e9, 0),
    "nan_replica": partial(_wrapped_run, _update_turns_nan, 0),
    "toggle": partial(_wrapped_run, _forward_log_of_negative, 1),
    "join": _join_rank,
    "zero": _zero_rank,
    "tp_sqrt": partial(_parallel_run, "tp", "sqrt", 0),
    "2d_sqrt": partial(_parallel_run, "2d", "sqrt", 2),
    "pp_weight": partial(_parallel_run, "pp", "weight", 0),
}
