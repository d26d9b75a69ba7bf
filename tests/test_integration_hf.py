"""The Hugging Face Trainer callback on a real Trainer and a tiny GPT-2 built from a config."""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded: models come from configs, data from torch

import pytest
import torch
from torch.utils.data import IterableDataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import nanguard as ng
from nanguard.integrations.hf import NanGuardCallback

SEQ, EMBD, VOCAB, BATCH = 8, 32, 64, 2


class Samples(IterableDataset):
    """Seeded (inputs_embeds, labels) samples in a fixed order; ``nan_at`` corrupts one sample and
    ``drop`` leaves samples out, so a reference run can train as if a batch never existed."""

    def __init__(self, n: int, nan_at: int | None = None, drop: tuple[int, ...] = ()) -> None:
        self.n, self.nan_at, self.drop = n, nan_at, drop

    def __iter__(self):
        gen = torch.Generator().manual_seed(0)
        for i in range(self.n):
            x = torch.randn(SEQ, EMBD, generator=gen)
            y = torch.randint(VOCAB, (SEQ,), generator=gen)
            if i == self.nan_at:
                x[1, 3] = float("nan")
            if i not in self.drop:
                yield {"inputs_embeds": x, "labels": y}


class StopAfter(TrainerCallback):
    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.steps


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=EMBD,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def _args(tmp_path: Path, **kwargs) -> TrainingArguments:
    base = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": BATCH,
        "learning_rate": 1e-3,
        "report_to": "none",
        "logging_steps": 1,
        "save_strategy": "no",
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 0,
    }
    return TrainingArguments(**{**base, **kwargs})


