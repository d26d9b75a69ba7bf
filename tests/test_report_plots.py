"""Plots of long and repeatedly tripping runs stay readable: a trend line, grouped trip labels."""

import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from nanguard.report import stream
from nanguard.report.load import load_run
from nanguard.report.plots import figure_svg, group_trips, loss_plot, rank_plot, smooth
from nanguard.zoo.runs import write_noisy_run
from test_report import _not_blank, browser  # noqa: F401  (the headless Chromium fixture)


def test_smooth_averages_windows_and_skips_gaps() -> None:
    x = np.arange(6000.0)
    y = np.where(x % 2 == 0, 1.0, 3.0)
    y[:30] = math.nan  # the first window is all gap
    sx, sy = smooth(x, y)
    assert len(sx) == 200 and math.isnan(sy[0]) and np.allclose(sy[1:], 2.0)


def test_long_run_draws_a_trend_line_with_its_text_searchable(tmp_path: Path) -> None:
    svg = figure_svg(loss_plot(load_run(write_noisy_run(tmp_path, 6000, range(0)))))
    assert "mean of 30" in svg  # the legend names the smoothing window, as text (not paths)
    assert svg.count("<path") < 20_000  # decimated: not one path point per step


def test_the_page_does_not_grow_with_thewrite_noisy_run(tmp_path: Path) -> None:
    from nanguard.report.html import render_html

    short = render_html(load_run(write_noisy_run(tmp_path / "short", 6000, range(3000, 3008))))
    long = render_html(load_run(write_noisy_run(tmp_path / "long", 30_000, range(3000, 3008))))
    assert len(long) < 1.3 * len(short)  # curves are thinned to a fixed number of points
    stride = next(s for s in (1, 2, 4, 8, 16) if s * stream.MAX_POINTS >= 30_000)  # the reader's thinning
    assert "faint: every step; line: mean of 30 steps" in short
    assert f"faint: 1 in {stride} steps; line: mean of" in long  # the legend says what a point is
    assert len(short) < 250_000  # the same page with base64 images and 3000-point curves was 320 KB


def test_many_trips_get_one_grouped_label(tmp_path: Path) -> None:
    report = load_run(write_noisy_run(tmp_path, 40, range(3, 11)))
    assert [g[:3] for g in group_trips(report.trips)] == [(3, 10, 8)]
    svg = figure_svg(rank_plot(report))
    assert "8 trips, steps 3–10, precision.overflow" in svg
    assert svg.count("precision.overflow") == 1


def test_trips_spread_over_a_long_run_share_a_label_per_cluster(tmp_path: Path) -> None:
    report = load_run(write_noisy_run(tmp_path, 6000, [1000, 1500, 2000, 4500]))  # a label spans ~1/4 of the axis
    assert len(group_trips(report.trips)) == 4  # not consecutive: four cards
    svg = figure_svg(rank_plot(report))
    assert "3 trips, steps 1000–2000, precision.overflow (origin)" in svg
    assert ">precision.overflow (origin)<" in svg  # the trip at 4500, 2500 steps on, has its own
    assert svg.count("precision.overflow") == 2


def test_html_groups_repeated_trips_into_one_card(tmp_path: Path) -> None:
    from nanguard.report.html import render_html

    page = render_html(load_run(write_noisy_run(tmp_path, 40, range(3, 11))))
    assert "8 trips in a row with this cause, steps 3–10 (8)" in page
    assert "<td>3–10 (8)</td>" in page
    assert page.count('<section class="diagnosis"') == 1


def test_long_many_trip_run_in_chromium(tmp_path: Path, browser) -> None:  # noqa: F811
    from nanguard.cli import main

    run_dir = write_noisy_run(tmp_path / "run", 6000, range(3000, 3008))
    out = tmp_path / "report.html"
    assert main(["report", str(run_dir), "--html", str(out)]) == 0
    label = "8 trips, steps 3000–3007, precision.overflow (origin)"
    page = browser.open(out, find=(label, "mean of 30"))
    assert page.console_errors() == []
    assert _not_blank(page.screenshot) > 0.05
    assert all(p["drawn"] > 300 and p["width"] > 300 for p in page.info["plots"])
    plots = {p["id"]: p["texts"] for p in page.info["plots"]}
    assert "step" in plots["plot-loss"] and "loss (log)" in plots["plot-loss"]  # axis labels are text
    assert label in plots["plot-ranks"]  # the grouped trip label too
    assert page.info["found"] == [label, "mean of 30"]  # and the browser's find-in-page finds them
    assert "8 trips in a row with this cause, steps 3000–3007 (8)" in page.text
    html = out.read_text(encoding="utf-8")
    assert html.count('<section class="diagnosis"') == 1  # one card, not eight
    assert "<img" not in html and html.count("<svg") == 4


def test_the_diagnoses_table_counts_the_groups_past_its_cap(tmp_path: Path, monkeypatch) -> None:
    from nanguard.report import html

    trips = range(10, 200, 10)  # 19 trips, none adjacent: 19 groups
    monkeypatch.setattr(html, "MAX_SUMMARY_ROWS", 5)
    page = html.render_html(load_run(write_noisy_run(tmp_path, 400, trips)))
    table = page[page.index('<table class="trips"') : page.index("</table>", page.index('<table class="trips"'))]
    assert table.count("<tr>") == 1 + 5 + 1  # the header, five groups, one row for the rest
    assert "<td>60–190 (14)</td>" in table
    assert "14 more groups: 14 precision.overflow" in table
