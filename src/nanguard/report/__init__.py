"""Terminal and HTML reports built from a run's events and bundles.

Example:
    >>> from nanguard.report import load_run, write_html
    >>> report = load_run("runs/exp1")
    >>> write_html(report, "runs/exp1/report.html")
"""

from nanguard.report.html import render_html, write_html
from nanguard.report.load import BundleInfo, Marker, RankLog, RunReport, StepRecord, Trip, load_run
from nanguard.report.main import print_summary, run_report
from nanguard.report.modules import module_stats

__all__ = [
    "BundleInfo",
    "Marker",
    "RankLog",
    "RunReport",
    "StepRecord",
    "Trip",
    "load_run",
    "module_stats",
    "print_summary",
    "render_html",
    "run_report",
    "write_html",
]
