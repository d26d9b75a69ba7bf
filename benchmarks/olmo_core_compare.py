"""OLMo-core's own behaviour on each fault, next to ``NanGuardCallback``'s: the same runs of OLMo-core's
``Trainer`` (``nanguard.zoo.olmo``: a tiny llama-like model, its numpy data loader, ``SkipStepAdamW``,
clipping at 1.0, DDP on 2 gloo ranks, CPU), each fault on rank 1 at step 3, unguarded and guarded.

Writes the ``olmo-core-compare`` section of docs/comparison.md.

    .venv/bin/python benchmarks/olmo_core_compare.py
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

warnings.simplefilter("ignore", ImportWarning)  # OLMo-core's google-api-core import, when warnings are errors

COMPARISON = Path(__file__).resolve().parent.parent / "docs" / "comparison.md"
FAULTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # fault: (what it is, the run's keywords, the guard's options)
    "log": ("`log` of negatives in `blocks.1.feed_forward.w1`", {}, {}),
    "nan_grad": ("a NaN gradient made in that module's backward (the loss finite)", {}, {}),
    "token": ("a token id past the vocabulary in rank 1's batch", {}, {"check_batch": True}),
    "embeds": ("a NaN in rank 1's precomputed `input_embeddings`", {}, {}),
    "lr": ("an LR 1e5x too high (100), every rank", {"lr": 100.0, "steps": 6}, {}),
}
_TIMEOUT = 120.0


def compare_rank(rank: int, world: int, case: list[Any], out: str) -> dict[str, Any]:
    """``olmo_rank`` on this rank, its result written to ``out`` at once: a rank whose peer stopped may
    then hang in a collective, and what it did is kept all the same."""
    import json

    from nanguard._io import atomic_write_text
    from nanguard.zoo.olmo import ranks_cases

    result = ranks_cases(rank, world, [case])[0]
    atomic_write_text(Path(out, f"rank{rank}.json"), json.dumps(result))
    return result


def run(fault: str, policy: str | None) -> list[dict[str, Any] | None]:
    """Each rank's result (None for a rank that did not finish: stuck in a collective its stopped peer never joined)."""
    import json
    import tempfile

    from nanguard.zoo.spawn import RanksFailed, spawn_ranks

    _, keywords, options = FAULTS[fault]
    case = ["ddp", None if fault == "lr" else fault, 1, policy, {**keywords, "options": options}]
    with tempfile.TemporaryDirectory() as out:
        try:
            return list(spawn_ranks(compare_rank, case, out, world=2, timeout=_TIMEOUT))
        except RanksFailed:
            files = [Path(out, f"rank{r}.json") for r in range(2)]
            return [json.loads(f.read_text(encoding="utf-8")) if f.exists() else None for f in files]


def olmo_alone(result: list[dict[str, Any] | None]) -> str:
    done = [r for r in result if r is not None]
    stuck = [rank for rank, r in enumerate(result) if r is None]
    if not done:
        return "no rank finished"
    r = next((r for r in done if r["error"]), done[0])
    finite = "finite" if all(x["finite"] for x in done) else f"NaN ({r['params']} of {r['params']} parameters)"
    if stuck:
        waits = ", ".join(f"rank {k}" for k in stuck)
        return f"`{r['error'][:120]}` on rank {r['rank']} at step {r['steps']}; {waits} hung until the job was killed"
    if r["error"]:
        return f"`{r['error'][:120]}` after step {r['steps']}; weights {finite}"
    norms = [m.get("optim/total grad norm") for m in r["metrics"].values()]
    shown = ", ".join(f"{n:.3g}" for n in norms if n is not None)
    return f"runs on: {r['steps']} steps, none skipped, grad norm logged {shown}; weights {finite}"


def nanguard(result: list[dict[str, Any] | None]) -> str:
    if any(r is None for r in result):
        return "a rank did not finish"
    r0 = result[0]
    assert r0 is not None
    d = r0["diag"]
    if d is None:
        return "no trip"
    where = ", ".join(f"`{d[k]}`" for k in ("op", "module") if d.get(k))
    ranks = "every rank" if d["ranks"] == [0, 1] else f"rank {d['rank']}"
    steps = ", ".join(map(str, r0["skipped"]))
    finite = "finite" if all(r is not None and r["finite"] for r in result) else "NOT finite"
    named = f"`{d['cause']}` ({d['phase']}{', ' + where if where else ''}) on {ranks}"
    return f"{named}; step(s) {steps} skipped on both ranks, weights {finite}"


def section() -> str:
    import torch

    rows = []
    for fault, (what, _, _) in FAULTS.items():
        rows.append(f"| {what} | {olmo_alone(run(fault, None))} | {nanguard(run(fault, 'skip'))} |")
    from importlib.metadata import version

    conditions = (
        f"ai2-olmo-core {version('ai2-olmo-core')} `Trainer`, DDP on 2 gloo ranks (CPU), `SkipStepAdamW`, clip 1.0, "
        f"each fault on rank 1 at step 3 (torch {torch.__version__}):"
    )
    return f"""## OLMo-core on its own, and with `NanGuardCallback`

{conditions}

| fault | OLMo-core alone | with `NanGuardCallback(policy="skip")` |
| --- | --- | --- |
{chr(10).join(rows)}

The runs are `nanguard.zoo.olmo`'s: a 2-layer llama-like `TransformerConfig` (d_model 32, vocab 128, 21 parameters),
its `NumpyFSLDataset` over a token file the run writes, 2 micro-batches of 2 sequences per rank and step. "OLMo-core
alone" is what its trainer did: `SkipStepAdamW` judges a step against 64 steps of history (half its 128-step window),
so in a run this short it steps every update, and its skip multiplies the update by 0, which keeps a NaN gradient's
NaN. The trainer's "nan loss" check runs in its bookkeeping thread when a step's metrics are logged, after that
step's update; whether the peer rank then stops too or waits in a collective varies from run to run (both were
seen on this machine: "hung until the job was killed" is the spawn's deadline, 120 s). A token
id past the vocabulary raises inside the embedding on its rank only. The guarded runs skip before the clip and the
update, on every rank, and take the step's loss and grad norm out of the trainer's metrics and out of
`SkipStepAdamW`'s window. Reproduce: `.venv/bin/python benchmarks/olmo_core_compare.py`.
"""


def write(body: str) -> None:
    text = COMPARISON.read_text(encoding="utf-8")
    block = f"<!-- olmo-core-compare -->\n{body.strip()}\n<!-- /olmo-core-compare -->"
    pattern = re.compile(r"<!-- olmo-core-compare -->.*?<!-- /olmo-core-compare -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    COMPARISON.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    write(section())
    print(COMPARISON.read_text(encoding="utf-8").split("<!-- olmo-core-compare -->", 1)[1])
