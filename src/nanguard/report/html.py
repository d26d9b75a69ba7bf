"""``nanguard report --html``: one self-contained page, plots as inline SVG whose text stays text, no network."""

from __future__ import annotations

import html
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from nanguard._io import atomic_write_text
from nanguard.report import plots
from nanguard.report.load import RunReport, Trip
from nanguard.text import (
    HEADROOM_COLUMNS,
    RANK_COLUMNS,
    REMEDY_COLUMNS,
    event_words,
    evidence_lines,
    headroom_rows,
    kind_name,
    op_path,
    rank_rows,
    remedy_rows,
    where_lines,
)

__all__ = ["MAX_DETAILED_TRIPS", "inline_svg", "render_html", "write_html"]

MAX_DETAILED_TRIPS = 20
MAX_SUMMARY_ROWS = 100
"""Rows of the Diagnoses table; the later groups are counted per cause in one row."""
"""Trips shown in full (diagnosis, op path, module plot); later ones get a table row."""
_MAX_EVENT_ROWS = 300

_CSS = """
:root { --red: #d62728; --ink: #1d232b; --muted: #5b6573; --line: #dfe3e8; --bg: #f6f7f9; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
       color: var(--ink); background: var(--bg); }
main { max-width: 1100px; margin: 0 auto; padding: 24px 20px 48px; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 18px; margin: 32px 0 10px; border-bottom: 1px solid var(--line); padding-bottom: 4px; }
h3 { font-size: 16px; margin: 0 0 8px; }
.muted { color: var(--muted); }
code, .mono { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12.5px; }
.cards { display: flex; flex-wrap: wrap; gap: 10px; margin: 16px 0; }
.card { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 10px 14px; min-width: 110px; }
.card .n { font-size: 22px; font-weight: 650; }
.card.bad .n { color: var(--red); }
.card .l { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
figure.plot { background: #fff; border: 1px solid var(--line); border-radius: 8px; margin: 12px 0; padding: 8px; }
figure.plot svg { display: block; max-width: 100%; height: auto; margin: 0 auto; }
figure.plot svg * { stroke-linejoin: round; stroke-linecap: butt; }
figure.plot figcaption { color: var(--muted); font-size: 12.5px; margin: 6px 4px 0; }
.diagnosis { background: #fff; border: 1px solid var(--line); border-left: 5px solid var(--red);
             border-radius: 8px; padding: 16px 18px; margin: 16px 0; }
.cause { color: var(--red); font-weight: 700; }
table { border-collapse: collapse; width: 100%; background: #fff; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid var(--line); vertical-align: top; }
th { color: var(--muted); font-weight: 600; font-size: 12.5px; }
table.kv th { width: 130px; text-align: right; }
table.path td.carries { color: var(--red); font-weight: 600; }
table.path tr.origin { background: #fde8e8; font-weight: 650; }
table.path tr.before { color: var(--muted); }
ol.fixes li { margin: 3px 0; }
.warnings { background: #fff8e1; border: 1px solid #f0d48a; border-radius: 8px; padding: 8px 14px; }
.notcollected { background: #fff; border: 1px dashed var(--line); border-radius: 8px; padding: 10px 14px;
                color: var(--muted); }
.tag { display: inline-block; border-radius: 4px; padding: 0 6px; font-size: 12px; background: #eef1f4; }
.tag.red { background: #fde8e8; color: var(--red); }
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _plot(plot_id: str, fig: Figure, alt: str, caption: str) -> str:
    return (
        f'<figure class="plot" id="plot-{_e(plot_id)}" data-plot="{_e(plot_id)}">'
        f"{inline_svg(plots.figure_svg(fig), f'plot-{plot_id}', alt)}"
        f"<figcaption>{_e(caption)}</figcaption></figure>"
    )


_TAG = re.compile(r"<[^>]*>")  # matplotlib escapes '>' inside attribute values
_REFERENCE = re.compile(r'(\bid="|url\(#|href="#)')
_PATH_DATA = re.compile(r' d="[^"]*"')
_DIGITS = re.compile(r"(\.\d\d)\d+")
_DROPPED = re.compile(r"<metadata>.*?</metadata>\s*|<style[^>]*>.*?</style>\s*", re.S)


def inline_svg(svg: str, prefix: str, label: str) -> str:
    """Matplotlib's SVG document as an element of the page, its text searchable.

    The XML prologue, the metadata and the style sheet (its rules are in the page's CSS) go;
    every id and reference to one gets ``prefix``, so the plots of a page do not share ids; path
    coordinates keep two decimals (of a point: far below a pixel), a fifth of a long run's page.

    Example:
        >>> inline_svg(figure_svg(loss_plot(report)), "plot-loss", "loss over steps")[:4]
        '<svg'
    """

    def tag(match: re.Match[str]) -> str:
        text = _REFERENCE.sub(lambda m: f"{m.group(1)}{prefix}-", match.group(0))
        return _PATH_DATA.sub(lambda m: _DIGITS.sub(r"\1", m.group(0)), text)

    body = _DROPPED.sub("", svg[svg.index("<svg") :])
    return _TAG.sub(tag, body).replace("<svg ", f'<svg role="img" aria-label="{_e(label)}" ', 1)


def _table(columns: Sequence[str], rows: Iterable[Sequence[str]], cls: str = "", raw: bool = False) -> str:
    head = "".join(f"<th>{_e(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{v if raw else _e(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _cards(report: RunReport, data: dict[str, Any]) -> str:
    counts = data["counts"]
    items = [
        ("steps run", data["steps_run"], False),
        ("ranks", len(report.ranks), False),
        ("trips", counts["trips"], counts["trips"] > 0),
        ("skips", counts["skips"], counts["skips"] > 0),
        ("rollbacks", counts["rollbacks"], counts["rollbacks"] > 0),
        ("spikes", counts["spikes"], counts["spikes"] > 0),
        ("overflows", counts["overflows"], False),
    ]
    cells = "".join(
        f'<div class="card{" bad" if bad else ""}" id="count-{_e(label.replace(" ", "-"))}">'
        f'<div class="n">{_e(n)}</div><div class="l">{_e(label)}</div></div>'
        for label, n, bad in items
    )
    return f'<div class="cards">{cells}</div>'


def _diagnosis_html(trip: Trip) -> str:
    diag = trip.diagnosis
    head = f"Step {trip.step}"
    if diag is None:
        return (
            f'<section class="diagnosis" id="trip-{trip.step}"><h3>{_e(head)}: trip without a readable '
            f"diagnosis</h3><p>action {_e(trip.action)}, ranks {_e(trip.ranks)}</p></section>"
        )
    kind = kind_name(diag.kind)
    origin = trip.origin_rank
    tags = [f'<span class="tag red">{_e(kind)} created</span>', f'<span class="tag">action: {_e(trip.action)}</span>']
    if origin is not None and (diag.rank is not None or len(trip.reported_by) > 1):
        tags.append(f'<span class="tag">origin rank {_e(origin)}</span>')
    where = [("created", kind), *where_lines(diag)]
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in where)
    evidence = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in evidence_lines(diag))
    fixes = "".join(f"<li>{_e(f)}</li>" for f in diag.fixes)
    parts = [
        f'<section class="diagnosis" id="trip-{trip.step}" data-cause="{_e(diag.cause)}">',
        f'<h3>{_e(head)}: <span class="cause">{_e(diag.cause)}</span> {" ".join(tags)}</h3>',
        f"<p>{_e(diag.meaning)}</p>",
        f'<table class="kv where">{rows}</table>',
    ]
    if evidence:
        parts += ["<h4>Evidence</h4>", f'<table class="kv evidence">{evidence}</table>']
    if fixes:
        parts += ["<h4>What to try</h4>", f'<ol class="fixes">{fixes}</ol>']
    parts += _path_html(trip)
    parts += _modules_html(trip)
    parts += _bundles_html(trip)
    parts.append("</section>")
    return "".join(parts)


def _steps(group: Sequence[Trip]) -> str:
    return str(group[0].step) if len(group) == 1 else f"{group[0].step}–{group[-1].step} ({len(group)})"


def _where(trip: Trip) -> str:
    """The summary without the cause and step, which have their own columns."""
    if trip.diagnosis is None:
        return ""
    text = replace(trip.diagnosis, step=None).summary()
    return text.removeprefix(f"{trip.diagnosis.cause}: ")


def _path_html(trip: Trip) -> list[str]:
    assert trip.diagnosis is not None
    path = op_path(trip.diagnosis)
    if len(path) <= 1 and not trip.diagnosis.evidence.get("origin"):
        return []
    body = "".join(
        f'<tr class="{_e(r["role"])}"><td>{_e(r["role"])}</td><td class="mono">{_e(r["op"])}</td>'
        f'<td class="mono">{_e((r["module"] if r["module"] is not None else "-") or "<root>")}</td>'
        f'<td>{_e(r["phase"] or "-")}</td><td class="carries">{_e(r["carries"])}</td></tr>'
        for r in path
    )
    return [
        "<h4>The origin and the ops that followed</h4>",
        '<table class="path"><thead><tr><th></th><th>op</th><th>module</th><th>phase</th><th>holds</th></tr>'
        f"</thead><tbody>{body}</tbody></table>",
    ]


def _modules_html(trip: Trip) -> list[str]:
    found = trip.stats_for_origin()
    head = "<h4>Per-module activations and gradients at this step</h4>"
    if found is None:
        return [
            head,
            f'<p class="notcollected" id="modules-{trip.step}-missing">Per-module statistics: not collected '
            "(the guard that wrote this run recorded no <code>module_stats</code> for this trip).</p>",
        ]
    rank, stats = found
    where = f" on rank {rank}" if len(trip.reported_by) > 1 else ""
    caption = (
        f"Largest finite |activation| of each module's output and the gradient norm of its own parameters, "
        f"from the replay of step {trip.step}{where}, in the order modules ran. Red: the output or "
        "gradient holds NaN/Inf; highlighted: the diagnosed module."
    )
    if stats.get("omitted"):
        caption += f" {stats['omitted']} module(s) were not recorded."
    alt = f"per-module activation absmax and gradient norm at step {trip.step}"
    return [head, _plot(f"modules-{trip.step}", plots.module_plot(trip, stats), alt, caption)]


def _bundles_html(trip: Trip) -> list[str]:
    if not trip.bundles:
        return []
    items = []
    for b in trip.bundles:
        state = b.error or ("batch stored" if b.batch_stored else "shapes only")
        items.append(
            f"<li><code>{_e(b.path)}</code> (rank {b.rank}, {_e(state)}); replay with "
            f"<code>nanguard replay {_e(b.path)} --model PKG.MODULE:FACTORY</code></li>"
        )
    return ["<h4>Repro bundles</h4>", f"<ul>{''.join(items)}</ul>"]


def _events_html(report: RunReport) -> str:
    markers = sorted(
        [*report.skips, *report.rollbacks, *report.spikes, *report.early_warnings, *report.overflows],
        key=lambda m: (m.step, m.kind),
    )
    if not markers:
        return '<p class="muted">No skips, rollbacks, spikes or overflows.</p>'
    rows = [
        (str(m.step), m.kind, ", ".join(map(str, m.ranks)), event_words(m.kind, m.fields))
        for m in markers[:_MAX_EVENT_ROWS]
    ]
    more = len(markers) - len(rows)
    tail = f'<p class="muted">{more} more not shown; see --json.</p>' if more > 0 else ""
    return _table(("step", "event", "ranks", "detail"), rows, cls="events") + tail


def _remedies_html(report: RunReport) -> str:
    """The remedies section (policy="auto") and modules near overflow; empty when there are none."""
    out = []
    if report.remedies:
        rows = remedy_rows(report.remedies[:_MAX_EVENT_ROWS])
        out += ['<h2 id="remedies">Remedies</h2>', _table(REMEDY_COLUMNS, rows)]
    close = headroom_rows(report.headroom)
    if close:
        out += ['<h2 id="headroom">Close to overflow</h2>', _table(HEADROOM_COLUMNS, close[:_MAX_EVENT_ROWS])]
    return "\n".join(out)


def _ranks_html(report: RunReport, data: dict[str, Any]) -> list[str]:
    """The Ranks section: the per-rank table and the plot of each rank's steps and trips."""
    plot = _plot(
        "ranks",
        plots.rank_plot(report),
        "ranks over steps and the rank each trip started on",
        "Steps each rank logged, its skipped steps, and for each trip the rank it started on (X) and "
        "the other ranks whose values were non-finite (o).",
    )
    return ['<h2 id="ranks">Ranks</h2>', _table(RANK_COLUMNS, rank_rows(data), cls="ranks"), plot]


@dataclass(frozen=True)
class _Curve:
    """One plot of the curves section: its id, how it is drawn, its alt text and caption, and the
    progress message once drawn (None: drawn without one; ``shown``: whether the run has it)."""

    plot_id: str
    draw: Callable[[RunReport], Figure]
    alt: str
    caption: str
    done: str | None
    shown: Callable[[RunReport], bool] = lambda report: True


def _has_precursor_series(report: RunReport) -> bool:
    return any(isinstance(m.fields.get("series"), list) for m in report.early_warnings)


_CURVES = (
    _Curve(
        "loss",
        plots.loss_plot,
        "loss over steps, log scale",
        "Loss per step (log scale), one curve per rank. Red: trips; orange dotted: skips; purple dashed: "
        "rollbacks (shaded back to the restored step); stars: spikes; brown dash-dotted: early warnings. "
        "Non-finite values leave gaps.",
        "loss plot",
    ),
    _Curve(
        "grad-norm",
        plots.grad_norm_plot,
        "gradient norm over steps, log scale",
        "Total gradient norm per step (log scale), marked like the loss.",
        "gradient norm plot",
    ),
    _Curve(
        "precursors",
        plots.precursor_plot,
        "precursors over steps, log scale",
        "Each early warning's sampled precursor (log scale), the growth projected from its last sample "
        "(dotted) to the level where its mechanism blows up (dashed).",
        None,
        _has_precursor_series,
    ),
    _Curve(
        "nonfinite",
        plots.nonfinite_plot,
        "non-finite values per step",
        "How many of loss and gradient norm were NaN/Inf at each step, stacked by rank "
        "(at least one where a trip flagged the rank); GradScaler overflows apart.",
        "non-finite plot",
    ),
)


def render_html(report: RunReport, *, progress: Callable[[str], None] | None = None) -> str:
    """The whole report as one HTML document: inline CSS, plots as inline SVG, no script, no network.

    ``progress(message)`` is called after each plot is drawn.

    Example:
        >>> Path("report.html").write_text(render_html(load_run("runs/exp1")), encoding="utf-8")
    """
    advance = progress or (lambda message: None)
    data = report.to_dict()
    groups = plots.trip_groups(report.trips)
    out = [*_head_html(report, data), *_warnings_html(report)]
    out += ['<h2 id="summary">Diagnoses</h2>', _summary_html(groups)]
    out += ['<h2 id="curves">Training curves</h2>', *_curves_html(report, advance)]
    out += _ranks_html(report, data)
    advance("rank plot")
    if report.trips:
        out += _trips_html(groups, data["counts"]["trips"], advance)
    out += ['<h2 id="events">Skips, rollbacks, spikes and overflows</h2>', _events_html(report)]
    out.append(_remedies_html(report))
    out += _bundle_table_html(report)
    out.append('<p class="muted">Made by nanguard. This page is self-contained: it loads nothing.</p>')
    out.append("</main></body></html>")
    return "\n".join(out)


def _head_html(report: RunReport, data: dict[str, Any]) -> list[str]:
    """The document's head, the page's title, the line saying what run this is, and the count cards."""
    return [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        '<link rel="icon" href="data:,">',
        f"<title>nanguard report: {_e(report.run_dir.name or report.run_dir)}</title>",
        f"<style>{_CSS}</style></head><body><main>",
        "<h1>nanguard report</h1>",
        f'<p class="muted"><code>{_e(report.run_dir)}</code> &middot; {len(report.ranks)} rank(s)'
        + (f" of world size {report.world_size}" if report.world_size else "")
        + f" &middot; steps {_e(data['first_step'])}&ndash;{_e(data['last_step'])}"
        + f" &middot; generated {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}</p>",
        _cards(report, data),
    ]


def _warnings_html(report: RunReport) -> list[str]:
    if not report.warnings:
        return []
    items = "".join(f"<li>{_e(w)}</li>" for w in report.warnings[:50])
    more = f"<li>{len(report.warnings) - 50} more</li>" if len(report.warnings) > 50 else ""
    return [f'<div class="warnings" id="warnings"><strong>While reading:</strong><ul>{items}{more}</ul></div>']


def _cause(trip: Trip) -> str:
    return trip.diagnosis.cause if trip.diagnosis else "?"


def _summary_html(groups: Sequence[Sequence[Trip]]) -> str:
    """The Diagnoses table: a row per group of trips, the groups past ``MAX_SUMMARY_ROWS`` counted in one."""
    if not groups:
        return '<p id="no-trips">No trips: every logged step was finite.</p>'
    rows = [
        (_steps(g), _cause(g[0]), _where(g[0]), g[0].action, "-" if g[0].origin_rank is None else str(g[0].origin_rank))
        for g in groups[:MAX_SUMMARY_ROWS]
    ]
    if later := [t for g in groups[MAX_SUMMARY_ROWS:] for t in g]:
        causes = Counter(_cause(t) for t in later)
        words = ", ".join(f"{n} {cause}" for cause, n in causes.most_common())
        span = f"{later[0].step}–{later[-1].step} ({len(later)})"
        rows.append((span, f"{len(groups) - MAX_SUMMARY_ROWS} more groups: {words}", "", "", ""))
    return _table(("step", "cause", "where", "action", "origin rank"), rows, cls="trips")


def _curves_html(report: RunReport, advance: Callable[[str], None]) -> list[str]:
    out = []
    for curve in _CURVES:
        if not curve.shown(report):
            continue
        out.append(_plot(curve.plot_id, curve.draw(report), curve.alt, curve.caption))
        if curve.done is not None:
            advance(curve.done)
    return out


def _trips_html(groups: Sequence[Sequence[Trip]], trips: int, advance: Callable[[str], None]) -> list[str]:
    """The Trips section: the first trip of each group in full, up to ``MAX_DETAILED_TRIPS`` groups."""
    out = [f'<h2 id="trips">Trips ({trips})</h2>']
    for group in groups[:MAX_DETAILED_TRIPS]:
        if len(group) > 1:
            out.append(
                f'<p class="group">{len(group)} trips in a row with this cause, steps {_steps(group)}; '
                "the first is shown.</p>"
            )
        out.append(_diagnosis_html(group[0]))
        advance(f"trip at step {group[0].step}")
    if len(groups) > MAX_DETAILED_TRIPS:
        n_later = sum(len(g) for g in groups[MAX_DETAILED_TRIPS:])
        out.append(f'<p class="muted">{n_later} later trips are listed in the table above only.</p>')
    return out


def _bundle_table_html(report: RunReport) -> list[str]:
    if not report.bundles:
        return []
    rows = [(b.path.name, str(b.step), str(b.rank), b.cause or "-", b.error or "ok") for b in report.bundles[:200]]
    return ['<h2 id="bundles">Bundles</h2>', _table(("bundle", "step", "rank", "cause", "state"), rows, cls="bundles")]


def write_html(report: RunReport, path: str | Path, *, progress: Callable[[str], None] | None = None) -> Path:
    """Render ``report`` and write it to ``path`` (parents created); return the path.

    Example:
        >>> write_html(load_run("runs/exp1"), "runs/exp1/report.html")
        PosixPath('runs/exp1/report.html')
    """
    return atomic_write_text(path, render_html(report, progress=progress))
