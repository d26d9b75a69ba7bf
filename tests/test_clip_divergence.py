"""A divergence the clip keeps finite: AdamW at 10,000x its learning rate under ``max_grad_norm=1.0``.

The clip holds every gradient finite and the loss climbs by orders of magnitude without a NaN.
The guard records the gradient norm the loop's clip computed (what ``clip_grad_norm_`` returns and
the HF Trainer logs, not the clipped gradients' norm, which stays at 1.0), and warns, naming the LR,
once the loss (or that norm) has stood an order of magnitude above its recent level. Each run has a
healthy twin at the normal LR that must stay silent. Through a plain loop (``LoopGuard``), the HF
Trainer and an accelerate loop; thresholds come from the class (a loss grown tenfold), not from
values a CPU rounds its own way.
"""

from __future__ import annotations

import logging
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import IterableDataset

from nanguard.guard.history import DEPARTED_STEPS, History
from nanguard.integrations.loop import LoopGuard
from nanguard.report.load import load_run

LR = 5e-4
TOO_HIGH = LR * 10_000
STEPS, VOCAB, SEQ, BATCH = 8, 64, 16, 4
HARDWARE = {"step.not_reproduced", "distributed.transient", "hardware.faulty_device"}
WARNING_FIELDS = {"signal", "module", "value", "trend", "steps_left", "fix", "lr"}


def _gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(VOCAB, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def _first_grown(losses: list[float]) -> int | None:
    """The first step whose loss is ten times or more the median of the losses before it."""
    return next((i for i in range(1, len(losses)) if losses[i] >= 10 * statistics.median(losses[:i])), None)


def _assert_warned(events: list[dict[str, Any]], losses: list[float], lr: float) -> dict[str, Any]:
    """One warning, within the first steps where the loss has grown tenfold, the LR named; no hardware blame."""
    first = _first_grown(losses)
    assert first is not None, losses  # the run did diverge, every value finite
    assert all(math.isfinite(v) for v in losses), losses
    warnings = [e for e in events if e["kind"] == "warning"]
    assert len(warnings) == 1, warnings
    warning = warnings[0]
    assert first <= warning["step"] <= first + DEPARTED_STEPS - 1, (warning, losses)
    assert set(warning) >= WARNING_FIELDS, warning
    assert warning["signal"] in ("loss", "grad_norm") and warning["module"] is None
    assert warning["lr"] == lr and f"lr={lr}" in warning["fix"]
    assert warning["trend"] > 1 and warning["value"] >= 10 * warning["level"]
    trips = [e["diagnosis"]["cause"] for e in events if e["kind"] == "trip"]
    assert not HARDWARE & set(trips), trips
    return warning


def _assert_silent(events: list[dict[str, Any]]) -> None:
    assert [e for e in events if e["kind"] in ("warning", "spike", "trip")] == []


def _plain_loop(lr: float, run_dir: Path) -> tuple[list[dict[str, Any]], list[float], list[tuple[float, Any]]]:
    """nanoGPT's step under ``LoopGuard``: backward, ``clip_grad_norm_(..., 1.0)``, ``optimizer.step()``."""
    model = _gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    events: list[dict[str, Any]] = []
    losses, norms = [], []
    with LoopGuard(model, optimizer, run_dir=run_dir, on_event=events.append) as guard:
        for ids in _batches():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            norms.append((float(norm), guard.last_grad_norm))
    return events, losses, norms


def test_a_clipped_10000x_lr_in_a_plain_loop_is_warned_with_the_lr_named(tmp_path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="nanguard"):
        events, losses, norms = _plain_loop(TOO_HIGH, tmp_path / "bad")
    warning = _assert_warned(events, losses, TOO_HIGH)
    said = [r.getMessage() for r in caplog.records if "diverging" in r.getMessage()]
    assert len(said) == 1 and f"lr={TOO_HIGH}" in said[0]  # printed once
    # The recorded norm is the clip's own return, far past the clip: not the clipped 1.0.
    assert all(recorded == returned for returned, recorded in norms), norms
    assert max(n for n, _ in norms) > 10
    # The report shows it.
    assert [m.step for m in load_run(tmp_path / "bad").early_warnings] == [warning["step"]]

    events, losses, norms = _plain_loop(LR, tmp_path / "good")
    _assert_silent(events)
    assert _first_grown(losses) is None
    assert all(recorded == returned for returned, recorded in norms), norms


class _Tokens(IterableDataset):
    def __iter__(self):
        for ids in _batches():
            yield from ({"input_ids": row, "labels": row} for row in ids)


def _hf_run(lr: float, tmp_path: Path) -> tuple[list[dict[str, Any]], list[float], list[float], Any]:
    from transformers import Trainer, TrainingArguments

    from nanguard.integrations.hf import NanGuardCallback

    events: list[dict[str, Any]] = []
    callback = NanGuardCallback(on_event=events.append)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=BATCH,
        learning_rate=lr,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        max_steps=STEPS,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=_gpt2(), args=args, train_dataset=_Tokens(), callbacks=[callback])
    trainer.train()
    logged = [e for e in trainer.state.log_history if "grad_norm" in e]
    return events, [e["loss"] for e in logged], [e["grad_norm"] for e in logged], callback


