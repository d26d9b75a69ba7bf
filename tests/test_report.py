"""``nanguard report``: summaries, JSON and HTML built from the run directories of real guarded runs.

Two runs are made once per module: one rank (a fully masked sample trips and is rolled
back, a scaled loss spikes) and two gloo ranks under DDP (NaN pixels on rank 1 only). The
HTML is opened in headless Chromium through the DevTools protocol over a pipe (stdlib only).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import io
import json
import os
import re
import select
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from nanguard.bundle import load_bundle
from nanguard.cli import main as cli_main
from nanguard.errors import EventLogError
from nanguard.findings import Diagnosis
from nanguard.guard import Guard
from nanguard.report import load_run, render_html, run_report, write_html
from nanguard.tracer.module_stats import module_stats
from nanguard.zoo import build, get, synthetic_batch, train_step
from nanguard.zoo.spawn import spawn_ranks

CHROMIUM = Path("/usr/bin/chromium")
FAULT_STEP = 3  # padding_fully_masked's fault step
SPIKE_STEP = 6
STEPS = 8
DIST_STEPS = 4
DIST_FAULT_STEP = 2


# --------------------------------------------------------------------------- real runs


@dataclass
class OneRank:
    run_dir: Path
    replayed_stats: dict[str, Any]


def _scaled_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], factor: float) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    _, loss = model(**batch)
    (loss * factor).backward()
    return loss * factor


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> OneRank:
    run_dir = tmp_path_factory.mktemp("one-rank")
    run = build(get("padding_fully_masked"), seed=0)
    guard = Guard(
        run.model, run.optimizer, policy="rollback", run_dir=run_dir, snapshot_every=2, spike_warmup=3, spike_window=8
    )
    for step, batch in run.batches(STEPS):
        factor = 100.0 if step == SPIKE_STEP else 1.0
        guard.step(lambda batch=batch, factor=factor: _scaled_step(run.model, batch, factor), batch=batch)
    guard.close()
    assert guard.rollbacks == 1, "the run must trip and roll back once"
    # The per-module statistics a guard would record, replayed from the run's own bundle.
    bundle = load_bundle(run_dir / "bundles" / f"step-{FAULT_STEP:08d}-rank-0")
    stats = module_stats(run.model, lambda: train_step(run.model, bundle.batch))
    run.model.zero_grad(set_to_none=True)
    return OneRank(run_dir, stats)


def _rank_main(rank: int, world: int, run_dir: str) -> None:
    torch.set_num_threads(1)
    scenario = get("nan_pixels")
    run = build(scenario, seed=0)
    model = DistributedDataParallel(run.model)
    guard = Guard(model, run.optimizer, policy="skip", run_dir=run_dir)
    for step in range(DIST_STEPS):
        batch = synthetic_batch(run.model.config, torch.Generator().manual_seed(1000 * rank + step))
        if rank == 1 and step == DIST_FAULT_STEP:
            batch = scenario.fault(run.model, batch)
        guard.step(lambda batch=batch: train_step(model, batch), batch=batch)
    guard.close()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("two-ranks")
    spawn_ranks(_rank_main, str(run_dir / "events"))
    return run_dir / "events"


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run_dir, target)
    return target


# --------------------------------------------------------------------------- summaries


def test_one_rank_summary_counts_every_event(one_rank: OneRank, capsys: pytest.CaptureFixture[str]) -> None:
    report = load_run(one_rank.run_dir)
    assert sorted(report.ranks) == [0]
    assert list(report.steps) == list(range(STEPS))
    [trip] = report.trips
    assert trip.step == FAULT_STEP and trip.action == "rollback"
    assert trip.diagnosis is not None and trip.diagnosis.cause == "op.masked_softmax"
    assert [m.step for m in report.rollbacks] == [FAULT_STEP]
    assert FAULT_STEP + 1 in [m.step for m in report.skips]  # the batch dropped after the rollback
    assert {m.fields["metric"] for m in report.spikes if m.step == SPIKE_STEP} == {"loss", "grad_norm"}
    assert [b.step for b in trip.bundles] == [FAULT_STEP]

    assert cli_main(["report", str(one_rank.run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"1 rank(s) (world size 1), steps 0-{STEPS - 1}: {STEPS} steps run" in out
    assert f"trips 1, skips {len(report.skips)}, rollbacks 1, spikes {len(report.spikes)}" in out
    assert "op.masked_softmax" in out and "blocks.0.attn" in out and "aten._softmax.default" in out
    assert trip.diagnosis.fixes[0] in out
    assert "\x1b[" not in out and "╭" not in out  # plain text when stdout is not a terminal


def test_json_is_machine_readable(one_rank: OneRank, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["report", str(one_rank.run_dir), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["steps_run"] == STEPS and data["ranks"] == [0]
    assert data["counts"]["trips"] == 1 and data["counts"]["rollbacks"] == 1 and data["counts"]["spikes"] >= 2
    [trip] = data["trips"]
    assert trip["step"] == FAULT_STEP and trip["origin_rank"] == 0
    assert Diagnosis.from_dict(trip["diagnosis"]).cause == trip["cause"] == "op.masked_softmax"
    assert data["per_rank"]["0"]["trips_originated"] == 1
    assert data["html"] is None and data["warnings"] == []


def test_two_ranks_merge_with_steps_aligned(two_ranks: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = load_run(two_ranks)
    assert sorted(report.ranks) == [0, 1] and report.world_size == 2
    assert [s.step for s in report.ranks[0].steps] == [s.step for s in report.ranks[1].steps]
    assert list(report.steps) == list(range(DIST_STEPS))
    [trip] = report.trips  # both ranks logged it: merged into one
    assert trip.step == DIST_FAULT_STEP and trip.reported_by == [0, 1]
    assert trip.origin_rank == 1 and trip.diagnosis is not None and trip.diagnosis.rank == 1
    assert trip.diagnosis.cause == "data.nonfinite"
    assert [(m.step, m.ranks) for m in report.skips] == [(DIST_FAULT_STEP, [0, 1])]
    assert {b.rank for b in trip.bundles} == {0, 1}
    assert report.warnings == []
    losses = {r: [s.loss for s in log.steps if not s.skipped] for r, log in report.ranks.items()}
    assert losses[0] != losses[1]  # each rank's own loss curve, not one copy

    assert cli_main(["report", str(two_ranks), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["trips"][0]["origin_rank"] == 1 and data["per_rank"]["1"]["trips_originated"] == 1
    assert data["per_rank"]["0"]["trips_originated"] == 0

    assert cli_main(["report", str(two_ranks)]) == 0
    out = capsys.readouterr().out
    assert "2 rank(s) (world size 2)" in out and f"step {DIST_FAULT_STEP}: started on rank 1" in out
    assert "batch['pixel_values']" in out


# --------------------------------------------------------------------------- bad input


def test_truncated_last_line_is_skipped_with_a_warning(
    one_rank: OneRank, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = _copy(one_rank.run_dir, tmp_path)
    log = run_dir / "events-rank0.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # a crash mid-write
    with pytest.warns(UserWarning, match=rf"events-rank0\.jsonl:{len(lines)}: the log.s last line is cut short"):
        report = load_run(run_dir)
    assert len(report.trips) == 1 and report.ranks[0].end is None

    assert run_report(run_dir) == 0
    captured = capsys.readouterr()
    assert f"events-rank0.jsonl:{len(lines)}: the log's last line is cut short" in captured.err
    assert "op.masked_softmax" in captured.out


def test_garbage_lines_and_unknown_kinds_are_ignored(
    one_rank: OneRank, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = _copy(one_rank.run_dir, tmp_path)
    log = run_dir / "events-rank0.jsonl"
    n = len(log.read_text().splitlines())
    with log.open("a", encoding="utf-8") as handle:
        handle.write('\x00\x07 not json {"kind"\n')
        handle.write('{"kind": "telemetry", "step": 4, "rank": 0, "gpu_temp": 71}\n')
        handle.write("[1, 2, 3]\n")
    assert run_report(run_dir, as_json=True) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["counts"]["trips"] == 1 and data["steps_run"] == STEPS
    assert f"events-rank0.jsonl:{n + 1}: skipping unreadable event line" in captured.err
    assert f"events-rank0.jsonl:{n + 2}: ignoring unknown event kind 'telemetry'" in captured.err
    assert f"events-rank0.jsonl:{n + 3}: skipping event line: a JSON list, not an object" in captured.err
    assert len(data["warnings"]) == 3


def test_a_directory_without_events_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli_main(["report", str(empty)]) == 1
    err = capsys.readouterr().err
    assert "nanguard report: error:" in err and "no event logs (events-rank*.jsonl)" in err
    assert "Traceback" not in err

    assert cli_main(["report", str(tmp_path / "missing"), "--json"]) == 1
    assert "no such run directory" in capsys.readouterr().err

    (empty / "events-rank0.jsonl").write_text("garbage\n\n{truncated")
    assert cli_main(["report", str(empty), "--html", str(tmp_path / "r.html")]) == 1
    err = capsys.readouterr().err
    assert "no readable events in events-rank0.jsonl" in err and "events-rank0.jsonl:3:" in err
    assert not (tmp_path / "r.html").exists()
    with pytest.warns(UserWarning) as caught, pytest.raises(EventLogError, match="no readable"):
        load_run(empty)
    assert [str(w.message).split(": ", 1)[0].rsplit(":", 1)[1] for w in caught] == ["1", "3"]


def test_unreadable_bundle_is_reported_not_fatal(one_rank: OneRank, tmp_path: Path) -> None:
    run_dir = _copy(one_rank.run_dir, tmp_path)
    meta = run_dir / "bundles" / f"step-{FAULT_STEP:08d}-rank-0" / "meta.json"
    meta.write_text(meta.read_text()[:40])
    with pytest.warns(UserWarning, match="unreadable bundle"):
        report = load_run(run_dir)
    [bundle] = report.bundles
    assert bundle.error is not None and "JSON" in bundle.error
    assert report.trips[0].diagnosis is not None  # the events still carry the diagnosis


# --------------------------------------------------------------------------- module statistics


def test_module_stats_replay_of_the_tripped_step(one_rank: OneRank) -> None:
    stats = one_rank.replayed_stats
    rows = {r["name"]: r for r in stats["modules"]}
    names = list(rows)
    assert stats["error"] is None and stats["omitted"] == 0
    assert names.index("blocks.0") < names.index("blocks.0.attn") < names.index("blocks.0.attn.qkv")  # entry order
    assert rows["blocks.0.attn.qkv"]["nan"] == 0 and rows["wte"]["nan"] == 0  # before the softmax: finite
    assert rows["blocks.0.attn"]["nan"] > 0 and rows["lm_head"]["nan"] > 0  # from the origin on: NaN
    assert rows["blocks.0.ln_1"]["absmax"] > 0 and rows["blocks.0.attn"]["grad_norm"] is None
    assert rows["lm_head"]["grad_nan"] > 0 and rows["lm_head"]["type"] == "Linear"


def test_module_stats_keeps_state_and_survives_errors() -> None:
    run = build(get("token_id_out_of_range"), seed=0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    before = model[1].running_mean.clone()
    stats = module_stats(model, lambda: model(torch.randn(8, 4) * 50).sum().backward())
    assert torch.equal(model[1].running_mean, before)  # buffers put back
    assert [r["name"] for r in stats["modules"]] == ["0", "1"] and stats["modules"][0]["grad_norm"] > 0
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks

    batch = run.batch(3)
    failed = module_stats(run.model, lambda: train_step(run.model, batch))
    assert failed["error"].startswith("IndexError")
    assert [r["name"] for r in failed["modules"]][:1] == ["wte"]
    capped = module_stats(run.model, lambda: train_step(run.model, run.batch(0)), max_modules=3)
    assert len(capped["modules"]) == 3 and capped["omitted"] > 0


# --------------------------------------------------------------------------- HTML in Chromium


class Browser:
    """Headless Chromium driven over ``--remote-debugging-pipe`` (fds 3 and 4, NUL-framed JSON)."""

    def __init__(self, profile: Path) -> None:
        to_child_r, self._to_child = _high_pipe()
        self._from_child, from_child_w = _high_pipe()

        def wire() -> None:
            os.dup2(to_child_r, 3)
            os.dup2(from_child_w, 4)

        args = [
            str(CHROMIUM),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-extensions",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            "--remote-debugging-pipe",
            "about:blank",
        ]
        self.proc = subprocess.Popen(
            args, pass_fds=(3, 4), preexec_fn=wire, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        self._id += 1
        message: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, session: str) -> None:
        while not any(e.get("method") == method and e.get("sessionId") == session for e in self.events):
            self.events.append(self._read())

    def _read(self, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buf:
            ready, _, _ = select.select([self._from_child], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError("Chromium did not answer within 60 s")
            chunk = os.read(self._from_child, 1 << 20)
            if not chunk:
                raise EOFError("Chromium closed the DevTools pipe")
            self._buf += chunk
        message, _, self._buf = self._buf.partition(b"\0")
        return json.loads(message)

    def open(self, path: Path, find: tuple[str, ...] = ()) -> Page:
        """Load ``path``, then look for each of ``find`` as the browser's find-in-page does."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", None, session)
        self.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": 1200, "height": 2400, "deviceScaleFactor": 1, "mobile": False},
            session,
        )
        start = len(self.events)
        self.call("Page.navigate", {"url": path.resolve().as_uri()}, session)
        self.wait_for("Page.loadEventFired", session)
        result = self.call(
            "Runtime.evaluate",
            {
                "expression": _INSPECT.replace("FIND", json.dumps(list(find))),
                "awaitPromise": True,
                "returnByValue": True,
            },
            session,
        )
        shot = self.call("Page.captureScreenshot", {"format": "png"}, session)["data"]
        events = [e for e in self.events[start:] if e.get("sessionId") == session]
        self.call("Target.closeTarget", {"targetId": target})
        return Page(json.loads(result["result"]["value"]), base64.b64decode(shot), events)

    def close(self) -> None:
        with contextlib.suppress(OSError, EOFError, TimeoutError, RuntimeError):
            self.call("Browser.close")
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_child)
        os.close(self._from_child)


