"""Diagnosis, fifth round (issue 42, items 1 and 3): weights that training grew are an optimizer cause,
not ``init.scale``, with the growth in the evidence; a -inf written through a view or an alias of a
policy's logits is the write's origin. Short variants on small MLPs; the zoo's long runs on the tiny GPT
(``nanguard.zoo.growth_scenarios``) run under ``-m slow`` in ``tests/test_zoo.py``."""

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard as ng
from nanguard.guard.growth import WeightLog
from nanguard.zoo.growth_scenarios import warmup_linear, warmup_linear_clamped
from nanguard.zoo.runner import run_wild
from nanguard.zoo.wild import get_wild
from nanguard.zoo.wild_views import safe_entropy_case


class NormNet(nn.Module):
    """A projection whose scale a LayerNorm removes: the loss barely sees how large ``proj`` grows."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.proj(x)))


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g)
    return x, (x[:, :4].sum(-1) > 0).long()


def _train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    *,
    after: Callable[[int], None] = lambda step: None,
    regression: bool = False,
) -> tuple[ng.Diagnosis | None, int | None, Callable[[], torch.Tensor]]:
    """Train under a default Guard (policy "skip") until its first trip; after(step) is the loop's own code."""
    guard = ng.Guard(model, optimizer, policy="skip")
    closure: Callable[[], torch.Tensor] = lambda: torch.zeros(())  # noqa: E731
    try:
        for step in range(steps):
            x, y = _batch(step)

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                optimizer.zero_grad()
                out = model(x)
                loss = F.mse_loss(out.squeeze(-1), x[:, 0] * 0.5) if regression else F.cross_entropy(out, y)
                loss.backward()
                return loss

            guard.step(closure)
            if guard.last_diagnosis is not None:
                return guard.last_diagnosis, step, closure
            with torch.no_grad():
                after(step)
    finally:
        guard.close()
    return None, None, closure


def _grow(model: NormNet, factor: float, start: int) -> Callable[[int], None]:
    def after(step: int) -> None:
        if step >= start:
            model.proj.weight.mul_(factor)  # a hand-written update that scales the weights each step

    return after


def test_weights_grown_slowly_for_100_steps_are_divergence_with_the_rate_the_onset_and_the_lr() -> None:
    # x1.5 a step is never tenfold within the 5-step window (x1.2 on the tiny GPT: the zoo's slow run).
    torch.manual_seed(0)
    model = NormNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    diag, step, closure = _train(model, optimizer, 300, after=_grow(model, 1.5, start=20))
    assert diag is not None and step is not None and step > 100  # grew for 100+ steps first
    assert diag.cause == "optimizer.divergence"
    grown = diag.evidence["history"]["weights"]
    assert grown["parameter"] == "proj.weight" and grown["growth"] > 1e10
    assert grown["per_step"] == pytest.approx(1.5, rel=0.01)
    assert 20 - grown["sampled_every"] <= grown["since"] <= 20 + grown["sampled_every"]
    assert "x1.5 a step since step" in diag.evidence["why"] and "lr 0.01" in diag.evidence["why"]
    assert diag.evidence.get("op_cause") != "init.scale" and "init.scale" not in [a["cause"] for a in diag.also]
    # ng.locate on the tripped step: no history, yet the weights were written by training: not the init's size.
    located = ng.locate(closure, model=model)
    assert located is not None and located.cause == "optimizer.divergence"
    assert "written in place" in located.evidence["why"] and "history" in located.evidence["why"]


def test_a_model_whose_init_is_too_large_is_still_init_scale() -> None:
    result = run_wild(get_wild("deep_mlp_gain_as_std"))
    assert result.ok and result.got is not None and result.got["cause"] == "init.scale"


def test_weights_shrinking_slowly_never_trip() -> None:
    torch.manual_seed(0)
    model = NormNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    diag, _, _ = _train(model, optimizer, 200, after=_grow(model, 0.999, start=40))
    assert diag is None


