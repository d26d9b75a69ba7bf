"""Read a run directory: every rank's event log and bundles, merged with steps aligned."""

from __future__ import annotations

import contextlib
import itertools
import re
import warnings
from array import array
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nanguard.errors import BundleError, EventLogError
from nanguard.findings import Diagnosis, jsonable
from nanguard.hardware import TRACKER, device_rows, read_tracker
from nanguard.report.stream import Span, StepRecord, StepSeries, read_rank_log, run_spans

__all__ = [
    "BundleInfo",
    "Drill",
    "Marker",
    "RankLog",
    "RunInfo",
    "RunReport",
    "ShowProgress",
    "StepRecord",
    "Trip",
    "load_run",
    "progress_of",
]

_RANK_FILE = re.compile(r"^events-rank(\d+)\.jsonl$")
_BUNDLE_DIR = re.compile(r"^step-(\d+)-rank-(\d+)$")


@dataclass
class RankLog:
    """What one rank's ``events-rank{R}.jsonl`` holds.

    ``steps`` is the thinned series of step records (sorted; every skipped or non-finite step,
    the first and the last, and enough others for a curve); ``steps_logged`` counts them all.
    """

    rank: int
    path: Path
    series: StepSeries = field(default_factory=StepSeries)
    world_size: int | None = None
    starts: int = 0
    end: dict[str, Any] | None = None
    events: int = 0

    @property
    def steps(self) -> list[StepRecord]:
        return self.series.points

    @property
    def steps_logged(self) -> int:
        return self.series.count

    @property
    def last_step(self) -> int | None:
        return self.series.latest.step if self.series.latest is not None else None


@dataclass(frozen=True)
class RunInfo:
    """One run in a run directory: its id (None: logs written before run ids, read as one run), the
    ranks that logged it and how many lines each wrote."""

    run: str | None
    lines: dict[int, int]

    @property
    def name(self) -> str:
        return self.run if self.run is not None else "(before run ids)"


@dataclass
class BundleInfo:
    """A repro bundle found under ``run_dir/bundles``; ``error`` says why it could not be read."""

    path: Path
    step: int
    rank: int
    cause: str | None = None
    batch_stored: bool | None = None
    error: str | None = None
    run: str | None = None
    diagnosis: Diagnosis | None = field(default=None, repr=False, compare=False)


@dataclass
class Trip:
    """One tripped step, merged over the ranks that logged it.

    ``ranks`` are the ranks whose values were non-finite after the step (the event's
    ``ranks`` and the diagnosis's ``flagged_ranks``), ``reported_by`` the ranks whose log
    holds the trip, and ``module_stats`` each rank's per-module statistics of the replay,
    when the guard recorded them.
    """

    step: int
    action: str
    ranks: list[int]
    reported_by: list[int]
    diagnosis: Diagnosis | None
    module_stats: dict[int, dict[str, Any]] = field(default_factory=dict)
    bundles: list[BundleInfo] = field(default_factory=list)

    @property
    def origin_rank(self) -> int | None:
        """The rank the fault started on: the diagnosis's rank, else the first flagged one."""
        if self.diagnosis is not None and self.diagnosis.rank is not None:
            return self.diagnosis.rank
        if self.ranks:
            return self.ranks[0]
        return self.reported_by[0] if len(self.reported_by) == 1 else None

    def stats_for_origin(self) -> tuple[int, dict[str, Any]] | None:
        """(rank, module_stats) of the origin rank, else of the first rank that has them."""
        if not self.module_stats:
            return None
        origin = self.origin_rank
        rank = origin if origin in self.module_stats else min(self.module_stats)
        return rank, self.module_stats[rank]


