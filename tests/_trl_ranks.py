"""TRL's trainers on a tiny Llama built from a config and a word-level tokenizer built here (nothing is
downloaded), for tests/test_integration_trl.py, in process and on spawned gloo ranks.

A run is described by a JSON-able dict: ``trainer`` ("sft", "dpo", "grpo"), ``fault`` (None, or where the
loss goes wrong), ``guard`` (run under ``NanGuardCallback`` or not), ``bad`` (the index of the global
batch whose samples hold only the word ``BAD_WORD``: under 2 ranks it is dealt to rank ``bad % 2``, step
``bad // 2``, since the sampler is sequential). The faults are written the ways users write losses:

- ``log_func``: ``compute_loss_func`` computing ``-log(p - floor)``, the floor raised on marked rows (a
  negative argument);
- ``log_override``: the same loss in a ``compute_loss`` override (TRL's recommended way);
- ``nan_loss``: a ``compute_loss`` override adding a z-loss averaged over the tokens that are not the
  marked word: an empty selection on a marked batch, so the loss is NaN and every gradient finite;
- ``dpo_log``: a DPO ``compute_loss`` override, a floored ``-log`` of the preference probability from the
  policy's and the reference model's log-probs;
- ``nan_stat``: a GRPO ``compute_loss`` override adding a statistic of the prompt's ordinary words, a
  mean over an empty selection on a marked batch (NaN, no gradient). A NaN reward is not a fault there: GRPO
  reads NaN rewards as missing ones.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"

import torch

WORDS = [f"w{i}" for i in range(40)]
BAD_WORD = "w39"
SPECIAL = ["<pad>", "<eos>", "<unk>"]
BATCH, SEQ = 2, 8


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def model(seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(SPECIAL) + len(WORDS),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    return LlamaForCausalLM(config)


def bad_id() -> int:
    return len(SPECIAL) + WORDS.index(BAD_WORD)


def texts(n: int, bad: int | None, length: int = SEQ, drop: int | None = None) -> list[str]:
    """``n`` seeded texts of ordinary words; the samples of global batch ``bad`` are ``BAD_WORD`` repeated,
    those of global batch ``drop`` are left out."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        words = [WORDS[j] for j in torch.randint(len(WORDS) - 1, (length,), generator=gen).tolist()]
        if bad is not None and i // BATCH == bad:
            words = [BAD_WORD] * length
        if drop is None or i // BATCH != drop:
            out.append(" ".join(words))
    return out


def _marked(ids: torch.Tensor) -> torch.Tensor:
    """Per row: 1.0 where it holds the marked word."""
    return (ids == bad_id()).any(-1).float()