def test_a_clipped_10000x_lr_under_the_hf_trainer_is_warned_and_its_twin_silent(tmp_path) -> None:
    events, losses, logged_norms, callback = _hf_run(TOO_HIGH, tmp_path / "bad")
    _assert_warned(events, losses, TOO_HIGH)
    # The norm the guard judged is the one the Trainer logged (its clip's return), step by step.
    assert [p.grad_norm for p in callback.guard.history] == logged_norms
    assert max(logged_norms) > 10

    events, losses, logged_norms, callback = _hf_run(LR, tmp_path / "good")
    _assert_silent(events)
    assert [p.grad_norm for p in callback.guard.history] == logged_norms


def _accelerate_run(lr: float) -> tuple[list[dict[str, Any]], list[float], list[tuple[float, Any]]]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    model = _gpt2()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=lr))
    events: list[dict[str, Any]] = []
    losses, norms = [], []
    with LoopGuard(model, optimizer.optimizer, on_event=events.append) as guard:
        for ids in _batches():
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
            norms.append((float(norm), guard.last_grad_norm))
    return events, losses, norms


def test_a_clipped_10000x_lr_in_an_accelerate_loop_is_warned_and_its_twin_silent() -> None:
    events, losses, norms = _accelerate_run(TOO_HIGH)
    _assert_warned(events, losses, TOO_HIGH)
    assert all(recorded == returned for returned, recorded in norms), norms

    events, losses, norms = _accelerate_run(LR)
    _assert_silent(events)
    assert all(recorded == returned for returned, recorded in norms), norms


def _history() -> History:
    return History(
        size=64, spike_window=50, spike_warmup=10, spike_threshold=6.0, divergence_window=5, divergence_factor=10.0
    )


def _feed(history: History, series: list[tuple[float, float]]) -> list[int]:
    """Each (loss, grad norm) checked, then appended as an update; the steps that warned."""
    warned = []
    for step, (loss, norm) in enumerate(series):
        if history.departed(step, loss=loss, grad_norm=norm) is not None:
            warned.append(step)
        history.append(step, loss=loss, grad_norm=norm)
    return warned


def test_one_bad_batch_is_no_departure_and_a_level_that_moved_is_warned_once() -> None:
    level = [(4.0 + 0.01 * (i % 3), 1.0) for i in range(6)]
    assert _feed(_history(), [*level, (60.0, 1.0), *level]) == []  # one batch ten times up, then back
    history = _history()
    assert _feed(history, [*level, (60.0, 1.0), (70.0, 1.0), (900.0, 1.0), (5000.0, 1.0)]) == [7]
    assert history.growing()  # a rollback's snapshot is not refreshed with a run on its way out


def test_a_grad_norm_that_jumps_while_the_loss_holds_is_no_divergence_and_one_that_climbs_with_it_is() -> None:
    # A zero-initialized head reached after the first updates, or a layer's gain grown (the zoo's
    # healthy_bf16_large_activations): the grad norm jumps a thousandfold while the loss falls or holds.
    learning = [(4.0 - 0.1 * i, 0.05 if i < 3 else 2.0) for i in range(10)]
    assert _feed(_history(), learning) == []
    holding = [(4.0 + 0.01 * (i % 2), 0.05 if i < 3 else 50.0) for i in range(10)]
    assert _feed(_history(), holding) == []
    climbing = [(4.0 + 0.01 * i, 0.05 if i < 3 else 2.0) for i in range(10)]
    assert _feed(_history(), climbing) == [4]