@dataclass
class Marker:
    """A skip, rollback, spike or overflow, merged over the ranks that logged it."""

    kind: str
    step: int
    ranks: list[int]
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class Drill:
    """A fault ``nanguard.inject`` planted, and what every rank did about it (its ``drill`` events)."""

    fault: str
    step: int
    kind: str
    rank: int | None
    actions: dict[int, str]
    """Each rank's action at the step (the latest event of a rank wins: a late detection)."""
    detected: bool
    cause: str | None
    seconds: float | None
    """The longest time, over the ranks, from planting to the step's decision."""

    @property
    def agreed(self) -> bool:
        return len(set(self.actions.values())) <= 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "fault": self.fault,
            "step": self.step,
            "kind": self.kind,
            "rank": self.rank,
            "actions": {str(r): a for r, a in sorted(self.actions.items())},
            "agreed": self.agreed,
            "detected": self.detected,
            "cause": self.cause,
            "seconds": self.seconds,
        }


@dataclass
class RunReport:
    """Everything ``nanguard report`` shows about one run directory.

    Example:
        >>> report = load_run("runs/exp1")
        >>> report.steps_run, [t.diagnosis.cause for t in report.trips]
        (200, ['op.masked_softmax'])
    """

    run_dir: Path
    ranks: dict[int, RankLog]
    trips: list[Trip] = field(default_factory=list)
    skips: list[Marker] = field(default_factory=list)
    rollbacks: list[Marker] = field(default_factory=list)
    spikes: list[Marker] = field(default_factory=list)
    early_warnings: list[Marker] = field(default_factory=list)
    """``warning`` events: a run leaving its level, a precursor growing (signal, value, trend, fix)."""
    overflows: list[Marker] = field(default_factory=list)
    remedies: list[Marker] = field(default_factory=list)
    headroom: list[Marker] = field(default_factory=list)
    drills: list[Drill] = field(default_factory=list)
    hardware: list[dict[str, Any]] = field(default_factory=list)
    """The records of ``run_dir/hardware.jsonl`` (``nanguard.hardware``): one per trip and rank."""
    bundles: list[BundleInfo] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    world_size: int | None = None
    run: str | None = None
    """The run shown: its id, None for logs written before run ids."""
    runs: list[RunInfo] = field(default_factory=list)
    """Every run in the directory, oldest first."""
    hardware_elsewhere: int = 0
    """Trips ``hardware.jsonl`` holds from the directory's other runs (not counted in ``hardware``)."""
    _steps: array[int] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def steps(self) -> array[int]:
        """Every step number any rank logged, sorted and distinct: the common x axis."""
        if self._steps is None:
            events = [item.step for group in (self.trips, self.skips, self.rollbacks, self.overflows) for item in group]
            self._steps = array("q", _union([log.series for log in self.ranks.values()], events).tobytes())
        return self._steps

    @property
    def steps_run(self) -> int:
        return len(self.steps)

    def nonfinite_counts(self) -> dict[int, dict[int, int]]:
        """{rank: {step: number of non-finite metrics}}: a logged NaN/Inf loss or grad norm,
        or at least 1 where a trip flagged the rank."""
        counts: dict[int, dict[int, int]] = {r: dict(log.series.nonfinite) for r, log in self.ranks.items()}
        for trip in self.trips:
            for rank in trip.ranks:
                per_rank = counts.setdefault(rank, {})
                per_rank[trip.step] = max(per_rank.get(trip.step, 0), 1)
        return counts

    def to_dict(self) -> dict[str, Any]:
        """The machine-readable summary ``nanguard report --json`` prints."""
        steps = self.steps
        return jsonable(
            {
                "run_dir": str(self.run_dir),
                "run": self.run,
                "runs": [r.run for r in self.runs],
                "world_size": self.world_size,
                "ranks": sorted(self.ranks),
                "steps_run": len(steps),
                "first_step": steps[0] if steps else None,
                "last_step": steps[-1] if steps else None,
                "counts": {
                    "trips": len(self.trips),
                    "skips": len(self.skips),
                    "rollbacks": len(self.rollbacks),
                    "spikes": len(self.spikes),
                    "overflows": len(self.overflows),
                    "bundles": len(self.bundles),
                },
                "per_rank": {str(r): _rank_summary(log, self) for r, log in sorted(self.ranks.items())},
                "trips": [_trip_dict(t) for t in self.trips],
                "skips": [_marker_dict(m) for m in self.skips],
                "rollbacks": [_marker_dict(m) for m in self.rollbacks],
                "spikes": [_marker_dict(m) for m in self.spikes],
                "early_warnings": [_marker_dict(m) for m in self.early_warnings],
                "overflows": [_marker_dict(m) for m in self.overflows],
                "remedies": [_marker_dict(m) for m in self.remedies],
                "drills": [d.to_dict() for d in self.drills],
                "hardware": device_rows(self.hardware),
                "bundles": [_bundle_dict(b) for b in self.bundles],
                "warnings": list(self.warnings),
            }
        )


