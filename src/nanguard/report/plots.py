"""The report's plots, drawn with matplotlib's object API and returned as SVG text.

No pyplot: figures are built as ``matplotlib.figure.Figure`` objects and saved through
the SVG canvas, so drawing a report never touches the caller's backend or global figures.
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ParamSpec, TypeGuard

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, NullFormatter

from nanguard.report.load import RunReport, Trip
from nanguard.report.stream import StepRecord
from nanguard.text import number

__all__ = [
    "MAX_POINTS",
    "SMOOTH_FROM",
    "decimate",
    "figure_svg",
    "grad_norm_plot",
    "group_label",
    "group_trips",
    "loss_plot",
    "module_plot",
    "nonfinite_plot",
    "rank_plot",
    "smooth",
    "trip_groups",
]

P = ParamSpec("P")

MAX_POINTS = 1500
"""Points per rank and curve above which a curve is thinned to each bucket's first, min and max: about
one bucket per pixel of the plot's width, so the page stays small and the drawn curve the same."""
SMOOTH_FROM = 1000
"""Curves longer than this get a smoothed trend line over a faint every-step curve."""
_MAX_MODULE_ROWS = 48

_RC: dict[Any, Any] = {
    "svg.fonttype": "none",
    "svg.hashsalt": "nanguard",
    "font.size": 9,
    "font.sans-serif": ["DejaVu Sans", "Arial", "Helvetica"],  # also the fallbacks the SVG text names
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "figure.dpi": 100,
}
_COLORS = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#7f7f7f", "#bcbd22", "#e377c2")
_TRIP = "#d62728"
_SKIP = "#ff7f0e"
_ROLLBACK = "#6a3d9a"
_SPIKE = "#e6ab02"
_OVERFLOW = "#a6761d"
_WARNING = "#b15928"


def _rank_color(rank: int) -> str:
    return _COLORS[rank % len(_COLORS)]


def figure_svg(fig: Figure) -> str:
    """The figure as standalone SVG text.

    Example:
        >>> svg = figure_svg(loss_plot(report))
        >>> svg.startswith("<?xml")
        True
    """
    buf = io.StringIO()
    with matplotlib.rc_context(_RC):
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    return buf.getvalue()


def _styled(draw: Callable[P, Figure]) -> Callable[P, Figure]:
    """Build the figure under the report's rc settings (they are read as artists are made)."""

    @functools.wraps(draw)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> Figure:
        with matplotlib.rc_context(_RC):
            return draw(*args, **kwargs)

    return wrapper


def _figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), layout="constrained")