def test_heavy_tailed_clean_series_stay_silent() -> None:
    # Losses and grad norms with multiplicative noise (log-normal, sigma 1: a value 10x the median
    # every hundred steps) over 10,000 seeded steps: noise, not a level that moved.
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(10_000, 2, generator=gen).exp().tolist()
    assert _feed(_history(), [(2.0 * a, 0.5 * b) for a, b in noise]) == []


def test_the_clip_is_read_whatever_name_the_loop_imported_it_by_and_only_for_its_own_parameters() -> None:
    from torch import nn
    from torch.nn.utils import clip_grad_norm_  # bound before the watch began

    from nanguard import compat
    from nanguard.integrations.clipnorm import ClipNorm

    ours, theirs = nn.Linear(4, 2), nn.Linear(4, 2)
    for model in (ours, theirs):
        model(torch.randn(3, 4)).sum().backward()
    original = torch.nn.utils.clip_grads_with_norm_
    clip = ClipNorm(ours.parameters())
    torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0)
    assert clip.take() is None  # another model's clip
    first = clip_grad_norm_(ours.parameters(), 1e-3)
    clip_grad_norm_(ours.parameters(), 1e-3)  # a second clip sees clipped gradients: the first is the step's
    assert float(clip.take()) == float(first) > 1e-2
    total = torch.nn.utils.get_total_norm([p.grad for p in ours.parameters()])
    torch.nn.utils.clip_grads_with_norm_(ours.parameters(), 1e-4, total)  # torchtitan's two-part clip
    assert float(clip.take()) == float(total)
    clip.close()
    assert torch.nn.utils.clip_grads_with_norm_ is original and not compat._CLIP_WATCHERS


def test_reading_the_clips_norm_adds_no_host_read() -> None:
    from _sync_count import as_on_gpu, counting
    from nanguard.zoo import GPT, GPTConfig, synthetic_batch

    def reads(guarded: bool, steps: int = 4) -> tuple[int, list[torch.Tensor]]:
        cfg = GPTConfig(vision_dim=16, n_embd=32, block_size=16)
        torch.manual_seed(0)
        model = GPT(cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(0)
        batches = [synthetic_batch(cfg, gen, batch_size=4) for _ in range(steps)]
        guard = LoopGuard(model, optimizer, check_batch=False) if guarded else None
        norms = []
        with as_on_gpu(), counting() as counted:
            for b in batches:
                _, loss = model(b["input_ids"], labels=b["labels"], pixel_values=b["pixel_values"])
                loss.backward()
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        if guard is not None:
            guard.close()
        return counted.n_host_reads, norms

    plain, _ = reads(False)
    guarded, norms = reads(True)
    assert (guarded - plain) / len(norms) <= 1, (plain, guarded)


def test_guard_step_accumulated_judges_the_norm_before_its_own_clip() -> None:
    import nanguard as ng
    from nanguard.integrations.clipnorm import ClipNorm

    def run(lr: float) -> tuple[list[dict[str, Any]], list[float], list[float]]:
        model = _gpt2()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        events: list[dict[str, Any]] = []
        guard = ng.Guard(model, optimizer, clip_grad_norm=1.0, on_event=events.append)
        clip = ClipNorm(model.parameters())  # what the guard's own clip_grad_norm_ returns, after the check
        losses, norms = [], []
        for ids in _batches():
            halves = [ids[: BATCH // 2], ids[BATCH // 2 :]]
            loss = guard.step_accumulated(halves, lambda b: model(input_ids=b, labels=b).loss)
            losses.append(float(loss))
            norms.append(guard.last_grad_norm)
            returned = clip.take()
            assert returned is not None and norms[-1] == pytest.approx(float(returned), rel=1e-5)
        clip.close()
        return events, losses, norms

    events, losses, norms = run(TOO_HIGH)
    _assert_warned(events, losses, TOO_HIGH)
    assert max(norms) > 10  # before the clip to 1.0
    events, _, norms = run(LR)
    _assert_silent(events)


def test_fabric_and_lightning_check_before_their_clip_so_the_norm_is_the_unclipped_one(tmp_path) -> None:
    import lightning as L
    from torch import nn

    from nanguard.integrations.fabric import FabricGuard
    from nanguard.integrations.lightning import NanGuard

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(x), y)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self(*batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    gen = torch.Generator().manual_seed(0)
    data = [(x, 10 * x.sum(1, keepdim=True)) for x in torch.randn(4, 8, 8, generator=gen)]
    clip = 1e-3

    fabric = L.Fabric(accelerator="cpu", devices=1)
    net = Net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=1e-2))
    returned, recorded = [], []
    with FabricGuard(fabric, model, optimizer) as guard:
        for x, y in data:
            fabric.backward(model(x, y))
            returned.append(float(fabric.clip_gradients(model, optimizer, max_norm=clip)))
            optimizer.step()
            optimizer.zero_grad()
            recorded.append(guard.last_grad_norm)
    assert recorded == pytest.approx(returned, rel=1e-5) and min(returned) > 10 * clip

    callback = NanGuard()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=len(data),
        gradient_clip_val=clip,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=None))
    assert callback.guard is not None
    norms = [p.grad_norm for p in callback.guard.history]
    assert len(norms) == len(data) and min(norms) > 10 * clip