@pytest.mark.parametrize("clamped", [False, True])
def test_a_schedule_past_its_end_names_the_step_the_lr_went_negative(clamped: bool) -> None:
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    factor = warmup_linear_clamped if clamped else warmup_linear
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    diag, step, _ = _train(model, optimizer, 300, after=lambda step: scheduler.step(), regression=True)
    if clamped:
        assert diag is None  # the healthy twin: the LR rests at 0 past the end
        return
    assert diag is not None and step is not None and step > 61
    assert diag.cause == "optimizer.divergence"
    history = diag.evidence["history"]
    assert history["weights"]["lr_negative_since"] == 61  # (60 - 61) / 50 < 0 first at step 61
    assert history["lr"] < 0 and "negative" in diag.evidence["why"]
    assert "went negative at step 61" in diag.fixes[0] and "clamp" in diag.fixes[0]


@pytest.mark.parametrize("sign", [+1.0, -1.0])
def test_weight_decay_with_the_wrong_sign_is_divergence_and_the_right_sign_is_quiet(sign: float) -> None:
    torch.manual_seed(0)
    model = NormNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def decay(step: int) -> None:
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(p, alpha=sign * 0.05 * 4.0)  # decoupled decay: alpha=-lr*wd, here with its sign flipped

    diag, _, _ = _train(model, optimizer, 250, after=decay)
    if sign < 0:
        assert diag is None
        return
    assert diag is not None and diag.cause == "optimizer.divergence"
    grown = diag.evidence["history"]["weights"]
    assert grown["growth"] >= 100 and grown["per_step"] == pytest.approx(1.2, rel=0.05)
    assert any("weight decay must shrink the weights" in fix for fix in diag.fixes)


