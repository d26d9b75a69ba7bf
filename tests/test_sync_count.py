"""What the guard adds per healthy step, counted: collectives and host reads, guarded minus unguarded.

The same loop runs twice from the same seed on spawned gloo ranks, unguarded and guarded, and
``_sync_count.counting()`` counts every c10d and functional collective (from Python or C++: DDP's
reducer, FSDP2, DTensor) and every host read of the counted steps (``_sync_configs.py``). The
per-step differences must equal ``ADDED``, the one table of what the design costs today: a change that
adds a collective or a read fails here, and one that removes one changes its number here. The final
weights must be bit-identical. ``benchmarks/sync_count.py`` runs every configuration into BENCHMARKS.md.
"""

from __future__ import annotations

from typing import Any

import pytest

from _sync_configs import run
from _sync_count import added
from nanguard.zoo.spawn import spawn_ranks

pytestmark = pytest.mark.dist

STEPS = 3

# (configuration, world) -> (collectives, host reads) the guard adds per healthy step, as the code does
# today. Host reads are counted as a GPU run pays them (nanguard's norms summed in float64, no read).
ADDED: dict[tuple[str, int], tuple[float, float]] = {
    ("ddp", 2): (0, 1),  # the flags and the loss ride in DDP's last gradient bucket
    ("ddp", 3): (0, 1),  # at 3+ ranks: a flagging rank's NaN in its last bucket (none on a healthy step)
    ("ddp", 4): (0, 1),
    ("ddp_clip", 2): (1, 1),  # LoopGuard checks after the loop's backward: its one small all-reduce
}

# One spawn per world size runs every configuration of that size.
WORLDS = sorted({world for _, world in ADDED})


@pytest.fixture(scope="module")
def counted() -> dict[int, list[dict[str, Any]]]:
    out = {}
    for world in WORLDS:
        names = [name for name, w in ADDED if w == world]
        out[world] = spawn_ranks(run, names, STEPS, world=world, timeout=300)
    return out


@pytest.mark.parametrize(("name", "world"), sorted(ADDED))
def test_the_guard_adds_what_the_table_says(counted: dict[int, list[dict[str, Any]]], name: str, world: int) -> None:
    per_rank = [r[name] for r in counted[world]]
    for rank, r in enumerate(per_rank):
        diff = added(r["plain"], r["guarded"], STEPS)
        assert diff["plain_collectives"] >= 1, (rank, r)  # the count sees the loop's own gradient reduction
        assert (diff["collectives"], diff["host_reads"]) == ADDED[name, world], (rank, diff)
        assert r["plain_digest"] == r["guarded_digest"], (rank, r)  # a healthy guarded run is bit-identical