def test_nan_batch_is_skipped_as_if_it_never_happened(tmp_path: Path) -> None:
    bad_step, steps = 2, 5
    model = _gpt2()
    guard_cb = NanGuardCallback(policy="skip", run_dir=tmp_path / "run")
    data = Samples(BATCH * steps, nan_at=BATCH * bad_step)
    trainer = Trainer(model=model, args=_args(tmp_path, max_steps=steps), train_dataset=data, callbacks=[guard_cb])
    trainer.train()

    assert trainer.state.global_step == steps
    assert guard_cb.skipped == 1
    diag = guard_cb.last_diagnosis
    assert (diag.cause, diag.phase, diag.step) == ("data.nonfinite", "data", bad_step)
    assert diag.evidence["origin"]["path"] == "batch['inputs_embeds']"
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())

    # The trip is in the Trainer's logs and state; the skipped step logs no loss or grad norm.
    entries = [e for e in trainer.state.log_history if "nanguard/cause" in e]
    assert len(entries) == 1
    assert entries[0]["nanguard/cause"] == "data.nonfinite" and entries[0]["nanguard/action"] == "skip"
    assert entries[0]["step"] == bad_step + 1 and entries[0]["nanguard/skipped"] == 1
    assert "loss" not in entries[0] and "grad_norm" not in entries[0]
    counted = [e["nanguard/skipped"] for e in trainer.state.log_history if "nanguard/skipped" in e]
    assert counted == [0] * bad_step + [1] * (steps - bad_step)
    saved = trainer.state.stateful_callbacks["NanGuardCallback"]["attributes"]["guard_state"]
    assert saved["skipped"] == 1 and saved["last_diagnosis"]["cause"] == "data.nonfinite"

    # Reference: the same run without the bad batch, stopped after the same number of updates,
    # on the same LR schedule (max_steps). Weights, optimizer state and scheduler must match.
    ref_model = _gpt2()
    ref = Trainer(
        model=ref_model,
        args=_args(tmp_path, max_steps=steps),
        train_dataset=Samples(BATCH * steps + BATCH, drop=tuple(range(BATCH * bad_step, BATCH * bad_step + BATCH))),
        callbacks=[StopAfter(steps - 1)],
    )
    ref.train()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert trainer.lr_scheduler.last_epoch == ref.lr_scheduler.last_epoch == steps - 1
    assert trainer.optimizer.param_groups[0]["lr"] == ref.optimizer.param_groups[0]["lr"]
    assert trainer.lr_scheduler.get_last_lr() == ref.lr_scheduler.get_last_lr()
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        a, b = trainer.optimizer.state[p], ref.optimizer.state[q]
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_counters_reach_tensorboard_through_the_trainer(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    bad_step, steps = 0, 4
    guard_cb = NanGuardCallback(policy="skip")
    args = _args(tmp_path, max_steps=steps, report_to=["tensorboard"], logging_steps=2)
    data = Samples(BATCH * steps, nan_at=BATCH * bad_step)
    trainer = Trainer(model=_gpt2(), args=args, train_dataset=data, callbacks=[guard_cb])
    trainer.train()
    assert guard_cb.skipped == 1
    assert (tmp_path / "out" / "nanguard" / "events-rank0.jsonl").exists()  # run_dir under output_dir

    (events,) = {p.parent for p in (tmp_path / "out").rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    skipped = {e.step: e.value for e in acc.Scalars("train/nanguard/skipped")}
    trips = {e.step: e.value for e in acc.Scalars("train/nanguard/trips")}
    # The first step trips and is logged at once (logging_steps=2 would wait), with no fake loss
    # or grad norm: it has no good step to average.
    assert skipped == {1: 1.0, 2: 1.0, 4: 1.0} and trips == {1: 1.0, 2: 1.0, 4: 1.0}
    assert sorted(e.step for e in acc.Scalars("train/loss")) == [2, 4]
    assert sorted(e.step for e in acc.Scalars("train/grad_norm")) == [2, 4]
    assert all(math.isfinite(e.value) and e.value > 0.5 for e in acc.Scalars("train/loss"))
    cause = [e for e in acc.Tensors("train/nanguard/cause/text_summary")]
    assert [e.step for e in cause] == [1] and b"data.nonfinite" in cause[0].tensor_proto.string_val[0]


def test_gradient_accumulation_replays_every_micro_batch(tmp_path: Path) -> None:
    guard_cb = NanGuardCallback(policy="skip")
    # 3 optimizer steps of 2 micro-batches; the NaN is in the 2nd micro-batch of step 1.
    args = _args(tmp_path, max_steps=3, gradient_accumulation_steps=2)
    trainer = Trainer(
        model=_gpt2(), args=args, train_dataset=Samples(BATCH * 6, nan_at=BATCH * 3), callbacks=[guard_cb]
    )
    trainer.train()
    assert trainer.state.global_step == 3 and guard_cb.skipped == 1
    diag = guard_cb.last_diagnosis
    assert (diag.cause, diag.step) == ("data.nonfinite", 1)
    assert diag.evidence["origin"]["path"] == "batch[1]['inputs_embeds']"
    assert len(guard_cb.guard.history) == 2


def test_far_too_high_lr_raises_divergence(tmp_path: Path) -> None:
    class Tokens(IterableDataset):
        def __iter__(self):
            gen = torch.Generator().manual_seed(0)
            while True:
                ids = torch.randint(VOCAB, (SEQ,), generator=gen)
                yield {"input_ids": ids, "labels": ids}

    # The loss grows >1000x in the first update; which later step first goes non-finite (and whether its
    # replay does too) depends on the CPU's rounding, so the window spans the whole run: growth decides.
    guard_cb = NanGuardCallback(policy="raise", divergence_window=30)
    args = _args(tmp_path, max_steps=30, optim="sgd", learning_rate=1000.0, max_grad_norm=0.0)
    trainer = Trainer(model=_gpt2(), args=args, train_dataset=Tokens(), callbacks=[guard_cb])
    with pytest.raises(ng.NonFiniteError) as info:
        trainer.train()

    diag = info.value.diagnosis
    assert diag.cause == "optimizer.divergence"
    history = diag.evidence["history"]
    assert history["diverging"] and history["growth"] >= 10
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) >= 2 and losses[-1] > 10 * losses[0]  # the Trainer's own logs saw the blow-up
    entry = trainer.state.log_history[-1]
    assert entry["nanguard/action"] == "raise" and entry["nanguard/cause"] == "optimizer.divergence"
    assert not guard_cb._hooks  # the forward hooks are gone once training stops


def test_bad_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown Guard option"):
        NanGuardCallback(max_skips=3)
    with pytest.raises(ValueError, match="policy"):
        NanGuardCallback(policy="ignore")


def test_missing_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("transformers", "transformers.trainer_callback", "nanguard.integrations.hf"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "nanguard.integrations.hf")
    with pytest.raises(ImportError, match=r"pip install nanguard\[hf\]"):
        importlib.import_module("nanguard.integrations.hf")


@pytest.mark.parametrize("nan_inf_filter", [True, False])
def test_a_skipped_step_counts_neither_in_train_loss_nor_in_the_logged_loss(tmp_path: Path, nan_inf_filter) -> None:
    bad_step, steps = 1, 5
    guard_cb = NanGuardCallback(policy="skip")
    args = _args(tmp_path, max_steps=steps, logging_steps=2, logging_nan_inf_filter=nan_inf_filter)
    trainer = Trainer(
        model=_gpt2(), args=args, train_dataset=Samples(BATCH * steps, nan_at=BATCH * bad_step), callbacks=[guard_cb]
    )
    out = trainer.train()
    assert guard_cb.skipped == 1

    # The losses of the steps that trained, one by one: the same run without the bad batch.
    ref = Trainer(
        model=_gpt2(),
        args=_args(tmp_path, max_steps=steps),
        train_dataset=Samples(BATCH * steps, drop=tuple(range(BATCH * bad_step, BATCH * bad_step + BATCH))),
        callbacks=[StopAfter(steps - 1)],
    )
    ref.train()
    good = [e["loss"] for e in ref.state.log_history if "loss" in e]
    assert len(good) == steps - 1 and all(math.isfinite(x) and x > 1.0 for x in good)

    expected = sum(good) / len(good)
    assert out.training_loss == pytest.approx(expected, rel=1e-5)
    assert out.metrics["train_loss"] == pytest.approx(expected, rel=1e-5)
    logged = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    # Steps 1-2 hold the first good step and the skipped one; steps 3-4 the next two good steps.
    assert logged[2] == pytest.approx(good[0], rel=1e-5)
    assert logged[4] == pytest.approx((good[1] + good[2]) / 2, rel=1e-5)


class Marked(IterableDataset):
    """Seeded samples; the ``mark``-th one's first label is ``VOCAB - 1`` (the rest start at 0), so
    a loss can go wrong on that sample alone, as a data-dependent bug does."""

    def __init__(self, n: int, mark: int | None = None) -> None:
        self.n, self.mark = n, mark

    def __iter__(self):
        for i, sample in enumerate(Samples(self.n)):
            sample["labels"][0] = VOCAB - 1 if i == self.mark else 0
            yield sample


def _floored_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``-log(p - floor)``: the floor (0.5) is past p on the marked sample's row."""
    p = logits[:, :-1].softmax(-1).gather(-1, labels[:, 1:, None]).squeeze(-1)
    floor = 0.5 * (labels[:, :1] == VOCAB - 1).float()
    return -torch.log(p - floor).mean()


def _loss_func(outputs, labels, num_items_in_batch=None) -> torch.Tensor:
    return _floored_nll(outputs.logits, labels)


class FlooredTrainer(Trainer):
    """TRL's recommended way: the loss in a ``compute_loss`` override."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = _floored_nll(outputs.logits, labels)
        return (loss, outputs) if return_outputs else loss


class NanTermTrainer(Trainer):
    """The model's loss plus a NaN term on the marked sample: NaN loss, every gradient finite."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        marked = (inputs["labels"][:, :1] == VOCAB - 1).any()
        loss = loss + torch.where(marked, torch.tensor(float("nan")), torch.tensor(0.0))
        return (loss, outputs) if return_outputs else loss


@pytest.mark.parametrize("how", ["compute_loss_func", "compute_loss"])
@pytest.mark.parametrize("accum", [1, 2])
def test_a_custom_loss_bug_is_named_in_the_loss_not_blamed_on_the_hardware(
    tmp_path: Path, how: str, accum: int
) -> None:
    guard_cb = NanGuardCallback(policy="skip")
    cls, extra = (Trainer, {"compute_loss_func": _loss_func}) if how == "compute_loss_func" else (FlooredTrainer, {})
    args = _args(tmp_path, max_steps=3, gradient_accumulation_steps=accum)
    mark = BATCH * accum + BATCH * (accum - 1)  # step 1, its last micro-batch
    trainer = cls(model=_gpt2(), args=args, train_dataset=Marked(BATCH * 8, mark), callbacks=[guard_cb], **extra)
    trainer.train()
    assert guard_cb.skipped == 1
    diag = guard_cb.last_diagnosis
    assert (diag.cause, diag.op, diag.module, diag.phase, diag.step) == (
        "op.log_domain",
        "aten.log.default",
        None,
        "forward",
        1,
    )
    assert all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())


