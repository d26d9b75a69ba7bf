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


CONFIGS: dict[str, Callable[[int, int, int], dict[str, Any]]] = {
    "ddp": ddp,
    "ddp_clip": ddp_clip,
}


def run(rank: int, world: int, names: list[str], steps: int) -> dict[str, Any]:
    """Several configurations in one spawned group, in order (each builds its own loop)."""
    return {name: CONFIGS[name](rank, world, steps) for name in names}