_INSPECT = """
(async () => {
  const figures = Array.from(document.querySelectorAll('figure.plot'));
  const plots = figures.map((f) => {
    const svg = f.querySelector('svg');
    const box = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
    const texts = svg ? Array.from(svg.querySelectorAll('text')).map((t) => t.textContent) : [];
    return {id: f.id, width: box.width, height: box.height, texts, drawn: svg ? svg.getBBox().width : 0};
  });
  const found = FIND.filter((words) => { window.getSelection().removeAllRanges(); return window.find(words); });
  return JSON.stringify({text: document.body.innerText, plots, found,
                         height: document.documentElement.scrollHeight});
})()
"""


def _high_pipe() -> tuple[int, int]:
    """A pipe whose fds are >= 10, so wiring them to 3 and 4 in the child cannot clobber one."""
    r, w = os.pipe()
    high = (fcntl.fcntl(r, fcntl.F_DUPFD, 10), fcntl.fcntl(w, fcntl.F_DUPFD, 10))
    os.close(r)
    os.close(w)
    return high


@dataclass
class Page:
    info: dict[str, Any]
    screenshot: bytes
    events: list[dict[str, Any]]

    @property
    def text(self) -> str:
        return self.info["text"]

    def console_errors(self) -> list[str]:
        errors = []
        for e in self.events:
            method, params = e.get("method"), e.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert", "warning"):
                errors.append(" ".join(str(a.get("value", a.get("description"))) for a in params.get("args", [])))
            elif method == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                errors.append(details.get("exception", {}).get("description") or details.get("text", "exception"))
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") in ("error", "warning"):
                errors.append(params["entry"].get("text", ""))
            elif method == "Network.loadingFailed":
                errors.append(f"failed to load: {params.get('errorText')}")
        return errors

    def requests(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    if not CHROMIUM.exists():
        missing = "headless Chromium is not installed at /usr/bin/chromium (apt-get install chromium)"
        if os.environ.get("NANGUARD_REQUIRE_CHROMIUM") == "1":  # set by .ci/run: there a skip is a failure
            pytest.fail(missing)
        pytest.skip(missing)
    chromium = Browser(tmp_path_factory.mktemp("chromium-profile"))
    yield chromium
    chromium.close()


def _not_blank(png: bytes) -> float:
    """The share of screenshot pixels that differ from its most common colour (the background)."""
    import matplotlib.image

    pixels = matplotlib.image.imread(io.BytesIO(png), format="png")[..., :3].reshape(-1, 3)
    quantized = (pixels * 255).round().astype(int)
    keys = quantized[:, 0] * 65536 + quantized[:, 1] * 256 + quantized[:, 2]
    values, counts = torch.unique(torch.from_numpy(keys), return_counts=True)
    background = values[counts.argmax()].item()
    return float((keys != background).mean())


def _check_page(page: Page, html_path: Path) -> None:
    assert page.console_errors() == []
    assert {u for u in page.requests() if not u.startswith("data:")} == {html_path.resolve().as_uri()}
    assert _not_blank(page.screenshot) > 0.05, "the screenshot is (nearly) blank"
    assert page.info["height"] > 2000
    for plot in page.info["plots"]:
        assert plot["drawn"] > 300 and plot["width"] > 300 and plot["height"] > 100, plot
        assert "step" in plot["texts"] or plot["id"].startswith("plot-modules-"), plot  # the x axis label, as text


def _self_contained(html: str) -> None:
    assert not re.search(r"""(src|href)\s*=\s*["'](?!data:|#)""", html), "the page refers to an outside resource"
    assert "http://" not in html.split("<svg")[0] and "<script" not in html
    # Plots are inline SVG with their words as <text>: no images, and no ids shared between plots.
    assert "<img" not in html and "base64" not in html and "<?xml" not in html
    figures = re.findall(r'<figure class="plot".*?</figure>', html, re.S)
    assert figures and all(f.count("<svg") == 1 and "<text" in f for f in figures)
    ids = re.findall(r'\bid="([^"]+)"', html)
    assert len(ids) == len(set(ids)), "duplicate ids"
    refs = set(re.findall(r'(?:url\(#|href="#)([^)"]+)', html))
    assert refs and refs <= set(ids), "a plot refers to an id it does not have"


def test_browser_check_catches_console_errors(browser: Browser, tmp_path: Path) -> None:
    bad = tmp_path / "bad.html"
    bad.write_text(
        '<!DOCTYPE html><html><head><link rel="icon" href="data:,"></head><body><p>x</p>'
        '<script>console.error("boom"); missingFunction();</script></body></html>'
    )
    page = browser.open(bad)
    errors = page.console_errors()
    assert any("boom" in e for e in errors) and any("missingFunction" in e for e in errors)
    assert _not_blank(page.screenshot) < 0.01


def test_html_one_rank_in_chromium(one_rank: OneRank, browser: Browser, tmp_path: Path) -> None:
    out = tmp_path / "deep" / "report.html"
    assert cli_main(["report", str(one_rank.run_dir), "--html", str(out), "--json"]) == 0
    html = out.read_text(encoding="utf-8")
    _self_contained(html)
    report = load_run(one_rank.run_dir)
    trip = report.trips[0]
    page = browser.open(out)
    _check_page(page, out)

    ids = [p["id"] for p in page.info["plots"]]
    expected = ["plot-loss", "plot-grad-norm", "plot-nonfinite", "plot-ranks"]
    if trip.module_stats:  # recorded by the guard
        expected.append(f"plot-modules-{trip.step}")
    else:
        assert "Per-module statistics: not collected" in page.text
    assert ids == expected
    diag = trip.diagnosis
    assert diag is not None
    for text in (
        diag.cause,
        diag.meaning,
        diag.fixes[0],
        diag.fixes[-1],
        str(diag.evidence["why"])[:60],
        "blocks.0.attn",
        "aten._softmax.default",
        "The origin and the ops that followed",
    ):
        assert text in page.text, text
    after = [a["op"] for a in diag.evidence["after"]]
    before = [b["op"] for b in diag.evidence["before"]]
    assert after[0] in page.text and before[-1] in page.text
    assert re.search(rf"{STEPS}\s+STEPS RUN", page.text, re.IGNORECASE)
    assert re.search(r"1\s+ROLLBACKS", page.text, re.IGNORECASE)


def test_html_two_ranks_in_chromium(two_ranks: Path, browser: Browser, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    assert run_report(two_ranks, html=out) == 0
    _self_contained(out.read_text(encoding="utf-8"))
    page = browser.open(out)
    _check_page(page, out)
    assert [p["id"] for p in page.info["plots"]][:4] == ["plot-loss", "plot-grad-norm", "plot-nonfinite", "plot-ranks"]
    assert "data.nonfinite" in page.text and "origin rank 1" in page.text
    assert "batch['pixel_values']" in page.text
    row = rf"rank 1\s+{DIST_STEPS}\s+1\s+\S+\s+\S+\s+1\s"
    assert re.search(row, page.text), "rank 1's table row: it started the trip"


def test_html_module_plot_in_chromium(one_rank: OneRank, browser: Browser, tmp_path: Path) -> None:
    report = load_run(one_rank.run_dir)
    trip = report.trips[0]
    if not trip.module_stats:  # until the guard records them, attach the replayed ones
        trip.module_stats = {0: one_rank.replayed_stats}
    out = write_html(report, tmp_path / "modules.html")
    html = out.read_text(encoding="utf-8")
    assert "not collected" not in html
    svg = re.search(rf'id="plot-modules-{trip.step}".*?(<svg.*?</svg>)', html, re.S).group(1)
    assert ">blocks.0.attn (Attention)</text>" in svg and ">lm_head (Linear)</text>" in svg
    page = browser.open(out, find=("blocks.0.attn (Attention)", "lm_head (Linear)"))
    _check_page(page, out)
    plot = next(p for p in page.info["plots"] if p["id"] == f"plot-modules-{trip.step}")
    assert "blocks.0.attn (Attention)" in plot["texts"] and any("NaN" in t for t in plot["texts"])
    assert page.info["found"] == ["blocks.0.attn (Attention)", "lm_head (Linear)"]  # find-in-page reaches the plot


def test_healthy_run_reports_no_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = build(get("healthy_padding_mask"), seed=0)
    guard = Guard(run.model, run.optimizer, run_dir=tmp_path)
    for _, batch in run.batches(4):
        guard.step(lambda batch=batch: train_step(run.model, batch), batch=batch)
    guard.close()
    report = load_run(tmp_path)
    assert report.trips == [] and report.steps_run == 4
    html = render_html(report)
    assert "No trips: every logged step was finite." in html and html.count('class="plot"') == 4
    assert run_report(tmp_path) == 0
    assert "no trips: every logged step was finite" in capsys.readouterr().out
