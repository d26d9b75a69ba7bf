"""`nanguard report` on a large event log: wall time, CPU time and peak memory of the text and HTML
reports, and the size of the HTML pages of a long run and of a run that trips many times.

The log is written by the guard's own ``EventLog`` (step lines, with a skip, a trip and a spike
every few thousand steps) until it reaches ``--mb`` megabytes. Each report runs in a fresh
process, which reads its own peak resident memory (``VmHWM``: the peak of that process alone,
not of the benchmark that started it). ``--compare SRC`` times another checkout's ``src`` (say,
the version before a change) in the same run, interleaved round by round.

Reproduce: ``.venv/bin/python benchmarks/report_scale.py`` (before/after: add
``--compare /tmp/before/src --before-label LABEL``, made by ``git archive BEFORE src | tar -x -C /tmp/before``).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import machine, write_section
from nanguard.events import EventLog
from nanguard.zoo.runs import write_noisy_run

SRC = Path(__file__).resolve().parent.parent / "src"
_TRIP_DIAGNOSIS = {
    "cause": "op.log_domain",
    "kind": "nan",
    "step": 0,
    "op": "aten.log.default",
    "module": "blocks.0.mlp",
    "phase": "forward",
    "evidence": {"input_min": -1.0},
}
# Runs nanguard's CLI, then reports this process's own peak RSS on the last line of stderr.
_CHILD = """
import resource, sys
from nanguard.cli import main
code = main(sys.argv[1:]) if len(sys.argv) > 1 else 0
try:
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
except OSError:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
sys.stdout.flush()
sys.stderr.write(f"\\npeak_kb={peak}\\n")
sys.exit(code)
"""


def write_log(run_dir: Path, megabytes: float, seed: int = 0) -> int:
    """Fill ``run_dir/events-rank0.jsonl`` to ``megabytes``; returns the number of steps written."""
    rng = random.Random(seed)
    log = EventLog(run_dir, rank=0)
    log.write("start", 0, config={"policy": "skip"}, world_size=1, path=str(run_dir))
    target = int(megabytes * 2**20)
    step = 0
    while log.path.stat().st_size < target:
        for _ in range(10_000):
            step += 1
            loss = 4.0 * math.exp(-step / 2e5) + rng.random() * 0.01
            bad = step % 5000 == 0
            log.write("step", step, loss="nan" if bad else loss, grad_norm=rng.random() + 0.5, skipped=bad, scale=None)
            if bad:
                log.write("trip", step, action="skip", ranks=[0], diagnosis={**_TRIP_DIAGNOSIS, "step": step})
                log.write("skip", step, reason="non-finite loss")
            if step % 7919 == 0:
                log.write("spike", step, metric="loss", value=loss * 3, median=loss, score=7.5)
    log.write("end", step, skipped=step // 5000, rollbacks=0)
    log.close()
    return step


def measure(src: Path, args: list[str]) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak MiB) of nanguard's CLI with ``args``, from ``src``, in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    before = os.times()
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    after = os.times()
    if done.returncode != 0:
        raise SystemExit(f"{args} failed:\n{done.stderr[-2000:]}")
    peak_kb = int(done.stderr.rstrip().rpartition("peak_kb=")[2])
    cpu = after.children_user + after.children_system - before.children_user - before.children_system
    return seconds, cpu, peak_kb / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=float, default=200.0, help="size of the event log in MB")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--compare", type=Path, help="another checkout's src/ to measure alongside, as 'before'")
    parser.add_argument("--before-label", default="before", help="row label of the --compare checkout")
    parser.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = parser.parse_args()
    versions = {args.before_label: args.compare.resolve()} if args.compare else {}
    versions["after"] = SRC
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        steps = write_log(root / "big", args.mb)
        size = (root / "big" / "events-rank0.jsonl").stat().st_size / 2**20
        write_noisy_run(root / "long", 6000, range(3000, 3008))
        write_noisy_run(root / "many", 40, range(3, 11))
        load = os.getloadavg()[0]
        runs: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        for _ in range(args.rounds):
            for name, src in versions.items():
                for what, extra in (("import", []), ("text", []), ("html", ["--html", str(root / f"{name}.html")])):
                    cli = ["report", str(root / "big"), *extra] if what != "import" else []
                    runs.setdefault((name, what), []).append(measure(src, cli))
        pages: dict[tuple[str, str], float] = {}
        for name, src in versions.items():
            pages[(name, "big")] = (root / f"{name}.html").stat().st_size / 1024
            for run in ("long", "many"):
                out = root / f"{name}-{run}.html"
                measure(src, ["report", str(root / run), "--html", str(out)])
                pages[(name, run)] = out.stat().st_size / 1024
        load = max(load, os.getloadavg()[0])

    def cell(name: str, what: str) -> tuple[str, str]:
        wall, cpu, peak = (statistics.median(v) for v in zip(*runs[(name, what)], strict=True))
        return f"{wall:.1f} ({cpu:.1f})", f"{peak:.0f}"

    rows = []
    for name in versions:
        (text_s, text_mb), (html_s, html_mb), (imp_s, imp_mb) = (cell(name, w) for w in ("text", "html", "import"))
        rows.append(
            f"| {name} | {size:.0f} MB, {steps} steps | {text_s} | {text_mb} | {html_s} | {html_mb} "
            f"| {imp_s}, {imp_mb} MB |"
        )
    page_rows = [
        f"| {name} | {pages[(name, 'long')]:.0f} KB | {pages[(name, 'many')]:.0f} KB | {pages[(name, 'big')]:.0f} KB |"
        for name in versions
    ]
    print("\n".join(rows + page_rows))
    if args.no_write:
        return
    conditions = (
        f"`nanguard report RUN_DIR` and `nanguard report RUN_DIR --html OUT`, "
        f"each in a fresh process, {args.rounds} interleaved rounds:"
    )
    body = f"""## Report on a large event log

