"""Early warning with a lead time: per-layer precursors sampled in the step, warned once with the layer,
the signal, its growth, the steps left and the published fix (``nanguard.precursors``).

The runs that warn grow their precursor by construction (a weight scaled up each step, the optimizer's LR
at 0), so what is warned and when does not hang on the CPU's rounding."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard as ng
from nanguard.integrations.loop import LoopGuard
from nanguard.integrations.scalars import scalars_of
from nanguard.precursors import HORIZON, POINTS, SIGNALS, Trend
from nanguard.report.html import render_html
from nanguard.report.load import load_run
from nanguard.tracer.precursors import Capture, layers
from nanguard.zoo.gpt import GPT, GPTConfig, synthetic_batch

EVERY = 2


def _squared(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> Any:
    """A step's closure: the mean square of the model's output on ``x``, backward."""

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    return closure


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_embd=32, n_head=2, block_size=16, vocab_size=64))


def _driven(model: nn.Module, grow: Any, steps: int, **options: Any) -> tuple[list[dict[str, Any]], ng.Guard]:
    """``steps`` guarded steps on one batch with the LR at 0: only ``grow(model)`` changes the weights."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    events: list[dict[str, Any]] = []
    guard = ng.Guard(model, opt, on_event=events.append, precursor_every=EVERY, **options)
    batch = synthetic_batch(model.config, torch.Generator().manual_seed(0))  # type: ignore[arg-type]
    for _ in range(steps):
        with torch.no_grad():
            grow(model)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            _, loss = model(**batch)
            loss.backward()
            return loss

        guard.step(closure)
    guard.close()
    return [e for e in events if e["kind"] == "warning"], guard


def _scale_q(model: GPT, factor: float) -> None:
    with torch.no_grad():
        model.blocks[1].attn.qkv.weight[: model.config.n_embd].mul_(factor)


def test_attention_logits_grown_each_step_are_warned_once_with_the_layer_the_growth_and_the_fix() -> None:
    model = _gpt()
    _scale_q(model, 60.0)  # the largest logit near 1 from the start
    warnings, _ = _driven(model, lambda m: _scale_q(m, 1.2), steps=18)
    assert len(warnings) == 1, warnings
    w = warnings[0]
    assert (w["signal"], w["module"]) == ("attn_logit", "blocks.1.attn")
    assert math.isclose(w["trend"], 1.2, rel_tol=1e-3)  # q grows x1.2 a step: the logits with it
    left = math.log(SIGNALS["attn_logit"].limit / w["value"]) / math.log(w["trend"])
    assert w["steps_left"] == math.ceil(left) and w["steps_left"] >= 10
    assert w["value"] >= SIGNALS["attn_logit"].limit / 8 and "QK-norm" in w["fix"]
    assert [s for s, _ in w["series"]] == list(range(w["step"] - (POINTS - 1) * EVERY, w["step"] + 1, EVERY))
    assert w["limit"] == SIGNALS["attn_logit"].limit and w["level"] == w["series"][0][1]


def test_the_warning_is_in_the_event_log_and_plotted_in_the_html_report(tmp_path) -> None:
    model = _gpt()
    _scale_q(model, 60.0)
    warnings, _ = _driven(model, lambda m: _scale_q(m, 1.2), steps=18, run_dir=tmp_path)
    report = load_run(tmp_path)
    (marker,) = report.early_warnings
    assert (marker.fields["signal"], marker.fields["module"]) == ("attn_logit", "blocks.1.attn")
    assert marker.fields["series"] == warnings[0]["series"]
    html = render_html(report)
    assert 'id="plot-precursors"' in html and "steps left" in html


def test_output_logits_grown_each_step_are_warned_as_log_z_of_the_head() -> None:
    model = _gpt()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    warnings, _ = _driven(model, lambda m: m.lm_head.weight.mul_(1.2), steps=24)
    head = [w for w in warnings if (w["signal"], w["module"]) == ("logit_z", "lm_head")]
    assert len(head) == 1 and "z-loss" in head[0]["fix"]


class _Router(nn.Module):
    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = F.softmax(self.gate(x), dim=-1)
        weight, index = torch.topk(gates, 1, dim=-1)
        return sum(weight * (index == e) * expert(x) for e, expert in enumerate(self.experts))


