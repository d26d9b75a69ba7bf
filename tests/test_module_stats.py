"""A guarded trip records per-module statistics, and the HTML report shows them.

The guard replays a tripped step once more with forward hooks (``GuardConfig.module_stats``)
and writes the rows into the trip event; ``nanguard report --html`` draws them. These tests
read the trip event and the rendered page of a real guarded run, and check that turning the
statistics off is detected (so the positive test cannot pass on a run that has none).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from nanguard.events import event_path, read_events
from nanguard.guard import Guard
from nanguard.report import load_run, render_html
from nanguard.zoo import build, get, train_step

SCENARIO = "padding_fully_masked"  # a fully masked row: NaN first leaves blocks.0.attn's softmax


def _guarded_run(run_dir: Path, **guard_kwargs: Any) -> Guard:
    torch.set_num_threads(1)
    scenario = get(SCENARIO)
    run = build(scenario, seed=0)
    guard = Guard(run.model, run.optimizer, policy="skip", run_dir=run_dir, **guard_kwargs)
    for _, batch in run.batches(scenario.fault_step + 2):
        guard.step(lambda batch=batch: train_step(run.model, batch), batch=batch)
    guard.close()
    return guard


def _trip_event(run_dir: Path) -> dict[str, Any]:
    trips = [e for e in read_events(event_path(run_dir, 0)) if e["kind"] == "trip"]
    assert len(trips) == 1, trips
    return trips[0]


def _recorded_row(event: dict[str, Any], module: str) -> dict[str, Any] | None:
    """The trip event's per-module row of ``module`` when it shows the fault, else None.

    Showing the fault: the module's output held NaN/Inf, or its finite absmax is large.
    """
    stats = event.get("module_stats")
    if not isinstance(stats, dict):
        return None
    rows = {r["name"]: r for r in stats.get("modules", [])}
    row = rows.get(module)
    if row is None or not (row["nan"] or row["inf"] or (row["absmax"] or 0.0) > 1e4):
        return None
    return row


def _module_svg(html: str, step: int) -> str | None:
    found = re.search(rf'id="plot-modules-{step}".*?(<svg.*?</svg>)', html, re.DOTALL)
    return found.group(1) if found else None


@pytest.fixture(scope="module")
def tripped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Guard]:
    run_dir = tmp_path_factory.mktemp("module-stats")
    return run_dir, _guarded_run(run_dir)


def test_a_guarded_trip_records_the_origin_modules_statistics(tripped: tuple[Path, Guard]) -> None:
    run_dir, guard = tripped
    diag = guard.last_diagnosis
    assert diag is not None and diag.module == "blocks.0.attn"
    event = _trip_event(run_dir)
    assert event["step"] == get(SCENARIO).fault_step
    row = _recorded_row(event, diag.module)
    assert row is not None, event.get("module_stats")
    assert row["type"] == "Attention" and row["nan"] > 0
    rows = {r["name"]: r for r in event["module_stats"]["modules"]}
    assert rows["wte"]["nan"] == 0 and rows["blocks.0.attn.qkv"]["nan"] == 0  # upstream of the origin: finite
    assert rows["lm_head"]["nan"] > 0 and rows["lm_head"]["grad_nan"] > 0  # downstream: NaN in both passes
    assert event["module_stats"]["error"] is None


def test_the_html_report_shows_the_recorded_statistics(tripped: tuple[Path, Guard]) -> None:
    run_dir, _ = tripped
    report = load_run(run_dir)
    trip = report.trips[0]
    assert set(trip.module_stats) == {0}  # from the trip event, nothing attached by the test
    html = render_html(report)
    assert "Per-module statistics: not collected" not in html
    svg = _module_svg(html, trip.step)
    assert svg is not None
    assert "blocks.0.attn (Attention)" in svg and "lm_head (Linear)" in svg and "NaN" in svg


def test_turning_the_statistics_off_is_detected(tmp_path: Path) -> None:
    guard = _guarded_run(tmp_path, module_stats=False)
    diag = guard.last_diagnosis
    assert diag is not None and diag.module == "blocks.0.attn"  # the trip and its diagnosis still happen
    event = _trip_event(tmp_path)
    assert "module_stats" not in event and _recorded_row(event, diag.module) is None
    html = render_html(load_run(tmp_path))
    assert _module_svg(html, event["step"]) is None
    assert "Per-module statistics: not collected" in html