def _union(series: list[StepSeries], extra: list[int]) -> np.ndarray:
    """The sorted distinct step numbers of every series and of ``extra``.

    Ranks usually log the same rising steps, and the events' steps are among them: then no
    sort is needed, only a look-up of the few extra steps.
    """
    arrays = [np.frombuffer(s.numbers, dtype=np.int64) for s in series]
    arrays = [a if s.ordered else np.unique(a) for a, s in zip(arrays, series, strict=True) if a.size]
    steps = arrays[0] if arrays else np.zeros(0, dtype=np.int64)
    if any(not np.array_equal(a, steps) for a in arrays[1:]):
        steps = np.unique(np.concatenate(arrays))
    wanted = np.unique(np.asarray(extra, dtype=np.int64))
    if not steps.size:
        return wanted
    at = np.searchsorted(steps, wanted)
    new = steps[np.minimum(at, steps.size - 1)] != wanted
    return np.insert(steps, at[new], wanted[new])


def _rank_summary(log: RankLog, report: RunReport) -> dict[str, Any]:
    last = log.series.last_applied
    return {
        "file": str(log.path),
        "events": log.events,
        "steps_logged": log.steps_logged,
        "skipped": len(_not_applied(log, report)),
        "last_step": log.last_step,
        "last_loss": last.loss if last else None,
        "last_grad_norm": last.grad_norm if last else None,
        "trips_originated": sum(1 for t in report.trips if t.origin_rank == log.rank),
        "trips_flagged": sum(1 for t in report.trips if log.rank in t.ranks),
        "finished": log.end is not None,
    }


def _not_applied(log: RankLog, report: RunReport) -> set[int]:
    """Steps whose update this rank did not apply: skipped, dropped, tripped or rolled back."""
    steps = set(log.series.skipped)
    steps.update(m.step for m in [*report.skips, *report.rollbacks] if log.rank in m.ranks)
    steps.update(t.step for t in report.trips if log.rank in t.reported_by)
    return steps


def _trip_dict(trip: Trip) -> dict[str, Any]:
    diag = trip.diagnosis
    return {
        "step": trip.step,
        "action": trip.action,
        "origin_rank": trip.origin_rank,
        "ranks": trip.ranks,
        "reported_by": trip.reported_by,
        "cause": diag.cause if diag else None,
        "injected": bool(diag and diag.evidence.get("injected")),
        "summary": diag.summary() if diag else None,
        "diagnosis": diag.to_dict() if diag else None,
        "module_stats": {str(r): s for r, s in trip.module_stats.items()} or None,
        "bundles": [str(b.path) for b in trip.bundles],
    }


def _marker_dict(marker: Marker) -> dict[str, Any]:
    return {"step": marker.step, "ranks": marker.ranks, **marker.fields}


def _bundle_dict(bundle: BundleInfo) -> dict[str, Any]:
    return {
        "path": str(bundle.path),
        "step": bundle.step,
        "rank": bundle.rank,
        "cause": bundle.cause,
        "batch_stored": bundle.batch_stored,
        "error": bundle.error,
    }


# --------------------------------------------------------------------------- loading

