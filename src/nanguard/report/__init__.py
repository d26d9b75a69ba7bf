"""Terminal and HTML reports built from a run's events and bundles.

Names load on first use, so ``nanguard demo`` (which only needs the terminal) does not
import matplotlib.

Example:
    >>> from nanguard.report import load_run, write_html
    >>> report = load_run("runs/exp1")
    >>> write_html(report, "runs/exp1/report.html")
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanguard.report.html import render_html, write_html
    from nanguard.report.load import BundleInfo, Marker, RankLog, RunReport, StepRecord, Trip, load_run
    from nanguard.report.main import print_summary, run_report

__all__ = [
    "BundleInfo",
    "Marker",
    "RankLog",
    "RunReport",
    "StepRecord",
    "Trip",
    "load_run",
    "print_summary",
    "render_html",
    "run_report",
    "write_html",
]

_WHERE = {
    **dict.fromkeys(("BundleInfo", "Marker", "RankLog", "RunReport", "StepRecord", "Trip", "load_run"), "load"),
    **dict.fromkeys(("render_html", "write_html"), "html"),
    **dict.fromkeys(("print_summary", "run_report"), "main"),
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"nanguard.report.{_WHERE[name]}"), name)
