"""Cost of ``ng.locate`` on a ``torch.compile``d tiny GPT: the replay runs eagerly
(``torch.compiler.set_stance("force_eager")``), against the same replay let through dynamo.

Each configuration runs in its own process (dynamo's caches and recompile counters are
per process): compile, run two plain steps, then time one locate, the first after the
compiled steps, as a trip would; the eager baseline is locate on the uncompiled model.

Run: ``.venv/bin/python benchmarks/compile_locate.py [--backends eager aot_eager inductor]``;
writes BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

import torch

from _common import machine, write_section


def one(backend: str, through_dynamo: bool) -> dict[str, float]:
    import nanguard as ng
    from nanguard.tracer import api
    from nanguard.zoo import GPT, GPTConfig, synthetic_batch, train_step

    torch.manual_seed(0)
    model = GPT(GPTConfig())
    batch = synthetic_batch(model.config, torch.Generator().manual_seed(0))
    eager = min(_time(lambda: ng.locate(train_step, model, batch, model=model)) for _ in range(3))
    compiled = torch.compile(model, backend=backend)
    for _ in range(2):
        train_step(compiled, batch)
    if through_dynamo:  # what locate did before it replayed compiled models eagerly
        api.eager = contextlib.nullcontext
    first = _time(lambda: ng.locate(train_step, compiled, batch, model=compiled))
    return {"eager_locate": eager, "compiled_locate": first}


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backends", nargs="+", default=["eager", "aot_eager", "inductor"])
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1] == "dynamo")))
        return
    rows = []
    for backend in args.backends:
        got = {}
        for mode in ("eager", "dynamo"):
            out = subprocess.run(
                [sys.executable, __file__, "--one", backend, mode],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
            got[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        base = got["eager"]["eager_locate"]
        rows.append(
            f"| {backend} | {base:.3f} | {got['eager']['compiled_locate']:.3f} | "
            f"{got['dynamo']['compiled_locate']:.2f} |"
        )
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    load = os.getloadavg()[0]
    body = f"""## Locate on a compiled model

One `ng.locate` of the tiny GPT's step (the first after two compiled steps, as on a trip), seconds.
nanguard replays a `torch.compile`d model eagerly (`torch.compiler.set_stance("force_eager")`), so the
replay costs what it costs on the plain model; the last column lets the same replay go through dynamo,
as nanguard did before, which then traces the tracer.

| backend | locate, plain model | locate, compiled model | same, replay through dynamo |
|---|---:|---:|---:|
{table}

Machine: {machine()}, load average {load:.1f} at the end. Reproduce: `.venv/bin/python benchmarks/compile_locate.py`."""
    write_section("compile-locate", body)
    print(body)


if __name__ == "__main__":
    main()
