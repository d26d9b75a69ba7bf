"""What a healthy guarded step adds, counted: collectives and host reads, guarded minus unguarded.

Every configuration runs the same loop twice from the same seed on spawned gloo ranks, unguarded and
guarded, and ``tests/_sync_count.py`` counts what each healthy step issues at the dispatcher: every c10d
op (from Python or C++: DDP's reducer, FSDP2, DeepSpeed, Megatron), every functional collective
(DTensor), point-to-point ops, and every host read (``item``, ``bool``, ``float``, ``int``, ``tolist``,
``numpy``). The configurations are ``tests/_sync_configs.py``'s; ``tests/test_sync_count.py`` checks a
quick subset against the table of what the design costs today.

Run: ``.venv/bin/python benchmarks/sync_count.py [--steps N] [--only NAME ...]``; writes BENCHMARKS.md
(unless ``--only``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from _common import machine, write_section

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
warnings.simplefilter("ignore", ImportWarning)  # OLMo-core's google-api-core import

# One spawn per group: (world, configurations).
GROUPS: list[tuple[int, list[str]]] = [
    (2, ["ddp", "ddp_clip", "ddp_fingerprint", "ddp_check_batch", "ddp_precursor", "ddp_zero", "ddp_join"]),
    (2, ["fsdp2", "fsdp2_clip", "fsdp2_closure_clip", "tp", "tp_clip", "tp_closure_clip", "pp"]),
    (3, ["ddp", "ddp_clip", "ddp_skip_spikes", "ddp_zero", "ddp_join", "pp"]),
    (4, ["ddp", "ddp_clip", "2d", "2d_clip", "2d_closure_clip"]),
    (8, ["ddp", "ddp_clip"]),
    (2, ["zero0", "zero1", "zero2", "zero3"]),
    (2, ["hf"]),
    (2, ["titan_fsdp", "titan_tp", "titan_pp"]),
    (2, ["megatron_dp", "megatron_tp", "megatron_pp"]),
    (2, ["olmo_ddp", "olmo_fsdp"]),
]

LABELS = {
    "ddp": ("DDP", "`Guard.step(closure)`"),
    "ddp_clip": ("DDP + the loop's `clip_grad_norm_`", "`LoopGuard`"),
    "ddp_fingerprint": ("DDP, a replica-fingerprint step (`fingerprint_every=1`)", "`Guard.step(closure)`"),
    "ddp_check_batch": ("DDP, `check_batch=True`", "`Guard.step(closure)`"),
    "ddp_precursor": ("DDP, a precursor-sampling step (`precursor_every=1`)", "`Guard.step(closure)`"),
    "ddp_skip_spikes": ("DDP, `skip_spikes=True`", "`Guard.step(closure)`"),
    "ddp_zero": ("DDP + `ZeroRedundancyOptimizer`", "`Guard.step(closure)`"),
    "ddp_join": ("DDP inside `join()`", "`Guard.step(closure)`"),
    "fsdp2": ("FSDP2", "`Guard.step(closure)`"),
    "fsdp2_clip": ("FSDP2 + the loop's `clip_grad_norm_`", "`LoopGuard`"),
    "fsdp2_closure_clip": ("FSDP2, the closure clips", "`Guard.step(closure)`"),
    "tp": ("TP (DTensor Colwise/Rowwise)", "`Guard.step(closure)`"),
    "tp_clip": ("TP + the loop's `clip_grad_norm_`", "`LoopGuard`"),
    "tp_closure_clip": ("TP, the closure clips", "`Guard.step(closure)`"),
    "2d": ("2D: FSDP2 (dp 2) x TP (tp 2)", "`Guard.step(closure)`"),
    "2d_clip": ("2D + the loop's `clip_grad_norm_`", "`LoopGuard`"),
    "2d_closure_clip": ("2D, the closure clips", "`Guard.step(closure)`"),
    "pp": ("PP (`ScheduleGPipe`, 1 stage a rank)", "`Guard.step(closure)`"),
    "zero0": ("DeepSpeed ZeRO-0, `gradient_clipping` 1.0", "`DeepSpeedGuard`"),
    "zero1": ("DeepSpeed ZeRO-1, `gradient_clipping` 1.0", "`DeepSpeedGuard`"),
    "zero2": ("DeepSpeed ZeRO-2, `gradient_clipping` 1.0", "`DeepSpeedGuard`"),
    "zero3": ("DeepSpeed ZeRO-3, `gradient_clipping` 1.0", "`DeepSpeedGuard`"),
    "hf": ("HF `Trainer` (DDP, its clip 1.0)", "`NanGuardCallback`"),
    "titan_fsdp": ("torchtitan `Trainer`, FSDP2", "`TitanGuard`"),
    "titan_tp": ("torchtitan `Trainer`, TP", "`TitanGuard`"),
    "titan_pp": ("torchtitan `Trainer`, PP (1F1B)", "`TitanGuard`"),
    "megatron_dp": ("Megatron-core, DP + DistributedOptimizer", "`MegatronGuard`"),
    "megatron_tp": ("Megatron-core, TP", "`MegatronGuard`"),
    "megatron_pp": ("Megatron-core, PP (1F1B)", "`MegatronGuard`"),
    "olmo_ddp": ("OLMo-core `Trainer`, DDP", "`NanGuardCallback`"),
    "olmo_fsdp": ("OLMo-core `Trainer`, FSDP", "`NanGuardCallback`"),
}


def _number(values: list[float], sign: bool = True) -> str:
    """One number when every rank agrees, else each rank's."""
    shown = [(f"{v:+g}" if sign else f"{v:g}") if v else "0" for v in values]
    return shown[0] if len(set(shown)) == 1 else " / ".join(shown)