def test_a_nan_trained_loss_with_finite_gradients_is_tripped(tmp_path: Path) -> None:
    guard_cb = NanGuardCallback(policy="skip")
    args = _args(tmp_path, max_steps=3)
    trainer = NanTermTrainer(model=_gpt2(), args=args, train_dataset=Marked(BATCH * 6, BATCH + 1), callbacks=[guard_cb])
    trainer.train()
    assert guard_cb.skipped == 1
    diag = guard_cb.last_diagnosis
    assert (diag.cause, diag.phase, diag.step, diag.module) == ("op.nan_write", "forward", 1, None)


class GradNoiseTrainer(Trainer):
    """A ``training_step`` of the user's own that writes into the gradients after the backward (NaN on
    the marked sample): code the replay of ``compute_loss`` does not run."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        marked = bool((inputs["labels"][:, :1] == VOCAB - 1).any())
        loss = super().training_step(model, inputs, num_items_in_batch)
        if marked:
            next(model.parameters()).grad.fill_(float("nan"))
        return loss


def test_a_training_step_the_replay_cannot_run_is_unknown_with_what_it_could_not_see(tmp_path: Path) -> None:
    guard_cb = NanGuardCallback(policy="skip", run_dir=tmp_path / "run")
    args = _args(tmp_path, max_steps=4)
    trainer = GradNoiseTrainer(model=_gpt2(), args=args, train_dataset=Marked(BATCH * 8, 1), callbacks=[guard_cb])
    trainer.train()
    assert guard_cb.skipped == 1
    diag = guard_cb.last_diagnosis
    assert diag.cause == "unknown" and diag.step == 0
    assert any("GradNoiseTrainer.training_step" in gap for gap in diag.evidence["unobserved"])
    assert not any("hardware" in fix or "drain" in fix for fix in diag.fixes)
    records = [json.loads(line) for line in (tmp_path / "run" / "hardware.jsonl").read_text().splitlines()]
    assert records and all(r["reproduced"] for r in records)  # never counted against the device


def test_nanguard_logs_the_loss_the_trainer_logs_with_accumulation(tmp_path: Path) -> None:
    # GPT-2 takes loss kwargs: the Trainer hands it num_items_in_batch and leaves the accumulation to its loss.
    run_dir = tmp_path / "run"
    guard_cb = NanGuardCallback(policy="skip", run_dir=run_dir)
    args = _args(tmp_path, max_steps=3, gradient_accumulation_steps=3)
    trainer = Trainer(model=_gpt2(), args=args, train_dataset=Samples(BATCH * 9), callbacks=[guard_cb])
    trainer.train()
    logged = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    lines = (run_dir / "events-rank0.jsonl").read_text().splitlines()
    steps = [e["loss"] for e in map(json.loads, lines) if e.get("kind") == "step"]
    assert len(logged) == 3 and steps == pytest.approx(logged, rel=1e-6)


@pytest.mark.dist
def test_a_custom_loss_bug_on_two_gloo_ranks_is_named_on_its_rank_under_ddp_and_deepspeed(tmp_path: Path) -> None:
    """2 gloo ranks, the sequential sampler dealing sample i to rank (i // 2) % 2 at step i // 4: the loss
    bug named in the loss on the rank that holds the marked sample, every rank skipping, under DDP and
    under DeepSpeed ZeRO-2 (the callback hands the Trainer's compute_loss to the engine's guard); under DDP a
    loss that is NaN on one rank while its gradients are finite too."""
    pytest.importorskip("deepspeed")
    from _hf_ranks import run_trainer
    from nanguard.zoo.spawn import spawn_ranks

    runs = [
        {"how": "compute_loss", "mark": 0},  # rank 0, step 0
        {"how": "compute_loss_func", "mark": 6},  # rank 1, step 1
        {"how": "compute_loss_func", "mark": 2, "zero": 2},  # rank 1, step 0
        # Under DDP the flags ride in the Trainer's clip norm: a NaN loss with finite gradients reaches it too.
        {"how": "nan_term", "mark": 0},  # rank 0, step 0
        {"how": "nan_term", "mark": 6},  # rank 1, step 1
    ]
    results = spawn_ranks(run_trainer, runs, str(tmp_path), world=2, timeout=600)
    for i, (rank, step) in enumerate([(0, 0), (1, 1)]):
        for r in range(2):
            diag = results[r][i + 3]["diagnosis"]
            assert results[r][i + 3]["skipped"] == 1, (i, r)  # every rank skips the one step
            assert (diag["rank"], diag["step"]) == (rank, step), (i, r, diag)
        assert results[0][i + 3]["weights"] == results[1][i + 3]["weights"]
    for i, (rank, step) in enumerate([(0, 0), (1, 1), (1, 0)]):
        for r in range(2):
            diag = results[r][i]["diagnosis"]
            assert results[r][i]["skipped"] == 1, (i, r)
            assert (diag["cause"], diag["op"], diag["module"], diag["phase"]) == (
                "op.log_domain",
                "aten.log.default",
                None,
                "forward",
            ), (i, r)
            assert (diag["rank"], diag["ranks"], diag["step"]) == (rank, [rank], step), (i, r)
        assert results[0][i]["weights"] == results[1][i]["weights"]


class GrowQueryKey(TrainerCallback):
    """Block 1's query and key columns grow 8% a step (the LR at 0: only this moves the weights)."""

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        with torch.no_grad():
            model.transformer.h[1].attn.c_attn.weight[:, : 2 * EMBD].mul_(1.08)


def test_the_trainer_warns_ahead_of_a_growing_attention_with_the_default_callback(tmp_path: Path) -> None:
    """The precursors sampled under the Trainer as under ``Guard.step``: its SDPA attention found by what it
    computes, the growth warned once, for the layer that grows."""
    events: list[dict] = []
    guard_cb = NanGuardCallback(policy="raise", precursor_every=2, on_event=events.append)
    args = _args(tmp_path, max_steps=60, learning_rate=0.0)
    Trainer(model=_gpt2(), args=args, train_dataset=Samples(BATCH * 60), callbacks=[guard_cb, GrowQueryKey()]).train()
    warned = [(e["module"], e["signal"]) for e in events if e["kind"] == "warning"]
    assert warned == [("transformer.h.1.attn", "attn_logit")]
    assert ("lm_head", "logit_z") in guard_cb.guard.precursors.trend.series  # the output layer is sampled too
