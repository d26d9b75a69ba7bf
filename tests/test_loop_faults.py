"""Faults found guarding real training loops (llm.c- and litgpt-style, issue 27), through the public API:
a learning rate far too high, huge finite gradients before the loop's own clip, a NaN row of a loaded
checkpoint, a compiled healthy run, the guard's clip, float16 AdamW and a division by the number 0."""

import pytest
import torch

import nanguard as ng
from nanguard.events import read_events
from nanguard.zoo import GPT, GPTConfig, synthetic_batch


def _gpt(dtype=torch.float32, **config):
    torch.manual_seed(0)
    return GPT(GPTConfig(**config)).to(dtype)


def _closure(model, optimizer, step, net=None):
    batch = synthetic_batch(model.config, torch.Generator().manual_seed(step))

    def closure():
        optimizer.zero_grad(set_to_none=True)
        _, loss = (net or model)(**batch)
        loss.backward()
        return loss

    return closure, batch


def _run(guard, model, optimizer, steps, net=None):
    for step in range(steps):
        closure, batch = _closure(model, optimizer, step, net)
        guard.step(closure, batch=batch)
        if guard.last_diagnosis is not None:
            return step
    return None


# -- item 4: a learning rate far too high is not a LayerNorm eps ---------------------------
def test_lr_far_too_high_is_divergence_not_layernorm_eps_and_auto_lowers_the_lr() -> None:
    model = _gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e6)  # 1e-6 typed without its minus
    guard = ng.Guard(model, optimizer, policy="auto")
    assert _run(guard, model, optimizer, 3) == 1  # one update, then the LayerNorm input's variance is Inf
    diag = guard.last_diagnosis
    assert diag.cause == "optimizer.divergence", diag
    assert "not a zero variance" in diag.evidence["why"]
    assert "layer_norm" in diag.op and diag.evidence["origin"]["max_variance"] == float("inf")
    assert not any("eps" in fix for fix in diag.fixes)
    assert guard.remedies[-1]["cause"] == "optimizer.divergence"
    assert guard.remedies[-1]["action"] == "rollback"
    assert optimizer.param_groups[0]["lr"] == 1e6 * guard.config.lr_factor  # the LR remedy


# -- item 9: float16 AdamW's eps, and h / 0.0 ----------------------------------------------
def test_float16_adamw_fixes_say_its_default_eps_is_zero_in_float16() -> None:
    model = _gpt(torch.float16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # eps=1e-8 rounds to 0 in float16
    guard = ng.Guard(model, optimizer, policy="skip")
    with pytest.raises(ng.NonFiniteError) as err:  # skipping cannot repair parameters
        _run(guard, model, optimizer, 3)
    diag = err.value.diagnosis
    assert (diag.cause, diag.module, diag.step) == ("optimizer.nonfinite_update", "wte", 0)
    assert "eps=1e-08 is 0 in float16" in diag.fixes[0]


def test_a_python_scalar_zero_divisor_is_a_division_by_zero_like_a_zero_tensor() -> None:
    model = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)

    def step(divisor):
        model.zero_grad()
        loss = torch.log_softmax(model(x) / divisor, -1).mean()
        loss.backward()
        return loss

    for divisor in (0.0, 0, torch.zeros(())):
        diag = ng.locate(lambda d=divisor: step(d), model=model)
        assert diag is not None and diag.cause == "op.division_by_zero", (divisor, diag)
        assert diag.op == "aten.div.Tensor"


# -- item 5: huge but finite gradients, caught before the loop's own clip ------------------


def test_growth_trips_only_with_both_metrics_on_a_spike_of_warm_detectors() -> None:
    from nanguard.guard.history import History

    def feed(values):
        h = History(size=64, spike_window=50, spike_warmup=10, spike_threshold=6.0, divergence_window=5,
                    divergence_factor=10.0)  # fmt: skip
        for step, (loss, gn) in enumerate(values):
            h.observe(step, loss=loss, grad_norm=gn)
            if (found := h.runaway(step, loss=loss, grad_norm=gn)) is not None:
                return step, found
            h.append(step, loss=loss, grad_norm=gn)
        return None

    warm = [(2.0 + 0.01 * (i % 3), 1.0 + 0.01 * (i % 5)) for i in range(20)]
    step, found = feed([*warm, (30.0, 15.0)])
    assert step == 20 and found["metric"] == "loss" and not found["float32_overflow"]
    assert feed([*warm, (30.0, 1.1)]) is None  # the loss alone grew
    assert feed([*warm, (2.1, 40.0)]) is None  # the grad norm alone grew
    assert feed([(2.0, 0.01), (30.0, 15.0)]) is None  # a run's first steps: the detectors are cold
    assert feed([(2.0 * 1.02**i, 1.02**i) for i in range(200)]) is None  # a slow climb is a trend, not a trip
    step, found = feed([(2.0, 1.0)] * 5 + [(2.0, 1e20)])  # past float32's squared range: at once
    assert step == 5 and found["float32_overflow"]


def _clean(kind, n, seed):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=gen, dtype=torch.float64)
    t = torch.arange(n, dtype=torch.float64)
    if kind == "decaying":
        return ((0.2 + 3 * torch.exp(-t / 300)) * torch.exp(0.1 * z)).tolist()
    if kind == "minibatch_mse":  # right-skewed: the mean of 8 squared Gaussians
        return torch.randn(n, 8, generator=gen, dtype=torch.float64).square().mean(1).tolist()
    return (torch.exp(0.3 * z) * torch.where(t % 250 == 249, 1.9, 1.0)).tolist()  # heavy-tailed grad norms


@pytest.mark.parametrize(("loss_kind", "grad_kind"), [("decaying", "heavy_tail"), ("minibatch_mse", "minibatch_mse")])
def test_clean_runs_never_trip_on_growth(loss_kind, grad_kind) -> None:
    from nanguard.guard.history import History

    h = History(size=64, spike_window=50, spike_warmup=10, spike_threshold=6.0, divergence_window=5,
                divergence_factor=10.0)  # fmt: skip
    losses, norms = _clean(loss_kind, 10_000, 1), _clean(grad_kind, 10_000, 2)
    trips = 0
    for step, (loss, gn) in enumerate(zip(losses, norms, strict=True)):
        h.observe(step, loss=loss, grad_norm=gn)
        trips += h.runaway(step, loss=loss, grad_norm=gn) is not None
        h.append(step, loss=loss, grad_norm=gn)
    assert trips == 0  # 10,000 clean steps: the target is at most 1


# -- item 7: the guard must not change a healthy compiled run -------------------------------


def test_headroom_is_measured_on_a_replay_that_leaves_the_step_as_it_was(tmp_path) -> None:
    model = _gpt(torch.bfloat16, n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16)
    model.drop = torch.nn.Dropout(0.1)  # the replay must draw the step's own dropout mask, then put the RNG back
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = ng.Guard(model, optimizer, headroom_every=1, run_dir=tmp_path)
    closure, _ = _closure(model, optimizer, 0)
    rng = torch.get_rng_state()
    closure()
    grads = [p.grad.clone() for p in model.parameters()]
    after = torch.get_rng_state()
    guard._remedies.headroom.replay(0, closure, params=guard._params, rng={"cpu": rng})
    assert torch.equal(torch.get_rng_state(), after)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert guard._remedies.headroom.every == 1  # bfloat16 outputs seen: the checks go on
    guard.close()
    events = read_events(next(tmp_path.glob("events*.jsonl")))
    assert any(e["kind"] == "headroom" and e["dtype"] == "bfloat16" for e in events)