def _ops(per_rank: list[dict[str, float]]) -> str:
    names = sorted({name for ops in per_rank for name in ops})
    if not names:
        return ""
    return ", ".join(f"`{name}` {_number([ops.get(name, 0) for ops in per_rank])}" for name in names)


def row(name: str, world: int, per_rank: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    from _sync_count import added

    diffs = [added(r["plain"], r["guarded"], steps) for r in per_rank]
    return {
        "name": name,
        "world": world,
        "collectives": _number([d["collectives"] for d in diffs]),
        "ops": _ops([d["collective_ops"] for d in diffs]),
        "elements": _number([d["elements"] for d in diffs]),
        "reads": _number([d["host_reads"] for d in diffs]),
        "read_kinds": _ops([d["host_read_kinds"] for d in diffs]),
        "plain": _number([d["plain_collectives"] for d in diffs], sign=False),
        "identical": all(r["plain_digest"] == r["guarded_digest"] for r in per_rank),
    }


def run_group(world: int, names: list[str], steps: int) -> list[dict[str, Any]]:
    from _sync_configs import run
    from nanguard.zoo.spawn import RanksFailed, spawn_ranks

    try:
        results = spawn_ranks(run, names, steps, world=world, timeout=1800)
    except RanksFailed as err:
        said = str(err).strip().splitlines()[-1][:160]
        return [{"name": n, "world": world, "failed": said} for n in names]
    return [row(n, world, [r[n] for r in results], steps) for n in names]


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| configuration | ranks | guard | collectives added a step | which | elements added a step "
        "| host reads added a step | the loop's own collectives a step | weights bit-identical |",
        "|---|---:|---|---:|---|---:|---:|---:|---|",
    ]
    for r in rows:
        label, guard = LABELS[r["name"]]
        if "failed" in r:
            lines.append(f"| {label} | {r['world']} | {guard} | failed: {r['failed']} | | | | | |")
            continue
        identical = "yes" if r["identical"] else "**no**"
        lines.append(
            f"| {label} | {r['world']} | {guard} | {r['collectives']} | {r['ops']} | {r['elements']} | {r['reads']} "
            f"| {r['plain']} | {identical} |"
        )
    return "\n".join(lines)