class _Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Router(16, 4)])
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers[0](x))


def test_router_logits_are_found_by_what_the_router_computes_and_warned() -> None:
    torch.manual_seed(0)
    model = _Moe()
    with torch.no_grad():
        model.layers[0].gate.weight.mul_(2.0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)  # its state fills; the drive outgrows its steps
    events: list[dict[str, Any]] = []
    guard = ng.Guard(model, opt, on_event=events.append, precursor_every=EVERY)
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(24):
        with torch.no_grad():
            model.layers[0].gate.weight.mul_(1.2)

        guard.step(_squared(model, opt, x))
    guard.close()
    warned = [(e["signal"], e["module"]) for e in events if e["kind"] == "warning"]
    assert ("router_logit", "layers.0.gate") in warned
    (router,) = [e for e in events if e["kind"] == "warning" and e["module"] == "layers.0.gate"]
    assert 0 < router["context"]["adam_update"] < math.inf  # Adam's update of the warned router, read at the warning
    assert not any(signal == "attn_logit" for signal, _ in warned)  # a router's softmax is no attention


def _healthy_run(guarded: bool, steps: int = 12) -> tuple[list[torch.Tensor], torch.Tensor, list[dict[str, Any]]]:
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    events: list[dict[str, Any]] = []
    guard = ng.Guard(model, opt, on_event=events.append, precursor_every=1) if guarded else None
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        batch = synthetic_batch(model.config, gen)

        def closure(batch: dict[str, torch.Tensor] = batch) -> torch.Tensor:
            opt.zero_grad()
            _, loss = model(**batch)
            (loss + 0.0 * torch.rand(())).backward()  # draws from the global RNG, as dropout would
            return loss

        if guard is not None:
            guard.step(closure)
        else:
            closure()
            opt.step()
    if guard is not None:
        guard.close()
    state = [t.clone() for s in opt.state.values() for t in s.values()]
    return [p.detach().clone() for p in model.parameters()] + state, torch.get_rng_state(), events


def test_a_healthy_run_sampled_every_step_is_bit_identical_to_the_unguarded_one_and_silent() -> None:
    torch.manual_seed(0)
    plain, plain_rng, _ = _healthy_run(guarded=False)
    torch.manual_seed(0)
    guarded, guarded_rng, events = _healthy_run(guarded=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, guarded, strict=True))
    assert torch.equal(plain_rng, guarded_rng)
    assert [e for e in events if e["kind"] == "warning"] == []


def test_the_capture_measures_what_the_step_computes() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 4) for _ in range(3))

    class Sdpa(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Sdpa()])

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.blocks[0](q, k, v)

    model = Outer()
    with Capture(model) as capture:
        out = model(q, k, v)
    scores = (q @ k.transpose(-2, -1)) / 2.0
    scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), -math.inf)
    assert torch.equal(capture.values[("blocks.0", "attn_logit")], scores.amax())  # masked pairs are no logits
    rms = out.square().mean().sqrt()
    torch.testing.assert_close(capture.values[("blocks.0", "output_rms")], rms)
    assert [n for n, _ in layers(_gpt())] == ["blocks.0", "blocks.1"]


