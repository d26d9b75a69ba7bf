"""Faults found guarding real training loops (llm.c- and litgpt-style, issue 27), through the public API:
a learning rate far too high, huge finite gradients before the loop's own clip, a NaN row of a loaded
checkpoint, a compiled healthy run, the guard's clip, float16 AdamW and a division by the number 0."""

import math

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
def _own_clip_loop(guard, model, optimizer, steps):
    """A litgpt-style loop: its own backward, guard.check with a replay, then its own strict clip."""
    for step in steps:
        closure, batch = _closure(model, optimizer, step)
        loss = closure()
        if guard is None or guard.check(loss, replay=closure, batch=batch):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
            optimizer.step()
            if guard is not None:
                guard.after_step()
        if guard is not None and guard.last_diagnosis is not None:
            return step
    return None


def test_gradients_past_float32s_squared_range_trip_before_the_loops_own_clip() -> None:
    # A loss summed over ~1e20 terms instead of averaged: every gradient finite, but their norm squared
    # is past float32's range (a clip that sums squares in float32, as on CUDA, computes Inf).
    model = _gpt(loss_multiplier=1e20)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = ng.Guard(model, optimizer, policy="raise")
    with pytest.raises(ng.NonFiniteError) as err:
        _own_clip_loop(guard, model, optimizer, [0])
    diag = err.value.diagnosis
    assert (diag.cause, diag.kind, diag.step) == ("optimizer.divergence", "inf", 0)
    assert diag.evidence["history"]["float32_overflow"] and diag.evidence["grad_norm"] > 1.8e19


def _lr_typo_run(guard, model, optimizer):
    """15 healthy steps at lr=1e-3, then a schedule whose peak was typed 1e3 instead of 1e-3."""
    for step in range(30):
        if step == 15:
            for group in optimizer.param_groups:
                group["lr"] = 1e3
        if _own_clip_loop(guard, model, optimizer, [step]) is not None:
            return step
    return None


def test_an_lr_far_too_high_mid_run_trips_on_growth_before_the_loops_own_clip() -> None:
    model = _gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(RuntimeError, match="non-finite"):  # unguarded: NaN gradients reach the clip
        _lr_typo_run(None, model, optimizer)
    model = _gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = ng.Guard(model, optimizer, policy="skip")
    # Step 16 (after the first bad update) spikes 1e7x; step 17 grows on: a divergence, not one bad batch.
    assert _lr_typo_run(guard, model, optimizer) == 17
    diag = guard.last_diagnosis
    assert (diag.cause, diag.kind, diag.step) == ("optimizer.divergence", "invalid", 17), diag
    assert diag.evidence["history"]["growth"] >= guard.config.divergence_factor and diag.evidence["history"]["spike"]
    assert guard.skipped == 1 and guard.history.points[-1].step == 16  # step 17 was not applied


def test_growth_trips_only_with_both_metrics_on_two_spikes_in_a_row_of_warm_detectors() -> None:
    from nanguard.guard.history import History

    def feed(values):
        h = History(
            size=64, spike_window=50, spike_warmup=10, spike_threshold=6.0, divergence_window=5, divergence_factor=10.0
        )
        for step, (loss, gn) in enumerate(values):
            h.observe(step, loss=loss, grad_norm=gn)
            if (found := h.runaway(step, loss=loss, grad_norm=gn)) is not None:
                return step, found
            h.append(step, loss=loss, grad_norm=gn)
        return None

    warm = [(2.0 + 0.01 * (i % 3), 1.0 + 0.01 * (i % 5)) for i in range(20)]
    step, found = feed([*warm, (30.0, 15.0), (900.0, 400.0)])
    assert step == 21 and found["metric"] == "loss" and not found["float32_overflow"] and found["spike"]
    assert feed([*warm, (30.0, 15.0), (2.0, 1.0)]) is None  # one spike (a bad batch), then back
    assert feed([*warm, (30.0, 1.1), (900.0, 1.2)]) is None  # the loss alone grew
    assert feed([*warm, (2.1, 40.0), (2.2, 900.0)]) is None  # the grad norm alone grew
    assert feed([(2.0, 0.01), (30.0, 15.0)]) is None  # a run's first steps: the detectors are cold
    assert feed([(2.0 * 1.02**i, 1.02**i) for i in range(200)]) is None  # a slow climb is a trend, not a trip
    step, found = feed([(2.0, 1.0)] * 5 + [(2.0, 1e20)])  # past float32's squared range: at once
    assert step == 5 and found["float32_overflow"]
    # An Inf norm of a step no rank flagged: the ranks' finite squared norms summed past float32's range.
    step, found = feed([(2.0, 1.0)] * 5 + [(2.0, math.inf)])
    assert step == 5 and found["float32_overflow"] and found["growth"] >= 1e18


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

    h = History(
        size=64, spike_window=50, spike_warmup=10, spike_threshold=6.0, divergence_window=5, divergence_factor=10.0
    )
    losses, norms = _clean(loss_kind, 10_000, 1), _clean(grad_kind, 10_000, 2)
    trips = 0
    for step, (loss, gn) in enumerate(zip(losses, norms, strict=True)):
        h.observe(step, loss=loss, grad_norm=gn)
        trips += h.runaway(step, loss=loss, grad_norm=gn) is not None
        h.append(step, loss=loss, grad_norm=gn)
    assert trips == 0  # 10,000 clean steps: the target is at most 1


