"""Guard overhead by parallelism at 2 and 8 gloo ranks (CPU): DDP, DDP inside join(), DDP with
ZeroRedundancyOptimizer, FSDP2 and tensor parallel, each against the same unguarded loop, interleaved.

Writes the ``overhead-parallelisms`` section of BENCHMARKS.md; with ``--setups`` naming fewer, the
``overhead-ddp-world`` section (DDP as the world grows: no collective added at any size).

    .venv/bin/python benchmarks/dist_overhead.py --ranks 2 8 --rounds 60
    .venv/bin/python benchmarks/dist_overhead.py --setups DDP --ranks 2 3 4 8 --rounds 40
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import nanguard as ng
from _common import interleaved, machine, write_section
from nanguard.zoo import GPT, GPTConfig, synthetic_batch

SETUPS = ("DDP", "DDP join()", "DDP + ZeRO", "FSDP2", "TP")
CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=128)


class _MLP(nn.Module):
    """The tensor-parallel model: two column/row-parallel pairs and a column-parallel head."""

    def __init__(self) -> None:
        super().__init__()
        self.up1, self.down1 = nn.Linear(32, 128), nn.Linear(128, 32)
        self.up2, self.down2 = nn.Linear(32, 128), nn.Linear(128, 32)
        self.head = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down1(torch.relu(self.up1(x)))
        x = x + self.down2(torch.relu(self.up2(x)))
        return self.head(x)


def _wrap(setup: str, world: int) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, Callable[[int], Any]]:
    """(inner model, wrapped model, optimizer, batch of step i) for one setup, fresh and seeded."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    if setup == "TP":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mlp = _MLP()
        mesh = init_device_mesh("cpu", (world,))
        plan = {
            "up1": ColwiseParallel(),
            "down1": RowwiseParallel(),
            "up2": ColwiseParallel(),
            "down2": RowwiseParallel(),
            "head": ColwiseParallel(output_layouts=Replicate()),
        }
        parallelize_module(mlp, mesh, plan)
        xs = [torch.randn(8, 16, 32, generator=torch.Generator().manual_seed(i)) for i in range(8)]
        return mlp, mlp, torch.optim.AdamW(mlp.parameters(), lr=1e-4), lambda i: {"x": xs[i % 8]}
    model = GPT(CONFIG)
    pool = [synthetic_batch(CONFIG, torch.Generator().manual_seed(rank * 100 + i)) for i in range(8)]
    if setup == "FSDP2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model, model, torch.optim.AdamW(model.parameters(), lr=1e-4), lambda i: pool[i % 8]
    ddp = DDP(model)
    if setup == "DDP + ZeRO":
        opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4
        )
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    return model, ddp, opt, lambda i: pool[i % 8]


def _loss(setup: str, net: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    if setup == "TP":
        return net(batch["x"]).pow(2).mean()
    _, loss = net(**batch)
    return loss


def rank_times(rank: int, world: int, setup: str, rounds: int) -> dict[str, float]:
    """One rank: the unguarded loop and the guarded one of ``setup``, interleaved."""
    torch.set_num_threads(1)
    steps: dict[str, Callable[[], None]] = {}
    joins: list[Any] = []
    for guarded in (False, True):
        _, net, opt, batch_of = _wrap(setup, world)
        guard = ng.Guard(net, opt, module_stats=False) if guarded else None
        if setup == "DDP join()":
            joins.append(net.join())
        counter = itertools.count()

        def step(net=net, opt=opt, guard=guard, batch_of=batch_of, counter=counter) -> None:
            batch = batch_of(next(counter))

            def closure() -> torch.Tensor:
                opt.zero_grad(set_to_none=True)
                loss = _loss(setup, net, batch)
                loss.backward()
                return loss

            if guard is None:
                closure()
                opt.step()
            else:
                guard.step(closure)

        steps["guarded" if guarded else "plain"] = step
    with _entered(joins):
        return interleaved(steps, rounds=rounds)


@contextlib.contextmanager
def _entered(contexts: list[Any]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


def section(worlds: list[int], rounds: int, setups: tuple[str, ...] = SETUPS) -> str:
    from nanguard.zoo.spawn import spawn_ranks

    load = os.getloadavg()[0]
    picked = "" if setups == SETUPS else f"--setups {' '.join(setups)} "
    command = f"{picked}--ranks {' '.join(map(str, worlds))} --rounds {rounds}"
    rows = []
    for setup in setups:
        cells = []
        for world in worlds:
            t = spawn_ranks(rank_times, setup, rounds, world=world, timeout=1800)[0]
            cells.append(f"{t['plain'] * 1e3:.1f} | {t['guarded'] * 1e3:.1f} | {t['guarded'] / t['plain']:.3f}x")
        rows.append(f"| {setup} | " + " | ".join(cells) + " |")
    head = " | ".join(f"{w} ranks: plain ms | guarded ms | ratio" for w in worlds)
    rule = "|---|" + "---:|---:|---:|" * len(worlds)
    what = "by parallelism" if setups == SETUPS else f"of {', '.join(setups)} by world size"
    conditions = (
        f"Unguarded and guarded loops side by side, {rounds} interleaved rounds, "
        f"median step (rank 0), load average {load:.2f} at the start:"
    )
    return f"""## Guard overhead {what} (gloo, CPU, {", ".join(map(str, worlds))} ranks)

{conditions}

| setup | {head} |
{rule}
{chr(10).join(rows)}

Each setup runs the same unguarded loop and the guarded one (`Guard(..., module_stats=False)`, defaults
otherwise) side by side in one run; the times are as seen by rank 0.
Models: the zoo's tiny GPT (2 layers, d=32) for DDP, join(), ZeRO and FSDP2 (one FSDP2 unit per block);
a 5-layer MLP (d=32, hidden 128) column/row-parallel over all ranks for TP. All ranks share this
machine's {os.cpu_count()} cores (one intra-op thread each), so at 8 ranks a step is mostly waiting
for a core: the ratios, not the times, are the result. DDP join() runs inside an enabled `ddp.join()`
with equal inputs (the steady state; a joined rank only shadows).
{machine()}. Reproduce: `.venv/bin/python benchmarks/dist_overhead.py {command}`.

Collectives per healthy step under `guard.step`: DDP and DDP + ZeRO none added at any world size (on 2
ranks the flags, the loss and each rank's step index ride in the last gradient bucket's all-reduce,
`2 x world_size + 2` float32; on 3 or more a rank that flags writes a NaN into that bucket, so a healthy
step sends the buckets bit for bit as without the guard); DDP join() none on 2 ranks, on 3 or more one
all-reduce of `2 x world_size + 2` floats beside the last bucket's (a joined rank's shadow cannot foresee
a NaN); FSDP2 and TP one all-reduce of `2 x world_size + 2` float32."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    args = parser.parse_args()
    setups = tuple(args.setups)
    body = section(args.ranks, args.rounds, setups)
    write_section("overhead-parallelisms" if setups == SETUPS else "overhead-ddp-world", body)
    print(body)


if __name__ == "__main__":
    main()
