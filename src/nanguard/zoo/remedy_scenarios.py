"""Runs that ``policy="auto"`` keeps alive where ``skip`` cannot: each scenario is a short
training loop with a fault that repeats, scored per policy on "the run finished with finite
weights", with its final loss, skips, rollbacks and remedies.

Example:
    >>> rows = score_policies(["skip", "rollback", "auto"])
    >>> [(r["scenario"], r["policy"], r["finished"]) for r in rows][:3]
    [('fp16_attention_overflow', 'skip', False), ...]
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nanguard.errors import NonFiniteError
from nanguard.findings import jsonable
from nanguard.guard import Guard
from nanguard.report.terminal import Console
from nanguard.sampler import QuarantineSampler

__all__ = ["REMEDY_SCENARIOS", "RemedyScenario", "print_scores", "run_remedy_scenario", "score_policies"]

Loop = Callable[[Guard, nn.Module, torch.optim.Optimizer, dict[str, Any]], float]
"""Trains with the guard (the dict holds the scenario's data and run_dir); returns the last finite loss."""


@dataclass(frozen=True)
class RemedyScenario:
    name: str
    description: str
    build: Callable[[], tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]]
    loop: Loop
    options: dict[str, Any]


class Attention(nn.Module):
    """Scores grow with ``scale``; softmax keeps the module's output small either way."""

    def __init__(self, dim: int, scale: float) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        return ((q @ q.transpose(-1, -2)) * self.scale).softmax(-1) @ q


def _overflow_model() -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model = nn.Sequential(nn.Linear(8, 8), Attention(8, 1e5), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), {}