# -- item 6: a NaN row of a loaded checkpoint that no batch uses ----------------------------
def _checkpoint_with_a_nan_row(model):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["wte.weight"][0] = float("nan")  # the padding row (padding_idx=0): no batch reads it
    return state


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_nan_row_of_a_loaded_checkpoint_is_named_before_the_first_update(when) -> None:
    model = _gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = _checkpoint_with_a_nan_row(model)
    if when == "before":
        model.load_state_dict(state)
    guard = ng.Guard(model, optimizer, policy="rollback")
    if when == "after":  # a resume: the guard was built first
        model.load_state_dict(state)
    with pytest.raises(ng.NonFiniteError) as err:  # no snapshot holds better parameters
        _run(guard, model, optimizer, 3)
    diag = err.value.diagnosis
    assert (diag.cause, diag.phase, diag.module, diag.step) == ("parameters.nonfinite", "parameters", "wte", 0)
    assert diag.evidence["rows"] == [0]
    assert guard.rollbacks == 0
    assert bool(torch.isnan(model.wte.weight[0]).all())  # the run stopped: nothing was "repaired"


def test_a_healthy_checkpoint_loaded_later_is_checked_and_passes() -> None:
    model = _gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = ng.Guard(model, optimizer)
    assert _run(guard, model, optimizer, 2) is None
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    assert guard.health.unchecked  # queued for the next step
    assert _run(guard, model, optimizer, 1) is None and guard.health.checked == "loaded"
    assert _run(guard, model, optimizer, 1) is None and guard.health.checked == "update"


# -- item 7: the guard must not change a healthy compiled run -------------------------------
@pytest.mark.parametrize("backend", ["inductor"])  # aot_eager computes what eager does: no difference to see
def test_a_guarded_compiled_healthy_run_is_bit_identical_to_the_unguarded_one(backend) -> None:
    def train(guarded):
        torch._dynamo.reset()
        model = _gpt(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        compiled = torch.compile(model, backend=backend)
        guard = ng.Guard(compiled, optimizer, headroom_every=2) if guarded else None
        for step in range(4):
            batch = synthetic_batch(model.config, torch.Generator().manual_seed(step))

            def closure(batch=batch):
                optimizer.zero_grad(set_to_none=True)
                _, loss = compiled(**batch)
                loss.backward()
                return loss

            if guard is not None:
                assert guard.step(closure, batch=batch) is not None
            else:
                closure()
                optimizer.step()
        return {k: v.clone() for k, v in model.state_dict().items()}

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # inductor's CPU kernels reduce in thread-sized chunks: one thread, one rounding
    try:
        plain, guarded = train(False), train(True)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(plain[k], guarded[k]) for k in plain)


def test_an_eager_models_headroom_is_measured_as_its_step_runs_with_no_replay(tmp_path) -> None:
    # Reading op outputs changes none of an eager step's values: no second run of the closure.
    model = _gpt(torch.bfloat16, n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = ng.Guard(model, optimizer, headroom_every=1, run_dir=tmp_path)
    calls = []
    for step in range(2):
        closure, batch = _closure(model, optimizer, step)

        def counted(closure=closure, step=step):
            calls.append(step)
            return closure()

        assert guard.step(counted, batch=batch) is not None
    guard.close()
    assert calls == [0, 1]
    events = read_events(next(tmp_path.glob("events*.jsonl")))
    assert {e["step"] for e in events if e["kind"] == "headroom" and e["dtype"] == "bfloat16"} == {0, 1}


# -- item 9: Guard(clip_grad_norm=) clips as the loop's own clip_grad_norm_ does -------------
def test_the_guards_clip_is_bit_identical_to_the_loops_own_clip() -> None:
    def train(guarded):
        model = _gpt()
        # nanoGPT's configure_optimizers: decayed (2-D) parameters first, then the rest, so the
        # optimizer's order is not model.parameters()' order.
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=3e-3
        )
        guard = ng.Guard(model, optimizer, clip_grad_norm=0.5) if guarded else None
        for step in range(5):
            closure, batch = _closure(model, optimizer, step)
            if guard is not None:
                guard.step(closure, batch=batch)
            else:
                closure()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
        return {k: v.clone() for k, v in model.state_dict().items()}

    plain, guarded = train(False), train(True)
    assert all(torch.equal(plain[k], guarded[k]) for k in plain)


def _loaded_on_one_rank(rank, world, tmp, bad):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _gpt(n_embd=64, block_size=16)
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    guard = ng.Guard(ddp, optimizer)
    if rank == bad:  # a rank-local load: this rank's checkpoint shard is corrupt
        model.load_state_dict(_checkpoint_with_a_nan_row(model))
    try:
        _run(guard, model, optimizer, 3, net=ddp)
    except ng.NonFiniteError as err:
        return {"diag": err.diagnosis.to_dict(), "step": guard.step_count}
    return {"diag": None, "step": guard.step_count}


@pytest.mark.dist
@pytest.mark.parametrize("bad", [0, 1])
def test_a_nan_row_loaded_on_one_ddp_rank_stops_every_rank_naming_it(tmp_path, bad) -> None:
    from nanguard.zoo.spawn import spawn_ranks

    for r in spawn_ranks(_loaded_on_one_rank, tmp_path, bad):
        d = r["diag"]
        assert d is not None and r["step"] == 1, r  # every rank stopped at the first step: no hang
        assert (d["cause"], d["module"], d["rank"], d["ranks"], d["step"]) == (
            "parameters.nonfinite",
            "wte",
            bad,
            [bad],
            0,
        )
