"""The early divergence warning: a grad norm or loss trend that predicts a float32 overflow."""

from __future__ import annotations

import math
import random
from typing import Any

import torch
from torch import nn

import nanguard as ng
from nanguard.guard.history import TREND_POINTS, History, Point
from nanguard.report.html import render_html
from nanguard.report.load import load_run
from nanguard.zoo import get
from nanguard.zoo.scenarios import build


def _history(size: int = 64) -> History:
    return History(
        size=size, spike_window=50, spike_warmup=10, spike_threshold=6.0, divergence_window=5, divergence_factor=10.0
    )


def _warnings(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == "spike" and "predicted_overflow_in" in e]


def test_the_forecasts_shortcut_agrees_with_the_full_fit() -> None:
    # Differential: windows that grow, fall, plateau, jump or go non-finite, at random; each step's
    # forecast with the shortcut (a look at the last step) is the full fit's.
    rng = random.Random(7)
    steps = {"grows": lambda v: v * rng.uniform(1.5, 300.0), "falls": lambda v: v / rng.uniform(1.01, 3.0)}
    steps |= {"flat": lambda v: v, "jump": lambda v: v * 1e6, "nonfinite": lambda v: rng.choice([math.nan, math.inf])}
    fired = 0
    for trial in range(300):
        history, loss, norm = _history(size=rng.choice([8, 64, 4096])), rng.uniform(0.1, 5.0), rng.uniform(0.1, 5.0)
        for step in range(12):
            loss = steps[rng.choice(list(steps))](loss) if math.isfinite(loss) else 1.0
            norm = steps[rng.choice(["grows", "grows", *steps])](norm) if math.isfinite(norm) else 1.0
            history._trend.append(Point(step, loss, norm))
            expected = history._fit()
            assert history._predict() == expected, (trial, list(history._trend))
            fired += expected is not None
    assert fired > 20  # the fits that forecast an overflow were among them


def test_forecast_fires_once_per_episode_and_rearms_after_quiet_steps() -> None:
    history = _history()
    climb = [history.forecast(s, loss=1.0, grad_norm=1e3 * 100.0**s) for s in range(8)]
    fired = [s for s, f in enumerate(climb) if f is not None]
    assert fired == [TREND_POINTS - 1]
    first = climb[TREND_POINTS - 1]
    assert first is not None and first.metric == "grad_norm" and math.isclose(first.growth, 100.0, rel_tol=1e-6)
    # log(3.4e38 / 1e9) / log(100) = 14.8 steps left from the fourth point
    assert first.predicted_overflow_in == 15
    for s in range(8, 8 + TREND_POINTS):
        assert history.forecast(s, loss=1.0, grad_norm=1e12) is None  # flat: the episode ends
    again = [history.forecast(s, loss=1.0, grad_norm=1e3 * 100.0 ** (s - 20)) for s in range(20, 28)]
    assert [s for s, f in zip(range(20, 28), again, strict=True) if f is not None] == [20 + TREND_POINTS - 1]


def test_forecast_stays_quiet_on_slow_broken_or_too_distant_growth() -> None:
    slow = _history()
    assert all(slow.forecast(s, loss=2.0, grad_norm=1.5**s) is None for s in range(40))  # overflow ~220 steps away
    broken = _history()
    zigzag = [1.0, 1e6, 1e3, 1e9, 1e5, 1e12, 1e7, 1e15]  # huge jumps, but not a steady climb
    assert all(broken.forecast(s, loss=1.0, grad_norm=g) is None for s, g in enumerate(zigzag))
    jump = _history()  # one jump, then slow growth: a bf16 model's grad norm early in training
    assert all(jump.forecast(s, loss=5.0, grad_norm=g) is None for s, g in enumerate([1.7, 2.1, 3673.0, 4842.0]))
    short = _history(size=8)  # the same fast climb, but the overflow lies beyond an 8-step window
    assert all(short.forecast(s, loss=1.0, grad_norm=1e3 * 100.0**s) is None for s in range(4))
    nonfinite = _history()
    assert all(nonfinite.forecast(s, loss=math.nan, grad_norm=math.inf) is None for s in range(6))