def _ddp_clip_rank(rank: int, world: int, tmp: Any, steps: int) -> dict[str, Any]:
    """A DDP loop that clips, unguarded then under ``LoopGuard``: the collectives each run issues (counted at
    the dispatcher, DDP's reducer too), and each step's clip return beside the norm the guard recorded."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from _sync_count import counting

    def run(guarded: bool) -> tuple[int, list[tuple[float, Any]]]:
        torch.manual_seed(0)
        ddp = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-2)
        guard = LoopGuard(ddp, optimizer, fingerprint_every=0, check_batch=False) if guarded else None
        norms = []
        with counting() as counted:
            for step in range(steps):
                gen = torch.Generator().manual_seed(rank * 100 + step)
                x = torch.randn(4, 8, generator=gen)
                loss = nn.functional.mse_loss(ddp(x), 10 * x.sum(1, keepdim=True))
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1e-3)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                norms.append((float(norm), guard.last_grad_norm if guard is not None else None))
        if guard is not None:
            guard.close()
        return counted.n_collectives, norms

    plain, _ = run(False)
    guarded, norms = run(True)
    return {"plain": plain, "guarded": guarded, "norms": norms}


def test_reading_the_clips_norm_adds_no_collective_under_ddp(tmp_path) -> None:
    from nanguard.zoo.spawn import spawn_ranks

    steps = 3
    for r in spawn_ranks(_ddp_clip_rank, tmp_path, steps, timeout=180):
        # LoopGuard's check after the loop's backward adds its one small all-reduce; the clip's norm rides in it.
        assert r["plain"] >= steps, r  # the count sees DDP's gradient all-reduce
        assert (r["guarded"] - r["plain"]) / steps <= 1, r
        assert all(recorded == returned > 1e-2 for returned, recorded in r["norms"]), r


def test_the_healthy_steps_shortcut_warns_exactly_where_the_full_rule_does(monkeypatch) -> None:
    # Jumpy series (log-normal noise, tenfold level shifts, runs growing 2.5x a step, NaN/Inf/zero
    # values): the rule with its shortcut (skip the window unless a value doubled its last) against
    # the rule without it.
    from nanguard.guard import history as history_module

    gen = torch.Generator().manual_seed(1)
    noise = (torch.randn(3000, 2, generator=gen) * 0.3).exp().tolist()
    shifts = torch.randint(0, 60, (3000,), generator=gen).tolist()
    level, climbing, series = 1.0, 0, []
    for (a, b), shift in zip(noise, shifts, strict=True):
        climbing = 4 if shift == 5 else max(climbing - 1, 0)
        level *= 12.0 if shift == 0 else 1 / 12.0 if shift == 1 else 2.5 if climbing else 1.0
        value = {2: math.nan, 3: math.inf, 4: 0.0}.get(shift, level * a)
        series.append((value, level * b))
    riding = [(math.nan, g) for _, g in series]  # no collective averaged the loss: the history holds NaN
    fast, fast_riding = _feed(_history(), series), _feed(_history(), riding)
    monkeypatch.setattr(history_module, "_may_depart", lambda *_: True)
    assert fast == _feed(_history(), series)
    assert fast_riding == _feed(_history(), riding)
    assert fast and fast_riding  # the series do leave their level: the comparison covers warnings, not only silence
