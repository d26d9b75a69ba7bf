"""The configurations whose collectives and host reads the guard adds are counted (``_sync_count``).

Each configuration is a rank function ``fn(rank, world, steps)`` run under a gloo group: it builds the
same loop twice from the same seed, unguarded and guarded, runs ``WARMUP`` steps uncounted (the first
steps build buffers and agree on setup once), then counts ``steps`` healthy steps, and returns both
counts and a digest of this rank's final weights. ``run(names, rank, world, steps)`` runs several in one
spawn. Used by ``tests/test_sync_count.py`` and ``benchmarks/sync_count.py``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from _sync_count import as_on_gpu, counting

WARMUP = 2

# A built loop: the step to run (given its index) and the modules whose weights are compared.
Built = tuple[Callable[[int], None], list[nn.Module]]


def digest(modules: list[nn.Module]) -> str:
    """This rank's weights (its shards under FSDP, TP and ZeRO-3), bit for bit."""
    from nanguard.stats import local

    h = hashlib.sha256()
    for module in modules:
        for p in module.parameters():
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
            step, modules = build(guarded)
            for i in range(WARMUP):
                step(i)
            with counting() as counts:
                for i in range(WARMUP, WARMUP + steps):
                    step(i)
            key = "guarded" if guarded else "plain"
            out[key] = counts.as_dict()
            out[f"{key}_digest"] = digest(modules)
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

    import nanguard as ng

    def build(guarded: bool) -> Built:
        model = DDP(MLP())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guard = ng.Guard(model, opt) if guarded else None

        def closure(i: int) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            x, y = _batch(rank, i)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        def step(i: int) -> None:
            if guard is None:
                closure(i)
                opt.step()
            else:
                guard.step(lambda: closure(i))

        return step, [model]

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
        return step, [model]

    return compare(build, steps)


def deepspeed_zero(stage: int) -> Callable[[int, int, int], dict[str, Any]]:
    """A DeepSpeed engine (``tests/_deepspeed_ranks.py``'s MLP, fp32, AdamW, DeepSpeed's default clip at 1.0)
    at ZeRO ``stage``, its loop as written (``engine(x, y)``, ``engine.backward``, ``engine.step``), under
    ``DeepSpeedGuard``."""

    def config(rank: int, world: int, steps: int) -> dict[str, Any]:
        from _deepspeed_ranks import batch, engine_for, init
        from nanguard.integrations.deepspeed import DeepSpeedGuard

        init(rank)

        def build(guarded: bool) -> Built:
            engine = engine_for(stage, "fp32")
            guard = DeepSpeedGuard(engine, "skip") if guarded else None

            def step(i: int) -> None:
                x, y = batch(rank, i, "fp32")
                engine.backward(engine(x, y))
                engine.step()

            step.guard = guard  # type: ignore[attr-defined]  # kept alive with the loop
            return step, [engine.module]

        return compare(build, steps)

    return config


def titan(setup: str) -> Callable[[int, int, int], dict[str, Any]]:
    """torchtitan's shrunk llama3 (``nanguard/zoo/titan.py``: FSDP2 dp_shard=2 or TP=2), its chunked loss,
    containers and its own ``clip_grad_norm_``, as ``train_step`` runs them, under ``TitanGuard``."""

    def config(rank: int, world: int, steps: int) -> dict[str, Any]:
        from torchtitan.distributed import utils as dist_utils

        from nanguard.integrations.torchtitan import TitanGuard
        from nanguard.zoo.titan import SEQ, VOCAB
        from nanguard.zoo.titan import build as build_titan

        positions = torch.arange(SEQ).expand(2, SEQ)

        def build(guarded: bool) -> Built:
            parts = build_titan(setup)
            model, loss_fn, optimizers, schedulers = (
                parts[k] for k in ("model", "loss_fn", "optimizers", "lr_schedulers")
            )
            guard = TitanGuard([model], optimizers, schedulers, module_stats=False) if guarded else None
            loss_fn = guard.loss(loss_fn) if guard is not None else loss_fn

            def step(i: int) -> None:
                x = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(i * 10 + rank))
                optimizers.zero_grad()
                loss, _ = loss_fn(model(x[:, :-1], positions=positions), x[:, 1:], torch.tensor(2 * SEQ * world))
                loss.backward()
                dist_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
                optimizers.step()
                schedulers.step()

            step.guard = guard  # type: ignore[attr-defined]
            return step, [model]

        return compare(build, steps)

    return config


def megatron_dp(rank: int, world: int, steps: int) -> dict[str, Any]:
    """Megatron-core's tiny GPT under data parallelism alone (``tests/_megatron_ranks.py``: its DDP, its
    optimizer with ``clip_grad=1.0``, ``get_forward_backward_func``), under ``MegatronGuard``."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from _megatron_ranks import ROWS, SEQ, batch, forward_step, init
    from _megatron_ranks import build as build_megatron
    from nanguard.integrations.megatron import MegatronGuard

    init(1, 1)
    dp_rank = parallel_state.get_data_parallel_rank()

    def build(guarded: bool) -> Built:
        chunks, optimizer, _ = build_megatron({})
        guard = MegatronGuard(chunks, optimizer, module_stats=False) if guarded else None
        step_func = guard.forward_step(forward_step) if guard is not None else forward_step

        def step(i: int) -> None:
            for chunk in chunks:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            get_forward_backward_func()(
                forward_step_func=step_func,
                data_iterator=iter([batch(dp_rank, i, 0)]),
                model=chunks,
                num_microbatches=1,
                seq_length=SEQ,
                micro_batch_size=ROWS,
                decoder_seq_length=SEQ,
                forward_only=False,
            )
            optimizer.step()

        step.guard = guard  # type: ignore[attr-defined]
        return step, chunks

    return compare(build, steps)


CONFIGS: dict[str, Callable[[int, int, int], dict[str, Any]]] = {
    "ddp": ddp,
    "ddp_clip": ddp_clip,
    "deepspeed_zero2": deepspeed_zero(2),
    "deepspeed_zero3": deepspeed_zero(3),
    "titan_fsdp": titan("fsdp"),
    "titan_tp": titan("tp"),
    "megatron_dp": megatron_dp,  # last: its CUDA shim stays installed in the process
}


def run(rank: int, world: int, names: list[str], steps: int) -> dict[str, Any]:
    """Several configurations in one spawned group, in order (each builds its own loop)."""
    return {name: CONFIGS[name](rank, world, steps) for name in names}
