"""The configurations whose collectives and host reads the guard adds are counted (``_sync_count``).

Each configuration is a rank function ``fn(rank, world, steps)`` run under a gloo group: it builds the
same loop twice from the same seed, unguarded and guarded, runs ``WARMUP`` steps uncounted (the first
steps build buffers and agree on setup once), then counts ``steps`` healthy steps, and returns both
counts and a digest of this rank's final weights. ``run(names, rank, world, steps)`` runs several in one
spawn. Used by ``tests/test_sync_count.py`` and ``benchmarks/sync_count.py``.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from _sync_count import Counts, as_on_gpu, counting

WARMUP = 2
WHERE = os.environ.get("SYNC_COUNT_WHERE") == "1"  # also record where each op was asked for (Counts.sites)
SHORT = 2  # a whole-run loop's short run (``differential``)

# A built loop: the step to run (given its index), and what gives the weights compared afterwards.
Built = tuple[Callable[[int], None], Callable[[], list[torch.Tensor]]]


def digest(weights: list[torch.Tensor]) -> str:
    """This rank's weights (its shards under FSDP, TP and ZeRO), bit for bit."""
    from nanguard.stats import local

    h = hashlib.sha256()
    for p in weights:
        t = local(p).detach().contiguous()
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def compare(build: Callable[[bool], Built], steps: int) -> dict[str, Any]:
    """``build(guarded)`` twice from the same seed: both counts over ``steps`` steps after the warmup,
    nanguard's norms summed as on a GPU (``as_on_gpu``)."""
    out: dict[str, Any] = {}
    with as_on_gpu():
        for guarded in (False, True):
            torch.manual_seed(0)
            step, weights = build(guarded)
            for i in range(WARMUP):
                step(i)
            with counting(WHERE) as counts:
                for i in range(WARMUP, WARMUP + steps):
                    step(i)
            key = "guarded" if guarded else "plain"
            out[key] = counts.as_dict()
            out[f"{key}_digest"] = digest(weights())
    return out