ShowProgress = Callable[[int, str], contextlib.AbstractContextManager[Callable[[str], None]]]


def load_run(run_dir: str | Path, *, run: str | None = None, progress: ShowProgress | None = None) -> RunReport:
    """Read one run of ``run_dir``: every rank's ``events-rank*.jsonl`` lines and bundles of that run,
    into one ``RunReport``. ``run``: its id (``report.runs`` lists them); by default the latest. Logs
    written before run ids are one run; its id is None, and ``run="-"`` picks it.

    Ranks are merged on the guard's step number: a trip, skip or rollback every rank
    logged at the same step is one entry listing those ranks. Unreadable lines, unknown
    event kinds, unreadable bundles and ranks that disagree are collected in
    ``report.warnings`` and also issued as ``UserWarning``. A missing directory, or one
    without any readable event, raises ``EventLogError``. ``progress(total, label)`` is a
    context manager yielding ``advance(message)``, such as ``Console.progress``.

    Example:
        >>> report = load_run("runs/exp1")
        >>> report.to_dict()["counts"]
        {'trips': 1, 'skips': 1, 'rollbacks': 0, 'spikes': 0, 'overflows': 0, 'bundles': 1}
    """
    root = Path(run_dir)
    files = _rank_logs(root)
    spans = {rank: run_spans(path) for rank, path in files}
    runs = _runs(spans)
    report = RunReport(run_dir=root, ranks={}, run=_chosen(root, runs, run), runs=runs)
    # A rank that did not log this run is left out; one that cannot be read stays, to be named.
    files = [(rank, path) for rank, path in files if not spans[rank] or any(s.run == report.run for s in spans[rank])]
    notes: list[str] = []
    per_rank = _read_files(report, files, spans, notes, progress)
    if not any(log.events for log in report.ranks.values()):
        names = ", ".join(p.name for _, p in files)
        _flush(notes)
        raise EventLogError(root, f"no readable events in {names}: the logs are empty or unreadable")
    _merge(report, per_rank)
    if (root / TRACKER).is_file():
        _read_hardware(report, root / TRACKER, notes)
    _check_alignment(report, notes)
    report.warnings = notes
    _flush(notes)
    return report


def _read_files(
    report: RunReport,
    files: list[tuple[int, Path]],
    spans: Mapping[int, list[Span]],
    notes: list[str],
    progress: ShowProgress | None,
) -> dict[int, list[dict[str, Any]]]:
    """Read the report's run from each rank's log (into ``report.ranks``) and its bundles (into
    ``report.bundles``, with every unreadable one); return each rank's events."""
    bundle_dirs = _bundle_dirs(report.run_dir)
    per_rank: dict[int, list[dict[str, Any]]] = {}
    with progress_of(progress, len(files) + len(bundle_dirs), "reading run") as advance:
        for rank, path in files:
            mine = [s for s in spans[rank] if s.run == report.run] if spans[rank] else None
            log, per_rank[rank] = _read_rank(rank, path, notes, mine)
            report.ranks[rank] = log
            advance(f"{path.name}: {log.events} events")
        for step, rank, path in bundle_dirs:
            bundle = _read_bundle(path, step, rank, notes)
            if bundle.error is not None or bundle.run == report.run:
                report.bundles.append(bundle)
            advance(f"bundle {path.name}")
    return per_rank


def _rank_logs(root: Path) -> list[tuple[int, Path]]:
    """(rank, path) of every rank's event log in ``root``, by rank; a missing or empty run dir raises."""
    if not root.exists():
        raise EventLogError(root, "no such run directory")
    if not root.is_dir():
        raise EventLogError(root, "not a directory: pass the run_dir the Guard wrote to")
    files = sorted(
        ((int(m.group(1)), p) for p in root.iterdir() if (m := _RANK_FILE.match(p.name)) and p.is_file()),
        key=lambda item: item[0],
    )
    if not files:
        raise EventLogError(root, _no_logs_here(root))
    return files