def _first_nonfinite_plain(name: str, steps: int) -> int:
    run = build(get(name), seed=0)
    for i in range(steps):
        loss = run.closure(run.batch(i))()
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in run.model.parameters() if p.grad is not None))
        if not (math.isfinite(float(loss.detach())) and math.isfinite(float(norm))):
            return i
        run.optimizer.step()
    raise AssertionError(f"{name} stayed finite for {steps} steps")


def test_warning_comes_two_steps_before_the_zoo_lr_too_high_overflow(tmp_path) -> None:
    torch.set_num_threads(1)
    first_bad = _first_nonfinite_plain("lr_too_high", 10)
    run = build(get("lr_too_high"), seed=0)
    events: list[dict[str, Any]] = []
    guard = ng.Guard(
        run.model,
        run.optimizer,
        policy="skip",
        locate=False,
        module_stats=False,
        on_event=events.append,
        run_dir=tmp_path,
    )
    for i in range(first_bad + 1):
        batch = run.batch(i)
        guard.step(run.closure(batch), batch=batch)
    guard.close()
    assert guard.skipped == 1  # the guard tripped where the plain run went non-finite
    warned = _warnings(events)
    assert len(warned) == 1
    assert warned[0]["step"] <= first_bad - 2
    assert warned[0]["predicted_overflow_in"] >= 1
    report = load_run(tmp_path)  # the report reads the warning as a spike marker, and renders it
    assert [m.fields.get("predicted_overflow_in") for m in report.spikes] == [warned[0]["predicted_overflow_in"]]
    assert not report.warnings
    render_html(report)  # a spike without median or score must not break the page


def test_warning_comes_before_the_overflow_of_sgd_on_a_quadratic() -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8))
    opt = torch.optim.SGD([w], lr=2.5)  # w <- w - 2.5 * 2w = -4w: the loss grows 16x per step
    events: list[dict[str, Any]] = []
    guard = ng.Guard(nn.Module(), opt, policy="skip", locate=False, module_stats=False, on_event=events.append)
    first_bad = None
    for i in range(60):

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = (w**2).sum()
            loss.backward()
            return loss

        if guard.step(closure) is None:
            first_bad = i
            break
    assert first_bad is not None and first_bad > 2 * TREND_POINTS
    warned = _warnings(events)
    assert len(warned) == 1
    assert warned[0]["step"] <= first_bad - 2
    # the forecast is geometric and the quadratic is too: it names the overflow within a step or two
    assert abs(warned[0]["step"] + warned[0]["predicted_overflow_in"] - first_bad) <= 2


def test_clean_runs_never_warn() -> None:
    torch.set_num_threads(1)
    events: list[dict[str, Any]] = []
    torch.manual_seed(0)
    true_w = torch.randn(16, 1)
    model = nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = ng.Guard(model, opt, policy="skip", on_event=events.append)
    gen = torch.Generator().manual_seed(1)
    for _ in range(1000):
        x = torch.randn(32, 16, generator=gen)
        y = x @ true_w + 0.5 * torch.randn(32, 1, generator=gen)

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        guard.step(closure)
    run = build(get("healthy_padding_mask"), seed=0)
    zoo_guard = ng.Guard(run.model, run.optimizer, policy="skip", on_event=events.append)
    for i in range(120):
        batch = run.batch(i)
        zoo_guard.step(run.closure(batch), batch=batch)
    bf16 = build(get("healthy_bf16_large_activations"), seed=0)
    bf16_guard = ng.Guard(bf16.model, bf16.optimizer, policy="skip", on_event=events.append)
    for i in range(20):
        batch = bf16.batch(i)
        bf16_guard.step(bf16.closure(batch), batch=batch)
    assert guard.skipped == 0 and zoo_guard.skipped == 0 and bf16_guard.skipped == 0
    assert sum(e["kind"] == "step" for e in events) > 0  # the listener saw the runs
    assert _warnings(events) == []