def section(rows: list[dict[str, Any]], steps: int, seconds: float) -> str:
    from _sync_configs import SHORT, WARMUP

    conditions = (
        f"Guarded minus unguarded, per healthy step, the same loop from the same seed; {steps} counted steps after "
        f"{WARMUP} uncounted (whole-trainer rows: runs of {SHORT} and {SHORT + steps} steps, subtracted); "
        f"host reads as a GPU pays them; {seconds / 60:.0f} min in all:"
    )
    return f"""## Collectives and host reads a healthy step adds (counted)

{conditions}

{table(rows)}

What the rows show. Under `Guard.step(closure)` and `LoopGuard` with DDP's default all-reduce the guard adds no
collective at 2, 3, 4 and 8 ranks: on 2 ranks its `2 x world_size + 2` float32 (6) ride in the last gradient
bucket's all-reduce ("elements added"); on 3 or more nothing is added to the wire on a healthy step. The same with
`ZeroRedundancyOptimizer`; inside `join()` and with `skip_spikes=True` at 3 ranks, one all-reduce of
`2 x world_size + 2` float32. Under FSDP2, TP and 2D where the loop clips over every rank (in the `Guard.step`
closure, or its own `clip_grad_norm_` under `LoopGuard`), none (the flags ride in the clip's reduced norm);
without a clip, one. DeepSpeed ZeRO 0-3 with its clipping, torchtitan's `Trainer` under FSDP2, TP and PP,
Megatron-core under DP, TP and PP, the HF `Trainer` under DDP and OLMo-core's `Trainer` under DDP and FSDP: none
(the guard reads the grad norm the engine or trainer reduces for its own clip, each rank's loss or parameter check
carrying its flags into it). PP under `Guard.step`: one all-reduce of `2 x world_size + 2` float32 a step.
Every configuration adds one host read (the agreed health, one `tolist`); OLMo-core's `Trainer`, which `.item()`s
each metric recorded without a reduce type, gets the guard's two (`nanguard/skipped`, `nanguard/trips`) with the
first step and when they change, so a healthy step reads neither. Steps that come every N: a replica-fingerprint
step (every `fingerprint_every` = 100 updates by default) adds an all-gather and four host reads; a
precursor-sampling step (every `precursor_every` = 20) one more read, a `tolist` of values that on CUDA are copied
to pinned memory without blocking and read once copied. `check_batch=True` adds one all-reduce and two reads a
step. Every row's final weights equal the unguarded run's, bit for bit. Under PP the stages' own collectives
differ (each rank's figure is shown).

Counted by `tests/_sync_count.py` at the dispatcher (a `TorchDispatchMode` in the calling thread and in every
thread started during the run): every `c10d` op, from Python or from C++ (DDP's reducer, FSDP2's reduce-scatter,
DeepSpeed's and Megatron's calls, `send`/`recv` and `batch_isend_irecv`), every `_c10d_functional` op (DTensor's
redistributions and its `clip_grad_norm_`), and every host read: `aten._local_scalar_dense` (`item`, `bool`,
`float`, `int`) and `Tensor.tolist`/`numpy`. "which" names the ops whose count changed (a `c10d.allreduce_` is
one `torch.distributed.all_reduce` or one DDP bucket); "elements added" counts the tensor elements the
collectives carry beyond the unguarded run's. "Host reads as a GPU pays them": on CPU nanguard reads its float32
norms back to re-sum an overflow in float64, which costs no device sync there and which CUDA does not do (it sums
in float64); the count runs nanguard's CUDA summation on the CPU. "Weights bit-identical": every rank's final
weights (its shards) equal the unguarded run's, bit for bit. The loops are `tests/_sync_configs.py`'s: a 2-layer
MLP (8 -> 16 -> 8) and AdamW for DDP, FSDP2, TP, 2D and PP; `tests/_deepspeed_ranks.py`'s engine (fp32 on
DeepSpeed's CPU accelerator); `tests/_hf_ranks.py`'s tiny GPT-2 in the HF `Trainer`; torchtitan's own `Trainer`
(`nanguard/zoo/titan_trainer.py`); `tests/_megatron_ranks.py`'s Megatron-core loop (CPU shim, its clip 1.0);
OLMo-core's own `Trainer` (`nanguard/zoo/olmo.py`); each guarded with its defaults (`policy="skip"`).
`tests/test_sync_count.py` asserts these numbers (one table, `ADDED`). Not counted: a trip's replay and
diagnosis, NCCL and GPUs (the ops do not depend on the backend; the host reads are counted as CUDA's summation
makes them, not measured as device syncs).
{machine()}. Reproduce: `.venv/bin/python benchmarks/sync_count.py --steps {steps}`.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", nargs="+", metavar="NAME", help=f"configurations, of {sorted(LABELS)}")
    args = parser.parse_args()
    start = time.monotonic()
    rows: list[dict[str, Any]] = []
    for world, names in GROUPS:
        chosen = [n for n in names if args.only is None or n in args.only]
        if chosen:
            rows += run_group(world, chosen, args.steps)
            print(json.dumps(rows[-len(chosen) :]), flush=True)
    if args.only is None:
        body = section(rows, args.steps, time.monotonic() - start)
        write_section("sync-count", body)
        print(body)
    else:
        print(table(rows))


if __name__ == "__main__":
    main()