class MLP(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def _batch(rank: int, step: int, rows: int = 4, dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen)


def ddp(rank: int, world: int, steps: int) -> dict[str, Any]:
    """DDP (its C++ reducer, no comm hook of the loop's own), AdamW, ``Guard.step(closure)``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return compare(lambda guarded: _closure_loop(DDP(MLP()), rank, guarded), steps)


def ddp_fingerprint(rank: int, world: int, steps: int) -> dict[str, Any]:
    """DDP with ``fingerprint_every=1``: every step is a replica-fingerprint step (by default every 100th)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return compare(lambda guarded: _closure_loop(DDP(MLP()), rank, guarded, fingerprint_every=1), steps)


def ddp_check_batch(rank: int, world: int, steps: int) -> dict[str, Any]:
    """DDP with ``check_batch=True``: the batch checked, and agreed on, before the forward."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return compare(lambda guarded: _closure_loop(DDP(MLP()), rank, guarded, check_batch=True), steps)


def ddp_zero(rank: int, world: int, steps: int) -> dict[str, Any]:
    """DDP with ``ZeroRedundancyOptimizer`` (AdamW shards), ``Guard.step(closure)``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return compare(lambda guarded: _closure_loop(DDP(MLP()), rank, guarded, zero=True), steps)


def ddp_join(rank: int, world: int, steps: int) -> dict[str, Any]:
    """DDP inside an enabled ``ddp.join()`` with equal inputs (the steady state), ``Guard.step(closure)``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def build(guarded: bool) -> Built:
        model = DDP(MLP())
        join = model.join()
        join.__enter__()
        step, weights = _closure_loop(model, rank, guarded)

        def left() -> list[torch.Tensor]:
            join.__exit__(None, None, None)  # after the counted steps: every rank leaves together
            return weights()

        return step, left

    return compare(build, steps)


def ddp_clip(rank: int, world: int, steps: int) -> dict[str, Any]:
    """DDP with the loop's own ``clip_grad_norm_`` under ``LoopGuard`` (the loop unchanged)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from nanguard.integrations.loop import LoopGuard

    def build(guarded: bool) -> Built:
        model = DDP(MLP())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guard = LoopGuard(model, opt) if guarded else None

        def step(i: int) -> None:
            x, y = _batch(rank, i)
            nn.functional.mse_loss(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        step.guard = guard  # type: ignore[attr-defined]  # kept alive with the loop
        return step, lambda: list(model.parameters())

    return compare(build, steps)


def _minus(a: Counter[str], b: Counter[str]) -> Counter[str]:
    """``a - b`` keeping every difference (``Counter``'s minus drops the ones below one)."""
    out = Counter(a)
    out.subtract(b)
    return out


def differential(run: Callable[[bool, int], str], short: int, long: int) -> dict[str, Any]:
    """For loops that run whole (a trainer's ``train()``): ``run(guarded, steps)`` returns the final weights'
    digest; each run is counted whole at ``short`` and ``long`` steps, so the setup and the first steps cancel
    and ``steps = long - short``. Returned in ``compare``'s shape."""
    out: dict[str, Any] = {}
    with as_on_gpu():
        for guarded in (False, True):
            counted = []
            for steps in (short, long):
                torch.manual_seed(0)
                with counting(WHERE) as counts:
                    last = run(guarded, steps)
                counted.append(counts)
            key = "guarded" if guarded else "plain"
            short_run, long_run = counted
            sites = None if long_run.sites is None else long_run.sites - (short_run.sites or Counter())
            out[key] = Counts(
                _minus(long_run.collectives, short_run.collectives),
                _minus(long_run.host_reads, short_run.host_reads),
                _minus(long_run.elements, short_run.elements),
                sites,
            ).as_dict()
            out[f"{key}_digest"] = last
    return out


def _clip_loop(model: nn.Module, rank: int, guarded: bool, *, replica: int | None = None) -> Built:
    """The loop's own forward, backward, ``clip_grad_norm_`` and AdamW step; under ``LoopGuard`` when guarded."""
    from nanguard.integrations.loop import LoopGuard

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = LoopGuard(model, opt) if guarded else None
    data_rank = rank if replica is None else replica

    def step(i: int) -> None:
        x, y = _batch(data_rank, i)
        nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step.guard = guard  # type: ignore[attr-defined]  # kept alive with the loop
    return step, lambda: list(model.parameters())


def _closure_loop(
    model: nn.Module,
    rank: int,
    guarded: bool,
    *,
    replica: int | None = None,
    zero: bool = False,
    clip: bool = False,
    **options: Any,
) -> Built:
    """The loop as ``Guard.step(closure, batch=)``: ``clip``, the closure ends with ``clip_grad_norm_``;
    ``zero``, ``ZeroRedundancyOptimizer`` of AdamW; ``options``, the guard's."""
    import nanguard as ng

    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = ng.Guard(model, opt, **options) if guarded else None
    data_rank = rank if replica is None else replica

    def closure(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return loss

    def step(i: int) -> None:
        x, y = _batch(data_rank, i)
        if guard is None:
            closure(x, y)
            opt.step()
        else:
            guard.step(lambda: closure(x, y), batch={"x": x, "y": y})

    return step, lambda: list(model.parameters())


def _fsdp2(rank: int, world: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = MLP()
    fully_shard(model.up)
    fully_shard(model)
    return model


def _tp(rank: int, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = MLP()
    parallelize_module(model, init_device_mesh("cpu", (world,)), {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def _dp_tp(rank: int, world: int) -> tuple[nn.Module, int]:
    """FSDP2 over dp x TP over tp (2 x world/2); the dp replica index (the batch it reads)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    model = MLP()
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    return model, coordinate[0]


def fsdp2(rank: int, world: int, steps: int) -> dict[str, Any]:
    """FSDP2 (``fully_shard`` per block and the root), ``Guard.step(closure)``, no clip."""
    return compare(lambda guarded: _closure_loop(_fsdp2(rank, world), rank, guarded), steps)


def fsdp2_closure_clip(rank: int, world: int, steps: int) -> dict[str, Any]:
    """FSDP2, ``Guard.step(closure)`` whose closure clips (``clip_grad_norm_`` over every rank)."""
    return compare(lambda guarded: _closure_loop(_fsdp2(rank, world), rank, guarded, clip=True), steps)


def tp_closure_clip(rank: int, world: int, steps: int) -> dict[str, Any]:
    """Tensor parallel, ``Guard.step(closure)`` whose closure clips."""
    return compare(lambda guarded: _closure_loop(_tp(rank, world), 0, guarded, clip=True), steps)


def dp_tp_closure_clip(rank: int, world: int, steps: int) -> dict[str, Any]:
    """2D, ``Guard.step(closure)`` whose closure clips."""

    def build(guarded: bool) -> Built:
        model, replica = _dp_tp(rank, world)
        return _closure_loop(model, rank, guarded, replica=replica, clip=True)

    return compare(build, steps)


def ddp_skip_spikes(rank: int, world: int, steps: int) -> dict[str, Any]:
    """DDP with ``skip_spikes=True`` (it acts on the mean loss)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return compare(lambda guarded: _closure_loop(DDP(MLP()), rank, guarded, skip_spikes=True), steps)


def ddp_precursor(rank: int, world: int, steps: int) -> dict[str, Any]:
    """DDP with ``precursor_every=1``: every step samples the precursors (by default every 20th)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return compare(lambda guarded: _closure_loop(DDP(MLP()), rank, guarded, precursor_every=1), steps)


def fsdp2_clip(rank: int, world: int, steps: int) -> dict[str, Any]:
    """FSDP2 with the loop's ``clip_grad_norm_`` under ``LoopGuard``."""
    return compare(lambda guarded: _clip_loop(_fsdp2(rank, world), rank, guarded), steps)


def tp(rank: int, world: int, steps: int) -> dict[str, Any]:
    """Tensor parallel (DTensor Colwise/Rowwise over every rank), ``Guard.step(closure)``, no clip."""
    return compare(lambda guarded: _closure_loop(_tp(rank, world), 0, guarded), steps)


def tp_clip(rank: int, world: int, steps: int) -> dict[str, Any]:
    """Tensor parallel with the loop's ``clip_grad_norm_`` under ``LoopGuard``."""
    return compare(lambda guarded: _clip_loop(_tp(rank, world), 0, guarded), steps)


def dp_tp(rank: int, world: int, steps: int) -> dict[str, Any]:
    """2D: FSDP2 over dp x TP over tp, ``Guard.step(closure)``."""

    def build(guarded: bool) -> Built:
        model, replica = _dp_tp(rank, world)
        return _closure_loop(model, rank, guarded, replica=replica)

    return compare(build, steps)


def dp_tp_clip(rank: int, world: int, steps: int) -> dict[str, Any]:
    """2D with the loop's ``clip_grad_norm_`` under ``LoopGuard``."""

    def build(guarded: bool) -> Built:
        model, replica = _dp_tp(rank, world)
        return _clip_loop(model, rank, guarded, replica=replica)

    return compare(build, steps)


def pp(rank: int, world: int, steps: int) -> dict[str, Any]:
    """Pipeline parallel: one ``PipelineStage`` per rank, ``ScheduleGPipe`` over 2 micro-batches,
    ``Guard.step(closure)`` (the last stage returns the loss; the others a zero)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    import nanguard as ng

    def build(guarded: bool) -> Built:
        torch.manual_seed(rank)
        model = MLP()
        schedule = ScheduleGPipe(
            PipelineStage(model, rank, world, torch.device("cpu")),
            n_microbatches=2,
            loss_fn=nn.functional.mse_loss,
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guard = ng.Guard(model, opt) if guarded else None

        def closure(i: int) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            x, y = _batch(0, i)
            losses: list[torch.Tensor] = []
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
            return torch.stack(losses).mean().detach() if losses else torch.zeros(())

        def step(i: int) -> None:
            if guard is None:
                closure(i)
                opt.step()
            else:
                guard.step(lambda: closure(i))

        return step, lambda: list(model.parameters())

    return compare(build, steps)


def zero(stage: int) -> Callable[[int, int, int], dict[str, Any]]:
    """DeepSpeed ZeRO ``stage`` on its CPU accelerator (fp32, AdamW, ``gradient_clipping`` 1.0), the engine
    loop (``engine(x)``, ``engine.backward``, ``engine.step``) under ``DeepSpeedGuard``."""

    def config(rank: int, world: int, steps: int) -> dict[str, Any]:
        from _deepspeed_ranks import batch, engine_for, init
        from nanguard.integrations.deepspeed import DeepSpeedGuard, EngineState

        init(rank)

        def build(guarded: bool) -> Built:
            engine = engine_for(stage, "fp32", clip=1.0)
            guard = DeepSpeedGuard(engine, "skip") if guarded else None

            def step(i: int) -> None:
                x, y = batch(rank, i, "fp32")
                engine.backward(engine(x, y))
                engine.step()

            step.guard = guard  # type: ignore[attr-defined]
            return step, lambda: EngineState(engine).master_params()

        return compare(build, steps)

    return config


def titan(setup: str) -> Callable[[int, int, int], dict[str, Any]]:
    """torchtitan's own ``Trainer.train()`` ("fsdp", "tp" or "pp" on 2 ranks; ``nanguard.zoo.titan_trainer``),
    unguarded and with ``TitanGuard`` as ``docs/torchtitan.md`` shows."""

    def config(rank: int, world: int, steps: int) -> dict[str, Any]:
        from nanguard.zoo.titan_trainer import trainer_rank

        def run(guarded: bool, n: int) -> str:
            r = trainer_rank(rank, world, setup, None, 0, "skip" if guarded else None, steps=n)
            return str(r["digest"])

        return differential(run, SHORT, SHORT + steps)

    return config


def hf(rank: int, world: int, steps: int) -> dict[str, Any]:
    """The HF ``Trainer`` (tiny GPT-2, DDP over the gloo ranks, its clip at 1.0) with ``NanGuardCallback``."""
    import tempfile

    from _hf_ranks import run_trainer

    def run(guarded: bool, n: int) -> str:
        with tempfile.TemporaryDirectory() as out:
            r = run_trainer(rank, world, [{"how": "compute_loss_func", "steps": n, "guard": guarded}], out)
        return str(r[0]["weights"])

    return differential(run, SHORT, SHORT + steps)


def megatron(layout: str) -> Callable[[int, int, int], dict[str, Any]]:
    """Megatron-core's loop (``tests/_megatron_ranks.py``: its DDP, optimizer with its clip at 1.0, schedules)
    under ``MegatronGuard``: "dp" (with the DistributedOptimizer), "tp" or "pp" (1F1B, 2 micro-batches)."""
    case = {"dp": {"dist_opt": True}, "tp": {"tp": 2}, "pp": {"pp": 2, "micro": 2}}[layout]

    def config(rank: int, world: int, steps: int) -> dict[str, Any]:
        import hashlib

        from _megatron_ranks import init, train

        def run(guarded: bool, n: int) -> str:
            init(case.get("tp", 1), case.get("pp", 1))
            r = train({**case, "steps": n, "policy": "skip" if guarded else None}, rank)
            return hashlib.sha256(str(r["weights"]).encode()).hexdigest()[:16]

        return differential(run, SHORT, SHORT + steps)

    return config


def olmo(setup: str) -> Callable[[int, int, int], dict[str, Any]]:
    """OLMo-core's own ``Trainer`` ("ddp" or "fsdp"; ``nanguard.zoo.olmo``) with ``NanGuardCallback``."""

    def config(rank: int, world: int, steps: int) -> dict[str, Any]:
        from nanguard.zoo.olmo import olmo_rank

        def run(guarded: bool, n: int) -> str:
            return str(olmo_rank(rank, world, setup, None, 0, "skip" if guarded else None, steps=n)["digest"])

        return differential(run, SHORT, SHORT + steps)

    return config


CONFIGS: dict[str, Callable[[int, int, int], dict[str, Any]]] = {
    "ddp": ddp,
    "ddp_clip": ddp_clip,
    "ddp_fingerprint": ddp_fingerprint,
    "ddp_check_batch": ddp_check_batch,
    "ddp_skip_spikes": ddp_skip_spikes,
    "ddp_precursor": ddp_precursor,
    "ddp_zero": ddp_zero,
    "ddp_join": ddp_join,
    "fsdp2": fsdp2,
    "fsdp2_clip": fsdp2_clip,
    "fsdp2_closure_clip": fsdp2_closure_clip,
    "tp": tp,
    "tp_clip": tp_clip,
    "tp_closure_clip": tp_closure_clip,
    "2d": dp_tp,
    "2d_clip": dp_tp_clip,
    "2d_closure_clip": dp_tp_closure_clip,
    "pp": pp,
    **{f"zero{stage}": zero(stage) for stage in range(4)},
    **{f"titan_{setup}": titan(setup) for setup in ("fsdp", "tp", "pp")},
    "hf": hf,
    **{f"megatron_{layout}": megatron(layout) for layout in ("dp", "tp", "pp")},
    **{f"olmo_{setup}": olmo(setup) for setup in ("ddp", "fsdp")},
}


def run(rank: int, world: int, names: list[str], steps: int) -> dict[str, Any]:
    """Several configurations in one spawned group, in order (each builds its own loop)."""
    return {name: CONFIGS[name](rank, world, steps) for name in names}
