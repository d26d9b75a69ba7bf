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

# (configuration, world) -> (collectives, host reads) the guard adds per healthy step, as the code does today
# (every rank alike). Host reads are counted as a GPU run pays them (nanguard's norms summed in float64, no read).
# The configurations are ``_sync_configs.CONFIGS``; the benchmark's table (BENCHMARKS.md) shows the same runs.
ADDED: dict[tuple[str, int], tuple[float, float]] = {
    # Guard.step under DDP's default all-reduce: the flags ride in the gradient all-reduce (2 ranks: in the last
    # bucket's payload; 3 or more: a flagging rank's NaN in it, nothing on a healthy step).
    ("ddp", 2): (0, 1),
    ("ddp", 3): (0, 1),
    ("ddp", 4): (0, 1),
    ("ddp", 8): (0, 1),
    ("ddp_zero", 2): (0, 1),
    ("ddp_zero", 3): (0, 1),
    ("ddp_join", 2): (0, 1),
    ("ddp_join", 3): (1, 1),  # a joined rank's shadow cannot foresee a NaN: one small all-reduce at 3+
    ("ddp_skip_spikes", 3): (1, 1),  # the mean loss it acts on reaches no rank through the buckets at 3+
    ("ddp_fingerprint", 2): (1, 5),  # fingerprint_every=1: an all-gather and 4 reads on each fingerprint step
    ("ddp_check_batch", 2): (1, 3),  # check_batch=True: the batch's verdict agreed before the forward
    ("ddp_precursor", 2): (0, 2),  # precursor_every=1: one more read, of a host copy (on CUDA, non-blocking)
    # LoopGuard rides the loop's own reductions from the step's first forward to its check: DDP's gradient
    # all-reduce (as Guard.step does), or the norm the loop's clip reduces over DTensor gradients (a flagging
    # rank poisons one element it reduces, before the norm).
    ("ddp_clip", 2): (0, 1),
    ("ddp_clip", 3): (0, 1),
    ("ddp_clip", 4): (0, 1),
    ("ddp_clip", 8): (0, 1),
    ("fsdp2_clip", 2): (0, 1),
    ("tp_clip", 2): (0, 1),
    ("2d_clip", 4): (0, 1),
    # Guard.step whose closure clips: the flags ride in the clip's reduced norm.
    ("fsdp2_closure_clip", 2): (0, 1),
    ("tp_closure_clip", 2): (0, 1),
    ("2d_closure_clip", 4): (0, 1),
    # Nothing to ride: one all-reduce of the flags.
    ("fsdp2", 2): (1, 1),
    ("tp", 2): (1, 1),
    ("2d", 4): (1, 1),
    ("pp", 2): (1, 1),
    ("pp", 3): (1, 1),
    ("zero0", 2): (0, 1),  # DeepSpeed: the check reads the global grad norm the engine reduces for its clip
    ("zero1", 2): (0, 1),  # (ZeRO-0: its fp32 clip; ZeRO-1/2: scaled_global_norm; ZeRO-3: its group norms)
    ("zero2", 2): (0, 1),
    ("zero3", 2): (0, 1),
    ("hf", 2): (0, 1),  # the Trainer's clip norm (DDP-averaged gradients), each loss carrying its rank's flags
    ("titan_fsdp", 2): (0, 1),  # the check reads the norm torchtitan's clip reduced over the mesh (and stages)
    ("titan_tp", 2): (0, 1),
    ("titan_pp", 2): (0, 1),
    ("megatron_dp", 2): (0, 1),  # the norm Megatron's clip reduces over the model-parallel group (and reuses)
    ("megatron_tp", 2): (0, 1),
    ("megatron_pp", 2): (0, 1),
    # OLMo-core's clip norm, checked at the optimizer's step after it; nanguard's metrics recorded when they change.
    ("olmo_ddp", 2): (0, 1),
    ("olmo_fsdp", 2): (0, 1),
}

# Always run (one spawn per world size, ~1 min on 2 quiet cores); the rest is ``slow``.
QUICK = {
    ("ddp", 2),
    ("ddp_clip", 2),
    ("fsdp2_closure_clip", 2),
    ("tp_closure_clip", 2),
    ("zero2", 2),
    ("ddp", 3),
    ("ddp", 4),
}


def _spawned(names: list[str], world: int) -> list[dict[str, Any]]:
    # DeepSpeed's set-up last: it initializes its own state on the group.
    names = sorted(names, key=lambda n: n.startswith("zero"))
    return spawn_ranks(run, names, STEPS, world=world, timeout=1800)


@pytest.fixture(scope="module")
def quick() -> dict[int, list[dict[str, Any]]]:
    worlds = sorted({world for _, world in QUICK})
    return {w: _spawned([n for n, world in sorted(QUICK) if world == w], w) for w in worlds}


def _check(name: str, world: int, per_rank: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(per_rank):
        diff = added(r["plain"], r["guarded"], STEPS)
        assert diff["plain_collectives"] >= 1, (rank, r)  # the count sees the loop's own gradient reduction
        assert (diff["collectives"], diff["host_reads"]) == ADDED[name, world], (name, world, rank, diff)
        assert r["plain_digest"] == r["guarded_digest"], (rank, r)  # a healthy guarded run is bit-identical


@pytest.mark.parametrize(("name", "world"), sorted(QUICK))
def test_the_guard_adds_what_the_table_says(quick: dict[int, list[dict[str, Any]]], name: str, world: int) -> None:
    _check(name, world, [r[name] for r in quick[world]])


@pytest.mark.slow
def test_every_configuration_adds_what_the_table_says() -> None:
    rest = sorted(set(ADDED) - QUICK)
    groups: dict[tuple[int, str], list[str]] = {}
    for name, world in rest:  # the engines each in a spawn of their own (their imports and set-up differ)
        family = name.split("_")[0] if name.split("_")[0] in ("hf", "titan", "megatron", "olmo") else "torch"
        groups.setdefault((world, family), []).append(name)
    for (world, _), names in sorted(groups.items()):
        results = _spawned(names, world)
        for name in names:
            _check(name, world, [r[name] for r in results])


def test_the_table_names_only_configurations_that_exist() -> None:
    from _sync_configs import CONFIGS

    assert {name for name, _ in ADDED} == set(CONFIGS) and set(ADDED) >= QUICK
