"""``nanguard report RUN_DIR [--html OUT] [--json]``: summarize a run from its events and bundles."""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from nanguard.errors import NanguardError
from nanguard.hardware import device_rows
from nanguard.report.load import RunReport, ShowProgress, Trip, load_run
from nanguard.report.terminal import Console
from nanguard.text import (
    DRILL_COLUMNS,
    HARDWARE_COLUMNS,
    HEADROOM_COLUMNS,
    RANK_COLUMNS,
    REMEDY_COLUMNS,
    drill_rows,
    event_words,
    hardware_rows,
    headroom_rows,
    rank_rows,
    remedy_rows,
)

__all__ = ["print_summary", "run_report"]

_MAX_PANELS = 10
_MAX_EVENT_ROWS = 40


def run_report(
    run_dir: str | Path | Sequence[str | Path],
    html: str | Path | None = None,
    as_json: bool = False,
    *,
    run: str | None = None,
    list_runs: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Read ``run_dir``, print its summary (or JSON), optionally write the HTML page; return the exit code.

    0 when the report was made, 1 when the run directory has no readable events or the
    page cannot be written. Problems in the logs (a truncated line, an unknown event kind)
    are printed to ``err`` as warnings; progress goes to ``err`` when it is a terminal.

    Several run directories (a job and its restarts) are reported one after the other, then
    one table of trips per host and device over all of them (``--json``: ``{"runs": [...],
    "hardware": [...]}``); ``html`` is for one run directory.

    A run directory a guard wrote to more than once holds several runs: the latest is shown, ``run``
    picks one by id ("-": the logs from before run ids), ``list_runs`` lists them instead.

    Example:
        >>> run_report("runs/exp1", html="runs/exp1/report.html")
        0
    """
    out = out or sys.stdout
    err = err or sys.stderr
    if not isinstance(run_dir, (str, os.PathLike)):
        if len(run_dir) > 1 and (run is not None or list_runs):
            print("nanguard report: error: --run and --runs take one RUN_DIR", file=err, flush=True)
            return 2
        if len(run_dir) != 1:
            return _several(list(run_dir), html, as_json, out, err)
        run_dir = run_dir[0]
    status = Console(err)
    report = _load(run_dir, err, run=run, progress=lambda total, label: status.progress(total, label, echo=False))
    if report is None:
        return 1
    if list_runs:
        return _list_runs(report, as_json, out)
    written: Path | None = None
    if html is not None:
        written = _write_page(report, html, status, err)
        if written is None:
            return 1
    try:
        _print_report(report, written, as_json, out)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and keep Python's exit flush from failing again.
        if out is sys.stdout:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _load(
    run_dir: str | Path, err: TextIO, *, run: str | None = None, progress: ShowProgress | None = None
) -> RunReport | None:
    """``load_run``, its warnings printed to ``err``; None (the error printed) when the run cannot be read."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = load_run(run_dir, run=run, progress=progress)
    except NanguardError as error:
        _print_warnings(caught, err)
        print(f"nanguard report: error: {error}", file=err, flush=True)
        return None
    _print_warnings(caught, err)
    return report


def _write_page(report: RunReport, html: str | Path, status: Console, err: TextIO) -> Path | None:
    """Write the HTML page with a progress bar on ``status``; None (the error printed) when it cannot be."""
    try:
        from nanguard.report.html import MAX_DETAILED_TRIPS, write_html
    except ImportError as error:  # matplotlib comes with the [report] extra, needed by --html only
        if (error.name or "").split(".")[0] != "matplotlib":
            raise
        print(
            "nanguard report: error: --html draws with matplotlib: pip install 'nanguard[report]'", file=err, flush=True
        )
        return None
    total = 4 + min(len(report.trips), MAX_DETAILED_TRIPS)
    try:
        with status.progress(total, "drawing", echo=False) as advance:
            return write_html(report, html, progress=advance)
    except OSError as error:
        print(f"nanguard report: error: cannot write {html}: {error.strerror or error}", file=err, flush=True)
        return None


def _print_report(report: RunReport, written: Path | None, as_json: bool, out: TextIO) -> None:
    """The report on ``out``: its JSON, or the terminal summary and where the page was written."""
    if as_json:
        data = report.to_dict()
        data["html"] = str(written) if written else None
        print(json.dumps(data, indent=2, allow_nan=False), file=out, flush=True)
        return
    console = Console(out)
    print_summary(report, console)
    if written is not None:
        console.line(f"HTML report: {written}")


def _list_runs(report: RunReport, as_json: bool, out: TextIO) -> int:
    runs = [{"run": r.run, "ranks": sorted(r.lines), "lines": sum(r.lines.values())} for r in report.runs]
    if as_json:
        print(json.dumps({"run_dir": str(report.run_dir), "runs": runs}, indent=2), file=out, flush=True)
        return 0
    console = Console(out)
    console.title(f"nanguard report: {report.run_dir}: {len(runs)} run(s), oldest first")
    rows = [[info.name, ",".join(map(str, sorted(info.lines))), str(sum(info.lines.values()))] for info in report.runs]
    console.table(["run", "ranks", "lines"], rows)
    console.line("show one: nanguard report RUN_DIR --run ID (the latest by default)")
    return 0


def _several(run_dirs: list[str | Path], html: str | Path | None, as_json: bool, out: TextIO, err: TextIO) -> int:
    if len(run_dirs) == 1:
        return run_report(run_dirs[0], html, as_json, out=out, err=err)
    if html is not None:
        print("nanguard report: error: --html takes one RUN_DIR", file=err, flush=True)
        return 2
    reports = []
    for run_dir in run_dirs:
        report = _load(run_dir, err)
        if report is None:
            return 1
        reports.append(report)
    rows = device_rows(record for report in reports for record in report.hardware)
    if as_json:
        data = {"runs": [r.to_dict() for r in reports], "hardware": rows}
        print(json.dumps(data, indent=2, allow_nan=False), file=out, flush=True)
        return 0
    console = Console(out)
    for report in reports:
        print_summary(report, console)
    console.table(list(HARDWARE_COLUMNS), hardware_rows(rows), title=f"Trips per host and device ({len(reports)} runs)")
    return 0


def _print_warnings(caught: list[warnings.WarningMessage], err: TextIO) -> None:
    for w in caught:
        print(f"nanguard report: warning: {w.message}", file=err, flush=True)


def print_summary(report: RunReport, console: Console) -> None:
    """The terminal summary: counts, per-rank table, events, and each diagnosis.

    Example:
        >>> print_summary(load_run("runs/exp1"), Console())
    """
    data = report.to_dict()
    _print_counts(report, data, console)
    console.table(list(RANK_COLUMNS), rank_rows(data))
    _print_events(report, console)
    _print_diagnoses(report, console)
    print_remedies(report, console)
    if report.drills:
        console.table(list(DRILL_COLUMNS), drill_rows([d.to_dict() for d in report.drills]), title="Fire drill")
    _print_hardware(report, console)


def _print_counts(report: RunReport, data: dict[str, Any], console: Console) -> None:
    """The title, which of the directory's runs this is, and the run's counts."""
    counts = data["counts"]
    world = f" (world size {report.world_size})" if report.world_size else ""
    steps = f"steps {data['first_step']}-{data['last_step']}" if data["steps_run"] else "no steps logged"
    console.title(f"nanguard report: {report.run_dir}")
    if len(report.runs) > 1:
        name = report.run if report.run is not None else "(before run ids)"
        console.line(f"run {name}, one of {len(report.runs)} in this directory (--runs lists them, --run ID shows one)")
    console.group(
        f"{len(report.ranks)} rank(s){world}, {steps}: {data['steps_run']} steps run",
        f"trips {counts['trips']}, skips {counts['skips']}, rollbacks {counts['rollbacks']}, "
        f"spikes {counts['spikes']}, overflows {counts['overflows']}, bundles {counts['bundles']}",
    )


def _trip_words(trip: Trip) -> str:
    diag = trip.diagnosis
    if diag is None:
        return f"? -> {trip.action}"
    return f"{diag.cause} -> {trip.action}" + (" (drill: injected)" if diag.evidence.get("injected") else "")


def _print_events(report: RunReport, console: Console) -> None:
    """Trips and every other event, by step (a step's trip first), up to ``_MAX_EVENT_ROWS``."""
    events = [(t.step, "trip", t.ranks, _trip_words(t)) for t in report.trips]
    for marker in [*report.skips, *report.rollbacks, *report.spikes, *report.early_warnings, *report.overflows]:
        events.append((marker.step, marker.kind, marker.ranks, event_words(marker.kind, marker.fields)))
    if not events:
        return
    events.sort(key=lambda e: (e[0], e[1] != "trip"))
    shown = [[str(s), kind, ",".join(str(r) for r in ranks), detail] for s, kind, ranks, detail in events]
    console.table(["step", "event", "ranks", "detail"], shown[:_MAX_EVENT_ROWS])
    if len(shown) > _MAX_EVENT_ROWS:
        console.line(f"... {len(shown) - _MAX_EVENT_ROWS} more events (see --json)")


def _print_diagnoses(report: RunReport, console: Console) -> None:
    """One panel per trip, up to ``_MAX_PANELS``, each with the rank it started on when several ranks ran."""
    for trip in report.trips[:_MAX_PANELS]:
        if trip.diagnosis is None:
            console.line(f"step {trip.step}: trip ({trip.action}) without a readable diagnosis")
            continue
        if len(report.ranks) > 1 and trip.origin_rank is not None:
            console.line(
                f"step {trip.step}: started on rank {trip.origin_rank}, "
                f"non-finite on rank(s) {', '.join(map(str, trip.ranks)) or '-'}"
            )
        console.diagnosis(trip.diagnosis)
    if len(report.trips) > _MAX_PANELS:
        console.line(f"... {len(report.trips) - _MAX_PANELS} more trips (see --html or --json)")
    if not report.trips:
        console.line("no trips: every logged step was finite")


def _print_hardware(report: RunReport, console: Console) -> None:
    """This run's trips per host and device, and how many records in the tracker are other runs'."""
    if report.hardware:
        console.table(
            list(HARDWARE_COLUMNS),
            hardware_rows(device_rows(report.hardware)),
            title="Trips per host and device (this run)",
        )
    if report.hardware_elsewhere:
        console.line(
            f"hardware.jsonl holds {report.hardware_elsewhere} more trip record(s) from other runs in this "
            "directory, not counted here (--run ID shows another run)"
        )


def print_remedies(report: RunReport, console: Console) -> None:
    """The remedies a ``policy="auto"`` guard applied, and modules close to float16 overflow."""
    if report.remedies:
        console.table(list(REMEDY_COLUMNS), remedy_rows(report.remedies[:_MAX_EVENT_ROWS]), title="Remedies")
    close = headroom_rows(report.headroom)
    if close:
        console.table(list(HEADROOM_COLUMNS), close[:_MAX_EVENT_ROWS], title="Close to overflow")
