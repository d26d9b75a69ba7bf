"""Megatron-core's own behaviour on each fault, side by side with MegatronGuard's: 2 gloo ranks on CPU
(the test suite's CUDA shim, ``tests/_megatron_cpu.py``), a tiny GPT from a ``TransformerConfig``, data
parallel 2 with Megatron's DDP and DistributedOptimizer, fp32, the fault on one rank at step 1.

Megatron is run as shipped (``update_successful, grad_norm, num_zeros = optimizer.step()``), with its
``check_for_nan_in_grad`` on, and with ``pretrain_gpt.py``'s RerunStateMachine loss validation; then
under ``MegatronGuard(policy="skip")``. Writes the ``megatron`` section of docs/comparison.md.

    .venv/bin/python benchmarks/megatron_compare.py
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

FAULTS = {
    "a NaN in rank 1's batch (loss mask)": ("data", 1, 1),
    "a token id past the vocabulary on rank 0": ("ids", 0, 1),
    "log of a negative in decoder.layers.0.mlp on rank 0": ("log", 0, 1),
    "a NaN written into decoder.layers.0.mlp's gradient on rank 1 (backward)": ("grad", 1, 1),
    "an LR far too high (SGD, no clipping), every rank": ("diverge", -1, -1),
}
DIVERGE = {"steps": 6, "lr": 50.0, "optimizer": "sgd", "clip_grad": 0.0, "regression": True}


def rank_case(rank: int, world: int, case: dict[str, Any], out: str) -> dict[str, Any]:
    """One run on this rank; its outcome is also written to ``out`` (a rank that raised leaves at once,
    so that its peer, waiting in a collective, learns of it as Megatron's job would)."""
    from _megatron_ranks import init, train

    init(1, 1)
    try:
        result = train(case, rank)
    except Exception as err:  # what Megatron does on this fault: the job's error
        result = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    if "error" in result:
        sys.stdout.flush()
        os._exit(0)
    return result


def run(case: dict[str, Any]) -> list[dict[str, Any]]:
    """Both ranks' outcomes of one run in its own spawned group (a raise breaks the group)."""
    from nanguard.zoo.spawn import RanksFailed, spawn_ranks

    with tempfile.TemporaryDirectory() as out:
        with contextlib.suppress(RanksFailed):  # a rank left after its error: its outcome is on disk
            spawn_ranks(rank_case, case, out, world=2, timeout=300)
        found = []
        for rank in range(2):
            path = Path(out, f"{rank}.json")
            found.append(
                json.loads(path.read_text())
                if path.exists()
                else {"error": "no result: still waiting in a collective when the group was torn down"}
            )
        return found


def _megatron(ranks: list[dict[str, Any]], bad_step: int) -> str:
    if any("error" in d for d in ranks):
        raised = [r for r, d in enumerate(ranks) if "error" in d and "gloo" not in d["error"]]
        said = [f"rank {r} raises `{ranks[r]['error']}`" for r in raised]
        waiting = [r for r in range(len(ranks)) if r not in raised]
        if waiting:
            said.append(
                f"rank {', '.join(map(str, waiting))} waits in its collective until the raising rank's process is gone"
            )
        return "; ".join(said)
    results = ranks[0]["results"]
    step = bad_step if bad_step >= 0 else next(i for i, r in enumerate(results) if not math.isfinite(r[1] or 0.0))
    ok, norm = results[step]
    finite = all(d["finite"] for d in ranks)
    weights = "finite" if finite else "**NaN**"
    return f"step {step}: `optimizer.step()` returned `({ok}, {norm:.3g}, ...)`; weights after the run {weights}"


def _guarded(ranks: list[dict[str, Any]]) -> str:
    if any("error" in d for d in ranks):
        return "; ".join(f"rank {r}: {d['error']}" for r, d in enumerate(ranks) if "error" in d)
    diag = ranks[0]["trips"][0]
    where = f" in `{diag['module']}`" if diag["module"] else ""
    coords = diag["evidence"].get("parallel", {})
    place = ", ".join(f"{k} {v}" for k, v in coords.items())
    ranks_named = diag.get("ranks") or [diag["rank"]]
    who = f"rank {diag['rank']} ({place})" if len(ranks_named) == 1 else f"ranks {', '.join(map(str, ranks_named))}"
    agree = all(d["trips"][0]["cause"] == diag["cause"] for d in ranks)
    finite = all(d["finite"] for d in ranks)
    return (
        f"step {diag['step']}: `{diag['cause']}`{where} ({diag['phase']}), {who}; "
        f"`(False, None, None)` on {'every rank' if agree else 'some ranks'}; weights {'finite' if finite else 'NaN'}"
    )


def section() -> str:
    rows = []
    for name, (kind, rank, step) in FAULTS.items():
        base: dict[str, Any] = {**DIVERGE} if kind == "diverge" else {"dist_opt": True, "steps": 3}
        if kind != "diverge":
            base["fault"] = (kind, rank, step)
        guarded = {**base, "policy": "skip", "options": {"check_batch": True} if kind == "ids" else {}}
        rows.append((name, "as shipped", _megatron(run(base), step), _guarded(run(guarded))))
        extra = {
            "grad": ("`check_for_nan_in_grad=True`", "check_for_nan_in_grad"),
            "data": ("RerunStateMachine loss check", "validate"),
        }
        if kind in extra:
            how, option = extra[kind]
            own, ours = run({**base, option: True}), run({**guarded, option: True})
            rows.append((name, how, _megatron(own, step), _guarded(ours)))
    table = "\n".join(f"| {n} | {how} | {m} | {g} |" for n, how, m, g in rows)
    conditions = (
        "megatron-core 0.16.1 on 2 gloo ranks (CPU, the tests' CUDA shim), data parallel 2 with its DDP and "
        "DistributedOptimizer, fp32, a 2-layer GPT; each fault on one rank at step 1:"
    )
    return f"""## Megatron-core: its own handling and MegatronGuard's, fault by fault

{conditions}

| fault | Megatron | Megatron on its own | under `MegatronGuard(policy="skip")` |
| --- | --- | --- | --- |
{table}

Megatron's fp32 and bf16 optimizers have no skip of their own: a NaN gradient is clipped, counted and applied
(`update_successful` True, the grad norm NaN), and the weights stay NaN from then on. Its two checks stop the job
instead: `check_for_nan_in_grad` raises on the rank whose own gradient bucket holds the NaN, before the gradient
all-reduce, and the RerunStateMachine (its default mode) raises on the rank whose loss is NaN; neither names a layer
or a cause, and the peer waits in its next collective until the job is torn down (here: until the raising rank's
process left). An id past the vocabulary is an `IndexError` in the embedding on that rank. MegatronGuard decides
first: the step is named on the rank that made the value, with its TP/PP/DP coordinates, and skipped on every rank
the way Megatron's fp16 loss scaler skips an overflow. Reproduce: `.venv/bin/python benchmarks/megatron_compare.py`."""


def write(body: str) -> None:
    """Replace the ``<!-- megatron -->`` section of docs/comparison.md (appended the first time)."""
    path = ROOT / "docs" / "comparison.md"
    text = path.read_text(encoding="utf-8")
    block = f"<!-- megatron -->\n{body.strip()}\n<!-- /megatron -->"
    pattern = re.compile(r"<!-- megatron -->.*?<!-- /megatron -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def main() -> None:
    body = section()
    write(body)
    print(body)


if __name__ == "__main__":
    main()
