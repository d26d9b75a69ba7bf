"""Cost of ``ng.locate`` on a ``torch.compile``d tiny GPT: the replay runs eagerly
(``torch.compiler.set_stance("force_eager")``), against the same replay let through dynamo.

Each configuration runs in its own process (dynamo's caches and recompile counters are
per process): compile, run two plain steps, then time one locate, the first after the
compiled steps, as a trip would; the eager baseline is locate on the uncompiled model.

With ``--trip``: the time a guarded compiled run takes to diagnose a trip that only the compiled
code makes (a planted miscompile on top of each backend, ``nanguard.zoo.miscompile``): the tripped
``guard.step`` (eager replay, compiled replay, fresh differential compile of the forward) against one
healthy compiled step, and what the diagnosis named.

Run: ``.venv/bin/python benchmarks/compile_locate.py [--backends eager aot_eager inductor] [--trip]``;
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


def trip(backend: str) -> dict[str, object]:
    import nanguard as ng
    from nanguard.zoo import GPT, GPTConfig, synthetic_batch
    from nanguard.zoo.miscompile import miscompiling

    torch.manual_seed(0)
    model = GPT(GPTConfig())
    state = {"bad": False}
    compiled = torch.compile(model, backend=miscompiling("blocks.1", lambda: state["bad"], backend))
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    guard = ng.Guard(compiled, opt, module_stats=False)
    steps = []
    for i in range(8):
        batch = synthetic_batch(model.config, torch.Generator().manual_seed(i))
        state["bad"] = i == 7

        def closure(batch=batch):
            opt.zero_grad()
            _, loss = compiled(**batch)
            loss.backward()
            return loss

        steps.append(_time(lambda: guard.step(closure)))
    diag = guard.last_diagnosis
    healthy = sorted(steps[3:7])[1]
    return {
        "step": healthy,
        "trip": steps[7],
        "cause": diag.cause if diag else None,
        "module": diag.module if diag else None,
        "graph": diag.evidence.get("graph") if diag else None,
        "aot_eager_finite": diag.evidence.get("aot_eager_finite") if diag else None,
    }


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backends", nargs="+", default=["eager", "aot_eager", "inductor"])
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--trip", action="store_true", help="time the diagnosis of a compiled-only trip")
    parser.add_argument("--one-trip", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1] == "dynamo")))
        return
    if args.one_trip:
        print(json.dumps(trip(args.one_trip)))
        return
    if args.trip:
        trips(args.backends)
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

One `ng.locate` of the tiny GPT's step (the first after two compiled steps, as on a trip), seconds:

| backend | locate, plain model | locate, compiled model | same, replay through dynamo |
|---|---:|---:|---:|
{table}

nanguard replays a `torch.compile`d model eagerly (`torch.compiler.set_stance("force_eager")`), so the
replay costs what it costs on the plain model; the last column lets the same replay go through dynamo,
as nanguard did before, which then traces the tracer.

Machine: {machine()}, load average {load:.1f} at the end. Reproduce: `.venv/bin/python benchmarks/compile_locate.py`."""
    write_section("compile-locate", body)
    print(body)


def trips(backends: list[str]) -> None:
    rows = []
    for backend in backends:
        out = subprocess.run(
            [sys.executable, __file__, "--one-trip", backend],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        got = json.loads(out.stdout.strip().splitlines()[-1])
        module = f"module `{got['module']}`" if got["module"] else "no single module (several outputs differ)"
        named = f"{got['cause']}, graph {got['graph']}, {module}"
        named += f", aot_eager finite: {got['aot_eager_finite']}"
        rows.append(
            f"| {backend} | {got['step']:.3f} | {got['trip']:.2f} | {got['trip'] / got['step']:.0f}x | {named} |"
        )
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    load = os.getloadavg()[0]
    body = f"""## Diagnosing a trip only the compiled code makes (`compile.numerics`)

The tiny GPT compiled with a planted miscompile on top of each backend, guarded; seconds:

| backend | healthy step | tripped step | ratio | diagnosis |
|---|---:|---:|---:|---|
{table}

The miscompile (`nanguard.zoo.miscompile`) makes the graph holding `blocks.1` output NaN at step 7.
Seconds: one healthy compiled step (median of steps 3-6), the tripped step (the eager replay under the
tracer, the compiled replay, and the fresh differential compile of the forward that names the graph), and
what the diagnosis named. The fresh compile's cost follows inductor's on-disk cache: cold (the first run on
this machine) the tripped inductor step took 32 s.

Machine: {machine()}, load average {load:.1f} at the end. Reproduce:
`.venv/bin/python benchmarks/compile_locate.py --trip --backends aot_eager inductor`."""
    write_section("compile-trip", body)
    print(body)


if __name__ == "__main__":
    main()