def test_the_weight_log_adds_no_host_read_between_trips(monkeypatch) -> None:
    model = NormNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    log = WeightLog(model, optimizer, every=2)
    reads = []
    for name in ("item", "tolist", "__bool__", "__float__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _r=real: reads.append(_n) or _r(self, *a))
    for step in range(10):
        with torch.no_grad():
            model.proj.weight.mul_(2.0)
        log.record(step)
    monkeypatch.undo()
    assert reads == [] and len(log.samples) == 5
    found = log.evidence(10)
    assert found["parameter"] == "proj.weight" and found["per_step"] == pytest.approx(2.0, rel=1e-6)
    assert found["growth"] == pytest.approx(2.0**10, rel=1e-6) and found["since"] == 0


def test_the_weight_log_reads_a_norm_past_float32s_square() -> None:
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(1.0)
    log = WeightLog(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with torch.no_grad():
        model.weight.fill_(1e30)  # its float32 norm is Inf; in float64 it is 4e30
    found = log.evidence(1)
    assert (
        found["parameter"] == "weight" and math.isfinite(found["norm_now"]) and found["growth"] == pytest.approx(1e30)
    )


# -- a -inf written through a view ------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "op", "through"),
    [
        ("topk_filter_through_a_view", "aten.masked_fill_.Scalar", "view"),
        ("topk_filter_through_data", "aten.index_put_.default", "alias"),
        ("top_p_scatter_into_a_view", "aten.scatter_.value", "view"),
    ],
)
def test_a_minus_inf_written_through_a_view_is_the_write_with_its_base_module_and_line(name, op, through) -> None:
    case = get_wild(name).build()
    diag = ng.locate(case.fn, *case.args, model=case.model)
    assert diag is not None
    assert (diag.cause, diag.op, diag.module, diag.phase) == ("op.mask_fill_in_loss", op, "", "forward")
    origin = diag.evidence["origin"]
    into = origin["written_into"]
    assert into["through"] == through
    assert into["base"]["module"] == "head" and into["base"]["op"] == "aten.addmm.default"
    assert origin["source"].endswith(f"wild_views.py:{_line_of(op)}")
    assert "of the output of aten.addmm.default in 'head'" in diag.evidence["why"]
    assert origin["outputs"][0]["neginf"] == 4 * (12 - 3)  # the positions written, not the one value


def _line_of(op: str) -> int:
    """The line of ``nanguard/zoo/wild_views.py`` that writes with ``op``."""
    import nanguard.zoo.wild_views as views

    needle = {
        "aten.masked_fill_.Scalar": ".masked_fill_(",
        "aten.index_put_.default": ".data[",
        "aten.scatter_.value": ".scatter_(",
    }
    with open(views.__file__, encoding="utf-8") as source:
        lines = source.read().splitlines()
    return next(i for i, line in enumerate(lines, 1) if needle[op] in line and "float(" in line)


def test_the_guard_names_the_write_too_and_the_safe_entropy_stays_quiet() -> None:
    case = get_wild("topk_filter_through_data").build()
    optimizer = torch.optim.SGD(case.model.parameters(), lr=0.01)
    guard = ng.Guard(case.model, optimizer, policy="skip")
    guard.step(lambda: case.fn(*case.args))
    diag = guard.last_diagnosis
    assert diag is not None and (diag.cause, diag.op) == ("op.mask_fill_in_loss", "aten.index_put_.default")
    safe = safe_entropy_case()
    assert ng.locate(safe.fn, *safe.args, model=safe.model) is None


# -- the rules on hand-built evidence --------------------------------------------------------
_GROWN = {"parameter": "fc.weight", "norm_start": 1.0, "norm_now": 1e9, "growth": 1e9, "per_step": 1.2, "since": 30}


def _overflow(op: str, **origin: object) -> dict:
    return {
        "origin": {"category": "op", "op": op, "module": "fc", "inputs": [{"absmax": 1e6}], **origin},
        "kind": "inf",
        "weight_scale": {"max_ratio": 300.0, "module": "fc"},
        "initial_weight_scale": {"max_ratio": 0.5, "module": "fc"},
    }


def test_a_product_overflow_of_grown_weights_names_the_growth_and_a_negative_lr_first() -> None:
    from nanguard.diagnose import diagnose

    ev = {**_overflow("aten.addmm.default"), "history": {"lr": -0.01, "weights": {**_GROWN, "lr_negative_since": 61}}}
    verdict = diagnose(ev)
    assert verdict.cause == "optimizer.divergence"
    assert "grew 1e+09x" in verdict.why and "x1.2 a step since step 30" in verdict.why
    assert "negative (-0.01) since step 61" in verdict.why and "went negative at step 61" in verdict.fixes[0]
    assert "init.scale" not in [a["cause"] for a in verdict.also]


def test_an_op_level_cause_keeps_its_name_and_the_growth_goes_to_also() -> None:
    from nanguard.diagnose import diagnose

    # A softmax written without its max overflows exp: the op's fix comes first, whatever grew the scores.
    ev = {**_overflow("aten.exp.default"), "history": {"lr": 0.01, "weights": _GROWN}}
    ev["origin"]["inputs"] = [{"absmax": 1e6, "max": 1e6}]
    verdict = diagnose(ev)
    assert verdict.cause == "op.exp_overflow"
    # Large at the start and not grown since: the init's.
    still = {**_overflow("aten.addmm.default"), "initial_weight_scale": {"max_ratio": 300.0, "module": "fc"}}
    assert diagnose(still).cause == "init.scale"


def test_a_weight_log_that_fails_never_stops_the_run_or_its_diagnosis(monkeypatch) -> None:
    def broken(self: WeightLog) -> torch.Tensor:
        raise RuntimeError("no norms here")

    monkeypatch.setattr(WeightLog, "_norms", broken)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ng.Guard(model, optimizer, policy="skip")
    x = torch.ones(2, 3)

    def step(bad: bool) -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(x).log().sum() if bad else model(x).pow(2).sum()
        loss.backward()
        return loss

    for _ in range(10):
        guard.step(lambda: step(False))
    assert guard.last_diagnosis is None and guard.skipped == 0
    with torch.no_grad():
        model.weight.fill_(-1.0)
        model.bias.zero_()
    guard.step(lambda: step(True))
    assert guard.last_diagnosis is not None and guard.last_diagnosis.cause == "op.log_domain"
    guard.close()