def floored_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``-log(p - floor)`` over the labelled tokens, the floor 0.9 on marked rows: ``log`` of a negative there."""
    logits, labels = logits[:, :-1], labels[:, 1:]
    valid = labels != -100
    p = logits.float().softmax(-1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    floor = 0.9 * _marked(labels)[:, None]
    return -(torch.log(p - floor) * valid).sum() / valid.sum().clamp(min=1)


def loss_func(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    return floored_nll(outputs.logits, labels)


def _seq_logps(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logps = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (logps * mask[:, 1:]).sum(-1)


def sft_class(fault: str | None) -> Any:
    from trl import SFTTrainer

    if fault not in ("log_override", "nan_loss"):
        return SFTTrainer

    class CustomLossSFT(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            ids, labels = inputs["input_ids"], inputs["labels"]
            outputs = model(input_ids=ids, attention_mask=inputs.get("attention_mask"))
            if fault == "log_override":
                loss = floored_nll(outputs.logits, labels)
            else:
                loss = torch.nn.functional.cross_entropy(
                    outputs.logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
                )
                words = (labels >= len(SPECIAL)) & (labels != bad_id())  # empty on a marked batch: a NaN mean
                loss = loss + 1e-4 * outputs.logits.float().logsumexp(-1)[words].pow(2).mean()
            return (loss, outputs) if return_outputs else loss

    return CustomLossSFT


def dpo_class(fault: str | None) -> Any:
    from trl import DPOTrainer

    if fault != "dpo_log":
        return DPOTrainer

    class FlooredDPO(DPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            ids, attn, mask = inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"]
            logps = _seq_logps(model(input_ids=ids, attention_mask=attn).logits, ids, mask)
            with torch.no_grad():
                ref = _seq_logps(self.ref_model(input_ids=ids, attention_mask=attn).logits, ids, mask)
            chosen, rejected = (logps - ref).chunk(2)
            p = torch.sigmoid(0.1 * (chosen - rejected))
            floor = 0.9 * _marked(ids).chunk(2)[0]
            loss = -torch.log(p - floor).mean()
            return (loss, {}) if return_outputs else loss

    return FlooredDPO


def _common(out_dir: str, steps: int, accum: int) -> dict[str, Any]:
    return {
        "output_dir": out_dir,
        "per_device_train_batch_size": BATCH,
        "gradient_accumulation_steps": accum,
        "max_steps": steps,
        "learning_rate": 1e-3,
        "report_to": "none",
        "logging_steps": 1,
        "save_strategy": "no",
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 0,
        "train_sampling_strategy": "sequential",
    }


def build(run: dict[str, Any], out_dir: str) -> Any:
    """The trainer ``run`` describes, with ``NanGuardCallback(policy="skip")`` when ``run["guard"]``."""
    from datasets import Dataset
    from trl import DPOConfig, GRPOConfig, SFTConfig

    from nanguard.integrations.hf import NanGuardCallback

    kind, fault, steps, accum = run["trainer"], run.get("fault"), run.get("steps", 4), run.get("accum", 1)
    n = BATCH * accum * steps * 2 + BATCH * 4
    callbacks: list[Any] = [NanGuardCallback(policy="skip", run_dir=f"{out_dir}/nanguard")] if run.get("guard") else []
    if run.get("stop_after"):
        callbacks.append(_StopAfter(run["stop_after"]))
    common = _common(out_dir, steps, accum)
    tok = tokenizer()
    if kind == "sft":
        args = SFTConfig(**common, max_length=SEQ + 2, loss_type=run.get("loss_type", "nll"))
        data = Dataset.from_dict({"text": texts(n, run.get("bad"), drop=run.get("drop"))})
        extra = {"compute_loss_func": loss_func} if fault == "log_func" else {}
        cls = sft_class(fault)
        return cls(model=model(), args=args, train_dataset=data, processing_class=tok, callbacks=callbacks, **extra)
    if kind == "dpo":
        args = DPOConfig(**common, max_length=3 * SEQ)
        prompts, answers = texts(n, None, 4), texts(2 * n, run.get("bad"))
        data = Dataset.from_dict({"prompt": prompts, "chosen": answers[:n], "rejected": answers[n:]})
        return dpo_class(fault)(
            model=model(),
            ref_model=model(seed=1),
            args=args,
            train_dataset=data,
            processing_class=tok,
            callbacks=callbacks,
        )
    assert kind == "grpo"
    args = GRPOConfig(**common, num_generations=BATCH, max_completion_length=4)
    data = Dataset.from_dict({"prompt": texts(n, run.get("bad"), 4)})

    def reward(completions: list[str], **kwargs: Any) -> list[float]:
        return [float(len(set(c.split()))) for c in completions]

    return grpo_class(fault)(
        model=model(), reward_funcs=reward, args=args, train_dataset=data, processing_class=tok, callbacks=callbacks
    )


def grpo_class(fault: str | None) -> Any:
    from trl import GRPOTrainer

    if fault != "nan_stat":
        return GRPOTrainer

    class StatGRPO(GRPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            ids = inputs["prompt_ids"]
            words = (ids >= len(SPECIAL)) & (ids != bad_id())
            return loss + 1e-3 * ids.float()[words].mean()

    return StatGRPO


class _StopAfter:
    """Stop after ``updates`` optimizer steps (a reference run with one batch fewer, on the same LR schedule)."""

    def __new__(cls, updates: int) -> Any:
        from transformers import TrainerCallback

        class StopAfter(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                control.should_training_stop = state.global_step >= updates

        return StopAfter()


def run_one(run: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """Train ``run``; its weights' digest, the Trainer's logged losses, nanguard's step losses and diagnosis."""
    trainer = build(run, out_dir)
    trainer.train()
    params = list(trainer.model.parameters())
    callback = next((c for c in trainer.callback_handler.callbacks if type(c).__name__ == "NanGuardCallback"), None)
    diag = callback.last_diagnosis if callback is not None else None
    return {
        "weights": hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in params)).hexdigest(),
        "logged": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "skipped": callback.skipped if callback is not None else None,
        "diagnosis": diag.to_dict() if diag is not None else None,
    }


def run_ranks(rank: int, world: int, runs: list[dict[str, Any]], out_dir: str) -> list[dict[str, Any]]:
    """Each of ``runs`` on this rank of a gloo group the Trainer joins (accelerate reads the environment)."""
    os.environ.update({"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world)})
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29541"})
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return [run_one(run, f"{out_dir}/{i}") for i, run in enumerate(runs)]