def _read_hardware(report: RunReport, path: Path, notes: list[str]) -> None:
    """The hardware tracker's records of the report's run (and how many came from other runs)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = read_tracker(path)
    notes.extend(str(w.message) for w in caught)
    report.hardware = [r for r in records if r.get("run") == report.run]
    report.hardware_elsewhere = len(records) - len(report.hardware)


def _runs(spans: Mapping[int, list[Span]]) -> list[RunInfo]:
    """The runs the rank logs hold, oldest first: logs before run ids, then by the second each started (an
    id's head) and, within one second, by the order a log appended them."""
    lines: dict[str | None, dict[int, int]] = defaultdict(dict)
    order: dict[str | None, int] = {}
    for rank, found in spans.items():
        for i, span in enumerate(found):
            lines[span.run][rank] = lines[span.run].get(rank, 0) + span.lines
            order[span.run] = min(order.get(span.run, i), i)
    return [RunInfo(r, lines[r]) for r in sorted(lines, key=lambda r: (r is not None, (r or "")[:15], order[r]))]


def _chosen(root: Path, runs: list[RunInfo], run: str | None) -> str | None:
    """The run to show: ``run`` ("-": the one before run ids), else the latest."""
    if run is None:
        return runs[-1].run if runs else None
    wanted = None if run == "-" else run
    if not any(r.run == wanted for r in runs):
        known = ", ".join(r.run if r.run is not None else "- (before run ids)" for r in runs) or "none"
        raise EventLogError(root, f"no run {run!r} in this run directory; its runs: {known}")
    return wanted


def _no_logs_here(root: Path) -> str:
    """Why ``root`` has nothing to report, and the folders below it (two levels) that do."""
    below = sorted(
        {p.parent for pattern in ("*/events-rank*.jsonl", "*/*/events-rank*.jsonl") for p in root.glob(pattern)}
    )
    if not below:
        return "no event logs (events-rank*.jsonl) here: was the Guard given run_dir=?"
    shown = ", ".join(str(p) for p in below[:5]) + (f" and {len(below) - 5} more" if len(below) > 5 else "")
    return f"no event logs (events-rank*.jsonl) here, but below it: {shown}; run: nanguard report {below[0]}"


@contextlib.contextmanager
def progress_of(progress: ShowProgress | None, total: int, label: str) -> Iterator[Callable[[str], None]]:
    """``progress``'s advance callback for ``total`` items, or a no-op when there is no progress display."""
    if progress is None:
        yield lambda message: None
        return
    with progress(total, label) as advance:
        yield advance


def _flush(notes: list[str]) -> None:
    for note in notes:
        warnings.warn(note, UserWarning, stacklevel=3)


def _bundle_dirs(root: Path) -> list[tuple[int, int, Path]]:
    folder = root / "bundles"
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), int(m.group(2)), p) for p in folder.iterdir() if (m := _BUNDLE_DIR.match(p.name))]
    return sorted(found, key=lambda item: (item[0], item[1]))


def _read_rank(
    rank: int, path: Path, notes: list[str], spans: list[Span] | None
) -> tuple[RankLog, list[dict[str, Any]]]:
    found = read_rank_log(path, rank, notes, spans)
    log = RankLog(
        rank=rank,
        path=path,
        series=found.steps,
        world_size=found.world_size,
        starts=found.starts,
        end=found.end,
        events=found.count,
    )
    return log, found.events