def _overflow_loop(guard: Guard, model: nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> float:
    last = math.nan
    for _ in range(40):
        x, y = torch.randn(4, 6, 8) * 3, torch.randn(4, 6, 1)

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ((model(x).float() - y) ** 2).mean()
            loss.backward()
            return loss

        last = _finite(guard.step(closure, batch=x), last)
    return last


def _regression() -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model = nn.Linear(8, 1, bias=False)
    return model, torch.optim.SGD(model.parameters(), lr=1.5), {"w": torch.randn(8, 1)}


def _regression_loop(
    guard: Guard,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    state: dict[str, Any],
    *,
    steps: int,
    poison_at: int = -1,
) -> float:
    """SGD on a linear regression; at step ``poison_at`` a bad in-place write corrupts one weight."""
    w = state["w"]
    last = math.nan
    for step in range(steps):
        if step == poison_at:
            with torch.no_grad():
                model.get_parameter("weight")[0, 0] = math.nan
        x = torch.randn(32, 8)

        def closure(x: torch.Tensor = x) -> torch.Tensor:
            opt.zero_grad()
            loss = ((model(x) - x @ w) ** 2).mean()
            loss.backward()
            return loss

        last = _finite(guard.step(closure, batch=x), last)
    return last


def _lr_loop(guard: Guard, model: nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> float:
    return _regression_loop(guard, model, opt, state, steps=200)


def _poison_loop(guard: Guard, model: nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> float:
    return _regression_loop(guard, model, opt, state, steps=60, poison_at=20)


def _gentle_regression() -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model = nn.Linear(8, 1, bias=False)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), {"w": torch.randn(8, 1)}


def _scaler_loop(guard: Guard, model: nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> float:
    w, scaler = state["w"], state["scaler"]
    last = math.nan
    for step in range(60):
        x = torch.randn(32, 8)

        def closure(x: torch.Tensor = x, step: int = step) -> torch.Tensor:
            opt.zero_grad()
            loss = ((model(x) - x @ w) ** 2).mean()
            # A stretch of overflowing backward passes (a bad warmup), then healthy ones.
            scaler.scale(loss * (math.inf if 10 <= step < 36 else 1.0)).backward()
            return loss

        last = _finite(guard.step(closure, batch=x), last)
    return last


def _data_loop(guard: Guard, model: nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> float:
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(96, 8, generator=g)
    ys = xs @ state["w"]
    xs[torch.arange(5, 96, 11), 3] = math.nan  # a few corrupt rows
    rows: Any = list(zip(range(96), xs, ys, strict=True))  # a list serves as a map-style dataset
    loader: torch.utils.data.DataLoader[Any] = torch.utils.data.DataLoader(
        rows,
        batch_size=8,
        sampler=QuarantineSampler(range(96), state["run_dir"]),
    )
    last = math.nan
    for _ in range(3):
        for ids, x, y in loader:

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                opt.zero_grad()
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                return loss

            last = _finite(guard.step(closure, batch=(x, y), sample_ids=ids), last)
    return last


def _stopped_by(err: NonFiniteError) -> str:
    text = str(err)
    why = next((w for k, w in _STOPS if k in text), "raised")
    return f"{err.diagnosis.cause}, {why}" if err.diagnosis else why


_STOPS = (
    ("max_consecutive_skips", "max_consecutive_skips reached"),
    ("remedy_budget", "remedy_budget spent"),
    ("skipping cannot help", "a skip cannot fix it"),
)


def _finite(loss: Any, last: float) -> float:
    if loss is None:
        return last
    value = float(loss.detach())
    return value if math.isfinite(value) else last


REMEDY_SCENARIOS: tuple[RemedyScenario, ...] = (
    RemedyScenario(
        "fp16_attention_overflow",
        "attention scores overflow float16 under autocast on every step",
        _overflow_model,
        _overflow_loop,
        {},
    ),
    RemedyScenario("lr_far_too_high", "SGD at about 3x the stable LR on a quadratic", _regression, _lr_loop, {}),
    RemedyScenario(
        "nan_weight",
        "a weight turns NaN between steps (parameter check every 10 updates)",
        _gentle_regression,
        _poison_loop,
        {"param_check_every": 10},
    ),
    RemedyScenario(
        "loss_scale_collapse",
        "26 overflowing backward passes in a row under a GradScaler, then healthy steps",
        _gentle_regression,
        _scaler_loop,
        {"scaler": "cpu"},
    ),
    RemedyScenario(
        "nan_rows_3_epochs",
        "9 of 96 rows hold a NaN; 3 epochs through a QuarantineSampler",
        _gentle_regression,
        _data_loop,
        {},
    ),
)


def run_remedy_scenario(scenario: RemedyScenario, policy: str, seed: int = 0) -> dict[str, Any]:
    """Run one scenario under ``policy``; the row ``score_policies`` reports."""
    torch.manual_seed(seed)
    model, opt, state = scenario.build()
    options = dict(scenario.options)
    scaler = torch.amp.GradScaler(options.pop("scaler")) if "scaler" in options else None
    with tempfile.TemporaryDirectory() as run_dir:
        guard = Guard(model, opt, policy=policy, scaler=scaler, run_dir=run_dir, **options)
        error = None
        try:
            last = scenario.loop(guard, model, opt, {**state, "run_dir": run_dir, "scaler": scaler})
        except NonFiniteError as err:
            last, error = math.nan, _stopped_by(err)
        finally:
            guard.close()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return {
        "scenario": scenario.name,
        "policy": policy,
        "finished": error is None,
        "finite_weights": finite,
        "ok": error is None and finite,
        "final_loss": last,
        "skipped": guard.skipped,
        "rollbacks": guard.rollbacks,
        "remedies": sorted({r["action"] for r in guard.remedies} - {"raise"}),
        "stopped_by": error,
    }


def score_policies(policies: Iterable[str] = ("skip", "rollback", "auto"), seed: int = 0) -> list[dict[str, Any]]:
    """Every remedy scenario under every policy, quietly (the guard's warnings are expected here)."""
    logger = logging.getLogger("nanguard")
    level, logger.level = logger.level, logging.ERROR
    try:
        return [run_remedy_scenario(s, p, seed) for s in REMEDY_SCENARIOS for p in policies]
    finally:
        logger.setLevel(level)


def print_scores(*, as_json: bool = False) -> int:
    """``nanguard zoo --remedies``: the scores as a table (or JSON); 0 when ``auto`` finished every run.

    Example:
        >>> print_scores()
    """
    rows = score_policies()
    if as_json:
        print(json.dumps(jsonable(rows), indent=1))
    else:
        Console().table(
            ["scenario", "policy", "finished, finite weights", "final loss", "skipped", "rollbacks", "remedies"],
            [
                [
                    r["scenario"],
                    r["policy"],
                    "yes" if r["ok"] else f"no: {r['stopped_by']}",
                    f"{r['final_loss']:.3g}",
                    str(r["skipped"]),
                    str(r["rollbacks"]),
                    ", ".join(r["remedies"]) or "-",
                ]
                for r in rows
            ],
            title="Remedy scenarios: does the run finish with finite weights?",
        )
    return 0 if all(r["ok"] for r in rows if r["policy"] == "auto") else 1