def decimate(x: np.ndarray, y: np.ndarray, max_points: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """Thin a long curve to each bucket's first, min and max points, so spikes survive.

    Example:
        >>> x, y = decimate(np.arange(10**6), np.random.rand(10**6))
        >>> len(x) <= 3 * MAX_POINTS // 2 + 3
        True
    """
    if len(x) <= max_points:
        return x, y
    buckets = max(1, max_points // 2)
    keep: list[int] = []
    for chunk in np.array_split(np.arange(len(x)), buckets):
        vals = y[chunk]
        finite = np.isfinite(vals)
        picks = {int(chunk[0])}
        if finite.any():
            idx = chunk[finite]
            picks.add(int(idx[np.argmin(vals[finite])]))
            picks.add(int(idx[np.argmax(vals[finite])]))
        if not finite.all():
            picks.add(int(chunk[~finite][0]))  # keep a gap where the curve breaks
        keep.extend(sorted(picks))
    order = np.asarray(keep)
    return x[order], y[order]


def _window(n: int) -> int:
    return max(2, n // 200)


def smooth(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The curve's mean over windows of about len/200 steps (NaN gaps left out), one point per window.

    Example:
        >>> sx, sy = smooth(np.arange(6000.0), np.ones(6000))
        >>> len(sx), float(sy[0])
        (200, 1.0)
    """
    window = _window(len(x))
    n = len(x) // window * window
    xs = x[:n].reshape(-1, window)
    ys = y[:n].reshape(-1, window)
    counts = np.isfinite(ys).sum(axis=1)
    sums = np.where(np.isfinite(ys), ys, 0.0).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.where(counts > 0, sums / np.maximum(counts, 1), math.nan)
    return xs.mean(axis=1), means


def trip_groups(trips: Sequence[Trip]) -> list[list[Trip]]:
    """Consecutive trips (adjacent steps) of one cause together, in step order.

    Example:
        >>> [[t.step for t in g] for g in trip_groups(report.trips)]
        [[3, 4, 5, 6, 7, 8, 9, 10]]
    """
    groups: list[list[Trip]] = []
    for trip in sorted(trips, key=lambda t: t.step):
        if groups and _cause(groups[-1][-1]) == _cause(trip) and trip.step - groups[-1][-1].step <= 1:
            groups[-1].append(trip)
        else:
            groups.append([trip])
    return groups


def _cause(trip: Trip) -> str:
    return trip.diagnosis.cause if trip.diagnosis else "trip"


def group_trips(trips: Sequence[Trip], gap: int = 1) -> list[tuple[int, int, int, str]]:
    """Trips as (first step, last step, count, cause): ``trip_groups`` by default; with a wider
    ``gap``, each cause's trips within ``gap`` steps of the one before it together.

    Example:
        >>> [g[:3] for g in group_trips(report.trips)]
        [(3, 10, 8)]
    """
    if gap <= 1:
        groups = trip_groups(trips)
    else:
        groups = []
        for cause in dict.fromkeys(_cause(t) for t in trips):
            for trip in sorted((t for t in trips if _cause(t) == cause), key=lambda t: t.step):
                if groups and _cause(groups[-1][-1]) == cause and trip.step - groups[-1][-1].step <= gap:
                    groups[-1].append(trip)
                else:
                    groups.append([trip])
    return [(g[0].step, g[-1].step, len(g), _cause(g[0])) for g in groups]


def group_label(first: int, last: int, count: int, cause: str) -> str:
    """'8 trips, steps 3–10, precision.overflow', or 'precision.overflow' for one trip."""
    return cause if count == 1 else f"{count} trips, steps {first}–{last}, {cause}"


def _series(report: RunReport, rank: int, metric: str) -> tuple[np.ndarray, np.ndarray]:
    log = report.ranks[rank]
    logged = {s.step for s in log.steps}
    # A tripped or dropped step has no step line under rollback: a NaN point breaks the curve there.
    holes = {t.step for t in report.trips} | {m.step for m in [*report.skips, *report.rollbacks]}
    points = [(s.step, getattr(s, metric)) for s in log.steps] + [(h, None) for h in holes - logged]
    points.sort(key=lambda p: p[0])
    x = np.fromiter((p[0] for p in points), dtype=float, count=len(points))
    y = np.fromiter((p[1] if p[1] is not None else math.nan for p in points), dtype=float, count=len(points))
    # Non-finite and non-positive values leave a gap: the non-finite plot counts them.
    y[~np.isfinite(y)] = math.nan
    return x, y


def _number_label(value: float, _pos: Any = None) -> str:
    return f"{value:.4g}"


def _set_scale(ax: Axes, values: Sequence[np.ndarray]) -> None:
    finite = np.concatenate([v[np.isfinite(v)] for v in values]) if values else np.array([])
    if finite.size and (finite <= 0).any():
        positive = np.abs(finite[finite != 0])
        ax.set_yscale("symlog", linthresh=float(positive.min()) if positive.size else 1.0)
    else:
        ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(_number_label))
    narrow = finite.size and finite.min() > 0 and finite.max() / finite.min() < 100
    # Within two decades the labelled ticks are minor ones; over more, minor labels only clutter.
    ax.yaxis.set_minor_formatter(FuncFormatter(_number_label) if narrow else NullFormatter())


def _metric_plot(report: RunReport, metric: str, label: str) -> Figure:
    fig = _figure(10, 3.4)
    ax = fig.add_subplot()
    curves = []
    handles: list[Any] = []
    multi = len(report.ranks) > 1
    series = {rank: _series(report, rank, metric) for rank in sorted(report.ranks)}
    if multi and _identical(list(series.values())):
        # A global value (the all-reduced grad norm) is the same on every rank: one curve says it.
        series = {min(series): series[min(series)]}
        multi = False
        label_all = f"{label} (same on all ranks)"
    else:
        label_all = label
    for rank, (x, y) in series.items():
        name = f"rank {rank}" if multi else label_all
        long_run = len(x) > SMOOTH_FROM
        if long_run:
            # Thousands of noisy steps draw a solid band: keep it faint and draw the trend on top.
            sx, sy = smooth(x, y)
            ax.plot(sx, sy, color=_rank_color(rank), lw=1.8, zorder=3)
            name += f" (faint: {_every(x)}; line: mean of {round(_window(len(x)) * _spacing(x))} steps)"
        x, y = decimate(x, y)
        curves.append(y)
        (line,) = ax.plot(
            x, y, color=_rank_color(rank), lw=0.6 if long_run else 1.3, alpha=0.35 if long_run else 1.0, label=name
        )
        handles.append(line)
    _set_scale(ax, curves)
    ax.set_xlabel("step")
    ax.set_ylabel(f"{label} (log)")
    handles += _mark_events(ax, report, metric)
    if not any(np.isfinite(c).any() for c in curves):
        ax.text(0.5, 0.5, f"no finite {label} logged", transform=ax.transAxes, ha="center", va="center")
    # The legend sits outside the axes, right of the plot: never on the data.
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, framealpha=0.85)
    ax.set_title(f"{label} per step" + (" per rank" if multi else ""), loc="left")
    return fig


def _spacing(x: np.ndarray) -> float:
    """Steps between the points of a curve: 1, or the reader's stride on a thinned long log."""
    return float(np.median(np.diff(x))) if len(x) > 1 else 1.0


def _every(x: np.ndarray) -> str:
    spacing = round(_spacing(x))
    return "every step" if spacing <= 1 else f"1 in {spacing} steps"


def _identical(series: list[tuple[np.ndarray, np.ndarray]]) -> bool:
    x0, y0 = series[0]
    return all(
        len(x) == len(x0) and np.array_equal(x, x0) and np.allclose(y, y0, rtol=1e-6, equal_nan=True)
        for x, y in series[1:]
    )


_DENSE = 60
"""Events per plot above which their lines and markers are drawn thin and faint, so hundreds of
trips over a long run mark where they fall instead of painting the plot red."""


def _weight(count: int) -> tuple[float, float, float]:
    """(line width, line alpha, marker area scale) for ``count`` events of one kind."""
    return (1.6, 0.9, 1.0) if count <= _DENSE else (0.5, 0.35, 0.4)


def _mark_events(ax: Axes, report: RunReport, metric: str) -> list[Any]:
    """Draw the run's events on a curve's axes; return their legend handles, in the order drawn."""
    return [
        *_mark_skips(ax, report),
        *_mark_rollbacks(ax, report),
        *_mark_trips(ax, report),
        *_mark_warnings(ax, report),
        *_mark_spikes(ax, report, metric),
    ]


def _mark_skips(ax: Axes, report: RunReport) -> list[Any]:
    skip_steps = [m.step for m in report.skips]
    if not skip_steps:
        return []
    lw, alpha, area = _weight(len(skip_steps))
    ax.vlines(skip_steps, 0, 1, transform=ax.get_xaxis_transform(), colors=_SKIP, lw=lw * 0.6, ls=":", alpha=alpha)
    # A skip usually shares its step with a trip: its marker sits above the trip's line and X.
    ax.scatter(
        skip_steps,
        [0.9] * len(skip_steps),
        transform=ax.get_xaxis_transform(),
        marker="v",
        s=36 * area,
        color=_SKIP,
        edgecolors="black",
        linewidths=0.4,
        zorder=7,
    )
    return [Line2D([], [], color=_SKIP, ls=":", marker="v", label=f"skip ({len(skip_steps)})")]


def _mark_rollbacks(ax: Axes, report: RunReport) -> list[Any]:
    """Each rollback's line, the steps it undid shaded back to the step it restored."""
    for m in report.rollbacks:
        restored = m.fields.get("restored_step")
        if isinstance(restored, int) and restored < m.step:
            ax.axvspan(restored, m.step, color=_ROLLBACK, alpha=0.08, lw=0)
    if not report.rollbacks:
        return []
    steps = [m.step for m in report.rollbacks]
    ax.vlines(steps, 0, 1, transform=ax.get_xaxis_transform(), colors=_ROLLBACK, lw=1.6, ls="--")
    return [Line2D([], [], color=_ROLLBACK, ls="--", label=f"rollback ({len(steps)})")]


def _mark_trips(ax: Axes, report: RunReport) -> list[Any]:
    if not report.trips:
        return []
    steps = [t.step for t in report.trips]
    lw, alpha, area = _weight(len(steps))
    ax.vlines(steps, 0, 1, transform=ax.get_xaxis_transform(), colors=_TRIP, lw=lw, alpha=min(1.0, alpha + 0.1))
    ax.scatter(
        steps,
        [0.97] * len(steps),
        transform=ax.get_xaxis_transform(),
        marker="X",
        s=50 * area,
        color=_TRIP,
        zorder=5,
    )
    return [Line2D([], [], color=_TRIP, marker="X", label=f"trip ({len(steps)})")]


def _mark_warnings(ax: Axes, report: RunReport) -> list[Any]:
    if not report.early_warnings:
        return []
    steps = [m.step for m in report.early_warnings]
    ax.vlines(steps, 0, 1, transform=ax.get_xaxis_transform(), colors=_WARNING, lw=1.2, ls="-.", alpha=0.8)
    return [Line2D([], [], color=_WARNING, ls="-.", label=f"early warning ({len(steps)})")]


def _mark_spikes(ax: Axes, report: RunReport, metric: str) -> list[Any]:
    """A star at each finite spike of ``metric``; the legend counts every spike of it."""
    spikes = [m for m in report.spikes if m.fields.get("metric") == metric]
    if not spikes:
        return []
    values = [number(m.fields.get("value")) for m in spikes]
    pts = [(m.step, v) for m, v in zip(spikes, values, strict=True) if v is not None and math.isfinite(v)]
    if pts:
        xs, ys = zip(*pts, strict=True)
        ax.scatter(xs, ys, marker="*", s=110 * _weight(len(pts))[2], color=_SPIKE, edgecolors="black", lw=0.5, zorder=6)
    return [Line2D([], [], color=_SPIKE, marker="*", ls="", markeredgecolor="black", label=f"spike ({len(spikes)})")]


@_styled
def loss_plot(report: RunReport) -> Figure:
    """Loss over steps on a log scale, one curve per rank, with trips, skips, rollbacks and spikes.

    Example:
        >>> svg = figure_svg(loss_plot(load_run("runs/exp1")))
    """
    return _metric_plot(report, "loss", "loss")


@_styled
def grad_norm_plot(report: RunReport) -> Figure:
    """Gradient norm over steps on a log scale, marked like ``loss_plot``.

    Example:
        >>> svg = figure_svg(grad_norm_plot(load_run("runs/exp1")))
    """
    return _metric_plot(report, "grad_norm", "gradient norm")


@_styled
def precursor_plot(report: RunReport) -> Figure:
    """Each precursor warning's samples (log scale) with the level its mechanism blows up at, dashed.

    Example:
        >>> svg = figure_svg(precursor_plot(load_run("runs/exp1")))
    """
    fig = _figure(8, 3.2)
    ax = fig.add_subplot(1, 1, 1)
    for i, m in enumerate(report.early_warnings):
        series = m.fields.get("series")
        if not isinstance(series, list) or not series:
            continue
        pts = [(number(p[0]), number(p[1])) for p in series if isinstance(p, list) and len(p) == 2]
        pts = [(x, y) for x, y in pts if x is not None and y is not None and y > 0]
        if not pts:
            continue
        color = _COLORS[i % len(_COLORS)]
        xs, ys = zip(*pts, strict=True)
        label = f"{m.fields.get('signal')} of {m.fields.get('module')}"
        ax.plot(xs, ys, marker="o", color=color, label=label)
        limit = number(m.fields.get("limit"))
        left = number(m.fields.get("steps_left"))
        if limit is not None and left is not None:
            ax.plot([xs[-1], xs[-1] + left], [ys[-1], limit], ls=":", color=color)
            ax.axhline(limit, ls="--", color=color, lw=0.8, alpha=0.6)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("precursor")
    if ax.lines:
        ax.legend(loc="upper left", fontsize=8)
    return fig


@_styled
def nonfinite_plot(report: RunReport) -> Figure:
    """Non-finite metrics per step and rank (stacked bars), and GradScaler overflows.

    Example:
        >>> svg = figure_svg(nonfinite_plot(load_run("runs/exp1")))
    """
    fig = _figure(10, 2.6)
    ax = fig.add_subplot()
    counts = report.nonfinite_counts()
    steps = report.steps
    if steps:
        ax.set_xlim(steps[0] - 0.5, steps[-1] + 0.5)
    bottom: dict[int, float] = {}
    handles: list[Any] = []
    width = max(0.8, (steps[-1] - steps[0]) / 400) if steps else 0.8
    for rank in sorted(counts):
        per_step = counts[rank]
        if not per_step:
            continue
        xs = sorted(per_step)
        ys = [per_step[s] for s in xs]
        base = [bottom.get(s, 0.0) for s in xs]
        ax.bar(xs, ys, bottom=base, width=width, color=_rank_color(rank), edgecolor=_TRIP, lw=0.8)
        for s, y in zip(xs, ys, strict=True):
            bottom[s] = bottom.get(s, 0.0) + y
        handles.append(Line2D([], [], color=_rank_color(rank), lw=6, label=f"rank {rank}: non-finite loss/grad"))
    if report.overflows:
        xs = [m.step for m in report.overflows]
        base = [bottom.get(s, 0.0) for s in xs]
        heights = [len(m.ranks) for m in report.overflows]
        ax.bar(xs, heights, bottom=base, width=width, color=_OVERFLOW, alpha=0.7)
        for s, h in zip(xs, heights, strict=True):
            bottom[s] = bottom.get(s, 0.0) + h
        handles.append(Line2D([], [], color=_OVERFLOW, lw=6, label="GradScaler overflow"))
    top = max(bottom.values(), default=0.0)
    ax.set_ylim(0, max(2.0, top + 0.5))
    ax.yaxis.get_major_locator().set_params(integer=True)  # type: ignore[call-arg]  # a MaxNLocator
    ax.set_xlabel("step")
    ax.set_ylabel("count")
    ax.set_title("non-finite values per step", loc="left")
    if handles:
        ax.legend(handles=handles, loc="upper right", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no non-finite loss or gradient logged", transform=ax.transAxes, ha="center", va="center")
    return fig


@_styled
def rank_plot(report: RunReport) -> Figure:
    """Ranks over steps: what each rank logged, where it skipped, and which rank each trip started on.

    Example:
        >>> svg = figure_svg(rank_plot(load_run("runs/exp1")))
    """
    ranks = sorted(report.ranks)
    fig = _figure(10, 1.4 + 0.45 * len(ranks))
    ax = fig.add_subplot()
    for rank in ranks:
        _draw_rank(ax, rank, report.ranks[rank].steps)
    origins = _draw_trip_ranks(ax, report)
    _label_origins(ax, report, origins)
    if report.rollbacks:
        ax.vlines([m.step for m in report.rollbacks], -0.5, len(ranks) - 0.5, colors=_ROLLBACK, ls="--", lw=1)
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(min(ranks) - 0.6, max(ranks) + 0.6)
    ax.invert_yaxis()
    ax.set_xlabel("step")
    ax.set_title("ranks: logged steps, skips, and the rank each trip started on", loc="left")
    handles = [
        Line2D([], [], color="#999999", lw=3, label="steps logged"),
        Line2D([], [], color=_SKIP, marker="|", ls="", markersize=10, label="skipped"),
        Line2D([], [], color=_TRIP, marker="X", ls="", markersize=9, label="trip origin"),
        Line2D([], [], color=_TRIP, marker="o", ls="", markerfacecolor="none", label="also non-finite"),
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return fig


def _draw_rank(ax: Axes, rank: int, steps: Sequence[StepRecord]) -> None:
    """One rank's row: the span of steps it logged, a tick at each step it skipped."""
    if steps:
        ax.hlines(rank, steps[0].step, steps[-1].step, color=_rank_color(rank), lw=3, alpha=0.5)
    skipped = [s.step for s in steps if s.skipped]
    if skipped:
        ax.scatter(skipped, [rank] * len(skipped), marker="|", s=140, color=_SKIP, zorder=3)


def _draw_trip_ranks(ax: Axes, report: RunReport) -> list[tuple[int, int]]:
    """Each trip's origin rank (X) and its other non-finite ranks (o); returns the (step, origin) pairs."""
    others = [(t.step, r) for t in report.trips for r in t.ranks if r != t.origin_rank]
    origins = [(t.step, t.origin_rank) for t in report.trips if t.origin_rank is not None]
    area = _weight(len(report.trips))[2]
    if others:  # one scatter per kind, not per trip: a long run may trip hundreds of times
        xs, ys = zip(*others, strict=True)
        ax.scatter(xs, ys, marker="o", s=60 * area, facecolors="none", edgecolors=_TRIP, zorder=4)
    if origins:
        xs, ys = zip(*origins, strict=True)
        ax.scatter(xs, ys, marker="X", s=120 * area, color=_TRIP, zorder=5)
    return origins


def _label_origins(ax: Axes, report: RunReport, origins: list[tuple[int, int]]) -> None:
    """One label per cause and cluster of trips on their origin rank's row.

    A label is about a quarter of the axis wide, so trips closer than that share one ("8 trips,
    steps 3–10, ..."); several causes stack their labels.
    """
    span = report.steps[-1] - report.steps[0] if report.steps else 0
    for rank in sorted({rank for _, rank in origins}):
        mine = [t for t in report.trips if t.origin_rank == rank]
        causes = list(dict.fromkeys(_cause(t) for t in mine))
        for first, last, count, cause in group_trips(mine, gap=max(1, span // 4)):
            ax.annotate(
                f"{group_label(first, last, count, cause)} (origin)",
                (first, rank),
                xytext=(6, 6 + 10 * causes.index(cause)),
                textcoords="offset points",
                fontsize=8,
                color=_TRIP,
            )


def _rows(stats: Mapping[str, Any], origin_module: str | None) -> tuple[list[dict[str, Any]], str]:
    rows = [dict(r) for r in stats.get("modules") or [] if isinstance(r, Mapping) and r.get("name")]
    note = ""
    if len(rows) > _MAX_MODULE_ROWS:
        # Show the window where things go wrong: from a little before the first bad module.
        marks = [i for i, r in enumerate(rows) if r.get("name") == origin_module or _bad(r)]
        start = max(0, (marks[0] if marks else 0) - _MAX_MODULE_ROWS // 4)
        start = min(start, len(rows) - _MAX_MODULE_ROWS)
        note = f"modules {start + 1}-{start + _MAX_MODULE_ROWS} of {len(rows)}"
        rows = rows[start : start + _MAX_MODULE_ROWS]
    return rows, note


def _bad(row: Mapping[str, Any]) -> bool:
    return bool(row.get("nan") or row.get("inf") or row.get("grad_nan") or row.get("grad_inf"))


@_styled
def module_plot(trip: Trip, stats: Mapping[str, Any]) -> Figure:
    """Per-module activation absmax and gradient norm at the tripped step, in call order.

    Rows whose output or gradient holds NaN/Inf are drawn red with their counts; the
    diagnosed origin module is highlighted.

    Example:
        >>> rank, stats = trip.stats_for_origin()
        >>> svg = figure_svg(module_plot(trip, stats))
    """
    origin_module = trip.diagnosis.module if trip.diagnosis else None
    rows, note = _rows(stats, origin_module)
    n = max(1, len(rows))
    fig = _figure(10, 1.2 + 0.22 * n)
    ax_act = fig.add_subplot(1, 2, 1)
    ax_grad = fig.add_subplot(1, 2, 2, sharey=ax_act)
    y = np.arange(len(rows))
    labels = [f"{r['name']} ({r.get('type', '?')})" for r in rows]
    for ax, key, nan_key, inf_key, title in (
        (ax_act, "absmax", "nan", "inf", "activation |x| max (finite part)"),
        (ax_grad, "grad_norm", "grad_nan", "grad_inf", "gradient norm of own parameters (finite part)"),
    ):
        _module_bars(ax, rows, y, key, nan_key, inf_key)
        ax.set_title(title, loc="left", fontsize=9)
        ax.grid(axis="y", visible=False)
    ax_act.set_yticks(y, labels, fontsize=7)
    ax_grad.tick_params(labelleft=False)
    ax_act.invert_yaxis()
    for i, r in enumerate(rows):
        if origin_module is not None and r.get("name") == origin_module:
            for ax in (ax_act, ax_grad):
                ax.axhspan(i - 0.5, i + 0.5, color=_SPIKE, alpha=0.25, lw=0)
            ax_act.get_yticklabels()[i].set_fontweight("bold")
    title = f"step {trip.step}: per-module statistics of the replay"
    if note:
        title += f" ({note})"
    if stats.get("error"):
        title += f" - replay stopped: {stats['error']}"
    fig.suptitle(title, x=0.01, ha="left", fontsize=10)
    if not rows:
        ax_act.text(0.5, 0.5, "no module ran", transform=ax_act.transAxes, ha="center", va="center")
    return fig


def _module_bars(ax: Any, rows: list[dict[str, Any]], y: Any, key: str, nan_key: str, inf_key: str) -> None:
    """One panel of ``module_plot``: a log bar per module, red with its NaN/Inf counts where it held them."""
    values = [number(r.get(key)) for r in rows]
    floor, top = _log_range(values)
    widths = [v if _positive(v) else 0.0 for v in values]
    held = [bool(r.get(nan_key) or r.get(inf_key)) for r in rows]
    ax.barh(y, widths, left=floor, color=[_TRIP if bad else "#4c72b0" for bad in held], height=0.7)
    ax.set_xscale("log")
    ax.set_xlim(floor, top)
    missing = "no float output" if key == "absmax" else "no own grads"
    for i, r in enumerate(rows):
        note = _bar_note(r, (nan_key, inf_key), missing if values[i] is None else None)
        if note:  # a bar of width 0 starts at the floor: its note too
            ax.text((floor + widths[i]) * 1.15, i, note, va="center", fontsize=7, color=_TRIP if held[i] else "#555555")


def _positive(value: float | None) -> TypeGuard[float]:
    """A finite value above zero: one a log axis can draw."""
    return value is not None and math.isfinite(value) and value > 0


def _log_range(values: list[float | None]) -> tuple[float, float]:
    """The log axis's (floor, top): a decade below the smallest value it can draw, three above the largest."""
    positive = [v for v in values if _positive(v)]
    floor = min(positive) / 10 if positive else 1e-8
    return floor, max(positive, default=1.0) * 1e3


def _bar_note(row: Mapping[str, Any], keys: tuple[str, str], missing: str | None) -> str:
    """What a module's bar is labelled with: its NaN and Inf counts, and why it has no value."""
    counts = [f"{row[k]} {name}" for k, name in zip(keys, ("NaN", "Inf"), strict=True) if row.get(k)]
    return ", ".join([*counts, missing] if missing else counts)