def _read_bundle(path: Path, step: int, rank: int, notes: list[str]) -> BundleInfo:
    from nanguard.bundle import load_bundle

    info = BundleInfo(path=path, step=step, rank=rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            bundle = load_bundle(path)
        except BundleError as err:
            info.error = err.problem
            notes.append(f"skipping unreadable bundle {err}")
            return info
    notes.extend(str(w.message) for w in caught)
    info.batch_stored = bundle.batch_stored
    run = bundle.meta.get("run")
    info.run = run if isinstance(run, str) else None
    if bundle.diagnosis is not None:
        info.cause = bundle.diagnosis.cause
        info.diagnosis = bundle.diagnosis
    return info


_MERGE_KEYS: dict[str, Callable[[dict[str, Any]], tuple[Any, ...]]] = {
    "trip": lambda e: (),
    "skip": lambda e: (str(e.get("reason")),),
    "rollback": lambda e: (e.get("restored_step"),),
    "spike": lambda e: (str(e.get("metric")),),
    "warning": lambda e: (str(e.get("signal")), str(e.get("module"))),
    "overflow": lambda e: (),
    "remedy": lambda e: (str(e.get("cause")), str(e.get("action"))),
    "headroom": lambda e: (str(e.get("module")), str(e.get("dtype"))),
    "drill": lambda e: (str(e.get("fault")),),
}
"""What makes two ranks' events of a kind at one step the same entry, besides the step."""

_Merged = dict[tuple[Any, ...], list[tuple[int, dict[str, Any]]]]


def _merge(report: RunReport, per_rank: Mapping[int, list[dict[str, Any]]]) -> None:
    """Fold each rank's trip/skip/rollback/spike/overflow events into entries keyed by step."""
    merged = _by_step(per_rank)
    report.trips.extend(_merge_trip(entries) for entries in merged["trip"].values())
    report.drills = _merge_drills(merged["drill"])
    report.trips.sort(key=lambda t: t.step)
    for kind, target in (
        ("skip", report.skips),
        ("rollback", report.rollbacks),
        ("spike", report.spikes),
        ("warning", report.early_warnings),
        ("overflow", report.overflows),
        ("remedy", report.remedies),
        ("headroom", report.headroom),
    ):
        target.extend(_marker(kind, entries) for entries in merged[kind].values())
        target.sort(key=lambda m: m.step)

    by_key = {(b.step, b.rank): b for b in report.bundles}
    for trip in report.trips:
        trip.bundles = [by_key[(trip.step, r)] for r in trip.reported_by if (trip.step, r) in by_key]
    _trips_only_bundled(report)


def _by_step(per_rank: Mapping[int, list[dict[str, Any]]]) -> dict[str, _Merged]:
    """Each kind's events by (step, its ``_MERGE_KEYS``, n): the ranks' n-th identical events are one entry."""
    merged: dict[str, _Merged] = defaultdict(dict)
    for rank, events in sorted(per_rank.items()):
        seen: dict[tuple[Any, ...], int] = defaultdict(int)
        for event in events:
            kind = event["kind"]
            key = (event["step"], *_MERGE_KEYS[kind](event))
            seen_key = (kind, *key)
            nth = seen[seen_key]
            seen[seen_key] += 1
            # The n-th identical event of each rank is one merged entry (a resumed run may repeat steps).
            merged[kind].setdefault((*key, nth), []).append((rank, event))
    return merged


def _marker(kind: str, entries: list[tuple[int, dict[str, Any]]]) -> Marker:
    """One entry of the ranks' events: the first rank's fields, and each rank's value of a spike."""
    first = entries[0][1]
    fields = {k: v for k, v in first.items() if k not in ("kind", "step", "rank") and not k.startswith("_")}
    if kind == "spike" and len(entries) > 1:
        fields["value_by_rank"] = {str(r): e.get("value") for r, e in entries}
    return Marker(kind=kind, step=first["step"], ranks=[r for r, _ in entries], fields=fields)


def _trips_only_bundled(report: RunReport) -> None:
    """A bundle whose trip event is missing (a log cut short by a killed run) is a trip all the same:
    the diagnosis it holds is shown, its action unknown."""
    logged = {t.step for t in report.trips}
    for bundle in report.bundles:
        if bundle.step in logged or bundle.diagnosis is None:
            continue
        logged.add(bundle.step)
        same = [b for b in report.bundles if b.step == bundle.step and b.diagnosis is not None]
        report.trips.append(
            Trip(
                step=bundle.step,
                action="? (from its bundle: not in the event log)",
                ranks=[b.rank for b in same],
                reported_by=[b.rank for b in same],
                diagnosis=bundle.diagnosis,
                bundles=same,
            )
        )
    report.trips.sort(key=lambda t: t.step)


def _merge_drills(merged: _Merged) -> list[Drill]:
    """One ``Drill`` per planted fault; a rank's late event (a detection on the next step) overrides its first."""
    drills: dict[tuple[int, str], Drill] = {}
    for entries in merged.values():
        for rank, event in entries:
            key = (event["step"], str(event.get("fault")))
            fault_rank = event.get("fault_rank")
            drill = drills.setdefault(
                key,
                Drill(
                    fault=key[1],
                    step=key[0],
                    kind=str(event.get("fault_kind")),
                    rank=fault_rank if isinstance(fault_rank, int) else None,
                    actions={},
                    detected=False,
                    cause=None,
                    seconds=None,
                ),
            )
            drill.actions[rank] = str(event.get("action"))
            drill.detected = drill.detected or event.get("detected") is not False
            drill.cause = event.get("cause") if isinstance(event.get("cause"), str) else drill.cause
            seconds = event.get("seconds")
            if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
                drill.seconds = max(drill.seconds or 0.0, float(seconds))
    return sorted(drills.values(), key=lambda d: (d.step, d.fault))


def _merge_trip(entries: list[tuple[int, dict[str, Any]]]) -> Trip:
    step = entries[0][1]["step"]
    diagnosis = None
    flagged: set[int] = set()
    stats: dict[int, dict[str, Any]] = {}
    for rank, event in entries:
        flagged.update(event.get("ranks") or [])
        diag = event.get("_diagnosis")
        if diag is not None:
            ranks = diag.evidence.get("flagged_ranks")
            if isinstance(ranks, list):
                flagged.update(r for r in ranks if isinstance(r, int) and not isinstance(r, bool))
            diagnosis = diagnosis or diag
        if isinstance(event.get("module_stats"), Mapping):
            stats[rank] = dict(event["module_stats"])
    return Trip(
        step=step,
        action=str(entries[0][1].get("action", "?")),
        ranks=sorted(flagged),
        reported_by=[r for r, _ in entries],
        diagnosis=diagnosis,
        module_stats=stats,
    )


def _check_alignment(report: RunReport, notes: list[str]) -> None:
    """Set the run's world size; note where the ranks' logs disagree on it, miss a rank or end apart."""
    sizes = {log.world_size for log in report.ranks.values() if log.world_size is not None}
    report.world_size = max(sizes) if sizes else None
    if len(sizes) > 1:
        notes.append(f"the ranks' logs disagree on world_size ({sorted(sizes)}): several runs share this run_dir?")
    notes.extend(_missing_ranks(report))
    notes.extend(_uneven_ends(report))


def _missing_ranks(report: RunReport) -> list[str]:
    """A note naming the ranks below the world size without a log (the first 8)."""
    if report.world_size is None:
        return []
    present = {r for r in report.ranks if r < report.world_size}
    if len(present) >= report.world_size:
        return []
    missing = list(itertools.islice((r for r in range(report.world_size) if r not in present), 8))
    more = report.world_size - len(present) - len(missing)
    listed = ", ".join(map(str, missing)) + (f" and {more} more" if more else "")
    return [f"world_size is {report.world_size} but there is no event log for rank(s) {listed}"]


def _uneven_ends(report: RunReport) -> list[str]:
    """A note naming the ranks whose logs end before the latest step any rank logged."""
    ends = {r: log.last_step for r, log in report.ranks.items() if log.last_step is not None}
    if len(set(ends.values())) <= 1:
        return []
    last = max(ends.values())
    behind = ", ".join(f"rank {r} at step {s}" for r, s in sorted(ends.items()) if s < last)
    return [f"the ranks' logs end at different steps (latest {last}; {behind}): a rank stopped early?"]