{conditions}

| version | log | text s | text peak MB | html s | html peak MB | import alone |
|---|---|---:|---:|---:|---:|---|
{chr(10).join(rows)}

The log is one rank's event log written by the guard's `EventLog`. Times are median wall seconds (CPU
seconds in brackets, less sensitive to a busy machine); peak is the process's own resident memory
(`VmHWM`). The last column is what starting Python and importing `nanguard.cli` alone costs.
Target (issue 16): text report <= 5 s and <= 300 MB on a 200 MB log, HTML bounded likewise.

Earlier rows (each measured by its own run, peak from the benchmark's `ru_maxrss`, which counted the
benchmark's own memory too): issue 13's first reader (every line kept as a dict) 17.0 s / 736 MB text,
32.0 s / 848 MB HTML; the first streamed reader 13.9 s / 381 MB text, 22.9 s / 381 MB HTML, of which
3.4 s and 223 MB were importing torch, which `nanguard report` no longer does.

How: step lines are split on commas into columns checked against their keys and parsed as one text each;
loss, grad norm and scale are parsed only at the rows the thinned curves keep (a value elsewhere is
checked to be made of number characters; "nan"/"inf" and null are found as text); the distinct steps
need no sort when each rank's steps rise. A bad line is still a warning naming file:line.

HTML page size (plots are inline SVG, their text is text; curves thinned to 1500 points per rank):

| version | long run (6000 steps, 8 trips) | many trips (40 steps, 8 in a row) | the {size:.0f} MB log above |
|---|---:|---:|---:|
{chr(10).join(page_rows)}

Machine: {machine()}, load average up to {load:.1f} during the run (other jobs shared the cores).
Reproduce: `.venv/bin/python benchmarks/report_scale.py` (for the before row add `--compare /tmp/before/src
--before-label "before (main at 4389f1e)"`, after `git archive 4389f1e src | tar -x -C /tmp/before`).
"""
    write_section("report-scale", body)


if __name__ == "__main__":
    main()