class _Seen(Capture):
    """A capture that lists the module each op it sees ran in."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.seen: list[str | None] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.seen.append(self._here)
        return super().__torch_function__(func, types, args, kwargs)


def _captured(capture: Capture, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[Any, torch.Tensor]:
    with capture:
        model(**batch)
    return dict(capture.values)


def test_later_forwards_see_the_modules_the_measurements_ran_in_alone_and_measure_the_same() -> None:
    model = _gpt()
    batch = synthetic_batch(model.config, torch.Generator().manual_seed(0))  # type: ignore[arg-type]
    capture = _Seen(model)
    first = _captured(capture, model, batch)
    learning = list(capture.seen)
    capture.seen.clear()
    later = [_captured(capture, model, batch) for _ in range(2)]
    sites = {"", "blocks.0.attn", "blocks.1.attn", "lm_head"}  # the loss at the root: log Z's ops run there
    assert set(capture.seen) == sites and set(learning) > sites  # every module's ops while learning
    assert len(capture.seen) < 2 * len(learning) * 0.8
    assert sorted(first) == [
        ("blocks.0", "output_rms"),
        ("blocks.0.attn", "attn_logit"),
        ("blocks.1", "output_rms"),
        ("blocks.1.attn", "attn_logit"),
        ("lm_head", "logit_z"),
    ]
    for values in later:
        assert values.keys() == first.keys() and all(torch.equal(values[k], first[k]) for k in first)
    assert not any("forward" in vars(m) for m in model.modules())  # each module's own forward back


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.attends = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        return (x @ x.transpose(-2, -1)).softmax(-1) @ x if self.attends else x


class _Path(nn.Module):
    """Two layers, the first attending; a third run only when ``extra`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(3))
        self.layers[0].attends = self.layers[2].attends = True  # type: ignore[union-attr]
        self.extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[: 3 if self.extra else 2]:
            x = layer(x)
        return x


def test_a_forward_down_another_path_is_seen_or_learned_again() -> None:
    torch.manual_seed(0)
    model, x = _Path(), torch.randn(4, 8)
    capture = Capture(model)

    def both() -> tuple[dict[Any, torch.Tensor], dict[Any, torch.Tensor]]:
        with capture:
            model(x)
        with Capture(model) as fresh:  # sees every op
            model(x)
        return dict(capture.values), dict(fresh.values)

    def same(a: dict[Any, torch.Tensor], b: dict[Any, torch.Tensor]) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    assert same(*both())  # learned: layers.0's attention
    model.extra = True  # a layer never run before: its ops are seen at once
    now, fresh = both()
    assert same(now, fresh) and ("layers.2", "attn_logit") in now
    model.layers[0].attends, model.layers[1].attends = False, True  # type: ignore[union-attr]
    # moved into a layer that ran before without measuring: missed once, then learned again
    now, fresh = both()
    assert ("layers.0", "attn_logit") not in now and ("layers.1", "attn_logit") in fresh
    assert same(*both())


def test_a_layer_skipped_that_only_gave_its_output_rms_is_no_other_path() -> None:
    torch.manual_seed(0)
    model, x = _Path(), torch.randn(4, 8)
    model.extra, model.layers[2].attends = True, False  # type: ignore[union-attr]
    capture = _Seen(model)
    with capture:
        model(x)
    model.extra = False  # as an MoE expert no token chose
    for _ in range(2):
        capture.seen.clear()
        with capture:
            model(x)
        assert set(capture.seen) == {"layers.0"} and ("layers.0", "attn_logit") in capture.values


@pytest.mark.parametrize(
    ("series", "warns"),
    [
        ([12.0 * 1.05**s for s in range(0, 40, 10)], True),  # steady growth, within the horizon
        ([12.0, 30.0, 30.0, 60.0], False),  # a plateau: not rising at every sample
        ([60.0, 40.0, 30.0, 20.0], False),  # falling
        ([1.0 * 1.02**s for s in range(0, 40, 10)], False),  # far below the limit (more than 8x)
        ([12.0, 12.5, 13.0, 18.1], False),  # rising, but less than 1.5x in all
        ([12.0 * 1.15**i for i in range(4)], False),  # x1.014 a step: the limit lies beyond the horizon
    ],
)
def test_the_trend_rule(series: list[float], warns: bool) -> None:
    trend = Trend()
    found = [trend.add(10 * i, {("blocks.0.attn", "attn_logit"): v}) for i, v in enumerate(series)]
    assert bool(found[-1]) is warns
    assert not any(found[:-1])
    if warns:
        assert found[-1][0].steps_left <= HORIZON
        assert trend.add(40, {("blocks.0.attn", "attn_logit"): series[-1] * 2}) == []  # once per (layer, signal)
        again = Trend()
        for i, v in enumerate(series):
            found = again.add(10 * i, {("blocks.0.attn", "attn_logit"): v, ("blocks.0.attn", "output_rms"): 2.0})
        assert found[0].context == {"output_rms": 2.0}  # the module's other signals at that sample


def test_auto_lowers_the_lr_on_a_warning_only_when_asked() -> None:
    for asked in (False, True):
        model = _gpt()
        _scale_q(model, 60.0)
        warnings, guard = _driven(model, lambda m: _scale_q(m, 1.2), steps=18, policy="auto", precursor_lower_lr=asked)
        assert len(warnings) == 1
        lowered = [r for r in guard.remedies if r["action"] == "lower_lr"]
        assert len(lowered) == (1 if asked else 0)
        assert guard._remedies.lr_factor == (0.5 if asked else 1.0)
    with pytest.raises(ValueError, match="precursor_every"):
        ng.Guard(_gpt(), torch.optim.SGD(_gpt().parameters(), lr=0.1), precursor_every=-1)


def test_a_warning_reaches_tensorboard_and_wandb_through_the_scalars() -> None:
    counts: dict[str, int] = {}
    event = {"kind": "warning", "step": 26, "signal": "attn_logit", "module": "blocks.1.attn", "value": 30.0}
    out = scalars_of({**event, "steps_left": 12}, counts)
    assert out["nanguard/warnings"] == 1.0 and out["nanguard/precursor/attn_logit"] == 30.0
    assert scalars_of({"kind": "step", "step": 27, "loss": 1.0}, counts)["nanguard/warnings"] == 1.0


def test_a_failure_of_the_precursor_check_never_stops_the_run(monkeypatch, caplog) -> None:
    def broken(self: Capture, model: nn.Module) -> None:
        raise RuntimeError("a capture that cannot start")

    monkeypatch.setattr(Capture, "__init__", broken)
    model = _gpt()
    warnings, guard = _driven(model, lambda m: _scale_q(m, 1.2), steps=6)
    assert warnings == [] and guard.step_count == 6 and guard.skipped == 0
    assert "precursor check failed and stops" in caplog.text and guard.precursors.every == 0


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _frozen_stretch(beta2: float, set_to_none: bool, *, loop: bool = False) -> list[dict[str, Any]]:
    """Layer 1 frozen (``requires_grad=False``) from step 25 on; ``zero_grad(set_to_none=False)`` keeps its
    gradients at exactly zero, so Adam keeps stepping it and its m and v decay (zero gradients: the decay
    is beta1**k and beta2**k, the same on any CPU). ``loop``: the user's own loop under ``LoopGuard``."""
    torch.manual_seed(0)
    model = _Stack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, beta2))
    events: list[dict[str, Any]] = []
    make = LoopGuard if loop else ng.Guard
    guard = make(model, opt, on_event=events.append, precursor_every=5)
    gen = torch.Generator().manual_seed(3)
    for step in range(100):
        model.layers[1].requires_grad_(step < 25)
        x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 16, generator=gen)

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            opt.zero_grad(set_to_none=set_to_none)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        if loop:  # the check, and the next sample's arming, run inside the optimizer's step hooks
            closure()
            opt.step()
        else:
            guard.step(closure)
    guard.close()
    return [e for e in events if e["kind"] == "warning"]


def test_adams_second_moment_decaying_while_a_layer_gets_no_gradient_is_warned_for_that_layer() -> None:
    warnings = _frozen_stretch(beta2=0.95, set_to_none=False)
    assert [(w["signal"], w["module"]) for w in warnings] == [("adam_v_decay", "layers.1")]
    (w,) = warnings
    assert w["value"] >= 1.0 and "beta2" in w["fix"] and 0 <= w["context"]["adam_update"] < 0.1
    # the twins: a larger beta2 (v forgets slowly), or gradients set to None (Adam skips the frozen layer)
    assert _frozen_stretch(beta2=0.999, set_to_none=False) == []
    assert _frozen_stretch(beta2=0.95, set_to_none=True) == []


def test_a_loop_guard_samples_from_inside_the_optimizers_hooks_and_warns_as_guard_step_does() -> None:
    under_step = _frozen_stretch(beta2=0.95, set_to_none=False)
    in_loop = _frozen_stretch(beta2=0.95, set_to_none=False, loop=True)
    assert [(w["signal"], w["module"], w["step"]) for w in in_loop] == [
        (w["signal"], w["module"], w["step"]) for w in under_step
    ]
    assert in_loop


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=3e-2, weight_decay=0.1),  # the decay decoupled: taken out
        lambda ps: torch.optim.Adam(ps, lr=3e-2, weight_decay=0.1),  # the decay in the gradient
        lambda ps: torch.optim.Adam(ps, lr=torch.tensor(3e-2)),  # a tensor LR
    ],
)
def test_the_update_ratio_and_adams_update_are_what_the_step_did(make: Any) -> None:
    """Read from the update itself (w_old - w_new), its decoupled decay taken out: equal to m_hat / (sqrt(v_hat)
    + eps) from Adam's state, and nothing for a layer the step left alone (no gradient)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = make(model.parameters())
    guard = ng.Guard(model, opt, precursor_every=1)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    for step in range(6):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}

        def closure(step: int = step) -> torch.Tensor:
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            if step == 5:
                for p in model[2].parameters():
                    p.grad = None  # the middle layer sits this step out
            return loss

        guard.step(closure)
    series = guard.precursors.trend.series
    beta1, beta2 = opt.param_groups[0]["betas"]
    for module in ("0", "4"):
        params = [(n, p) for n, p in model.named_parameters() if n.startswith(module + ".")]
        moved = sum(float((before[n] - p.detach()).square().sum()) for n, p in params)
        size = sum(float(before[n].square().sum()) for n, _ in params)
        u2, count = 0.0, 0
        for _, p in params:
            state = opt.state[p]
            t = float(state["step"])
            denom = (state["exp_avg_sq"] / (1 - beta2**t)).sqrt() + opt.param_groups[0]["eps"]
            u2 += float((state["exp_avg"] / (1 - beta1**t) / denom).square().sum())
            count += p.numel()
        assert series[(module, "update_ratio")][-1][1] == pytest.approx(math.sqrt(moved / size), rel=1e-4)
        assert series[(module, "adam_update")][-1][1] == pytest.approx(math.sqrt(u2 / count), rel=1e-3)
    assert not series[("2", "update_ratio")] and not series[("2", "adam_update")]  # 0: no growth, the series cleared
    guard.close()


@pytest.mark.parametrize(
    ("series", "raw", "warns"),
    [
        ([33.2, 32.2, 59.4, 40.9], True, True),  # noisy, no growth, one swing (x1.84) from exp's overflow
        ([33.2, 32.2, 59.4, 40.9], False, False),  # the same under a softmax that subtracts its max: no limit
        ([50.0, 55.0, 52.0, 54.0], True, False),  # near the limit, but steady: a swing of x1.1 does not reach it
        ([5.0, 3.0, 6.0, 4.0], True, False),  # swinging x2, far below the limit
    ],
)
def test_a_hard_limit_one_swing_away_is_warned_without_a_growth(series: list[float], raw: bool, warns: bool) -> None:
    key = ("blocks.0.attn", "attn_logit")
    trend = Trend()
    found = [trend.add(20 * i, {key: v}, {key} if raw else ()) for i, v in enumerate(series)]
    assert not any(found[:-1])
    assert bool(found[-1]) is warns
    if warns:
        (w,) = found[-1]
        assert (w.value, w.level, w.steps_left) == (max(series), min(series), 0)


def test_an_attention_softmax_written_by_hand_is_measured_as_a_hard_limit() -> None:
    """An ``exp`` over the scores (a softmax without the max subtraction) marks its attention logit raw."""
    model = GPT(GPTConfig(n_embd=32, n_head=2, block_size=16, vocab_size=64, naive_softmax=True))
    batch = synthetic_batch(model.config, torch.Generator().manual_seed(0))  # type: ignore[arg-type]
    with Capture(model) as capture:
        model(**batch)
    assert capture.raw == {("blocks.0.attn", "attn_logit"), ("blocks.1.attn", "attn_logit")}
    safe = _gpt()  # F.softmax: its max subtracted
    with Capture(safe) as capture:
        safe(**batch)
    assert capture.raw == set() and ("blocks.0.attn", "attn_logit") in capture.values


class _CountedAdam(torch.optim.Optimizer):
    """An Adam-like optimizer that keeps its step count as a Python int (a new object each step)."""

    def __init__(self, params: Any, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (state["exp_avg_sq"] / (1 - beta2 ** state["step"])).sqrt() + group["eps"]
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1 ** state["step"]))


def test_adams_bias_correction_reads_a_step_count_kept_as_a_number_afresh() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = _CountedAdam(model.parameters())
    guard = ng.Guard(model, opt, precursor_every=1)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(5):
        guard.step(_squared(model, opt, x))
    (group,) = guard.precursors._adam_groups()
    assert group.steps().tolist() == [5.0] * len(group.params) == [float(opt.state[p]["step"]) for p in group.params]
    guard.close()
