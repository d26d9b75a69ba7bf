"""The rank side of tests/test_integration_hf.py's distributed tests: a Hugging Face Trainer on a tiny GPT-2
over 2 gloo ranks, plain DDP or under a DeepSpeed ZeRO config, with the loss in a ``compute_loss_func`` or a
``compute_loss`` override that goes wrong on one marked sample (``-log(p - floor)``, the floor past p)."""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"

import torch

SEQ, EMBD, VOCAB, BATCH = 8, 32, 64, 2


class Marked(torch.utils.data.Dataset):
    """Seeded (inputs_embeds, labels) samples; sample ``mark``'s first label is ``VOCAB - 1``, the others' 0."""

    def __init__(self, n: int, mark: int | None) -> None:
        gen = torch.Generator().manual_seed(0)
        self.samples = []
        for i in range(n):
            x, y = torch.randn(SEQ, EMBD, generator=gen), torch.randint(VOCAB, (SEQ,), generator=gen)
            y[0] = VOCAB - 1 if i == mark else 0
            self.samples.append({"inputs_embeds": x, "labels": y})

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.samples[i]


def floored_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    p = logits[:, :-1].float().softmax(-1).gather(-1, labels[:, 1:, None]).squeeze(-1)
    floor = 0.5 * (labels[:, :1] == VOCAB - 1).float()
    return -torch.log(p - floor).mean()


def loss_func(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    return floored_nll(outputs.logits, labels)


def nan_term_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """The plain NLL, plus a term no gradient flows through that is NaN on a batch holding the marked sample:
    that rank's loss is NaN while its gradients stay finite."""
    logp = outputs.logits[:, :-1].float().log_softmax(-1).gather(-1, labels[:, 1:, None])
    marked = (labels[:, :1] == VOCAB - 1).any()
    return -logp.mean() + torch.where(marked, torch.nan, 0.0)


def run_trainer(rank: int, world: int, runs: list[dict[str, Any]], out_dir: str) -> list[dict[str, Any]]:
    """Each run: ``how`` ("compute_loss_func", "nan_term" (``nan_term_loss``) or "compute_loss"), ``mark``
    (the marked sample's index: the sequential sampler deals sample i to rank (i // 2) % 2 at step i // 4),
    ``zero`` (a ZeRO stage, or None for DDP), ``guard``."""
    os.environ.update({"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world)})
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29547", "DS_ACCELERATOR": "cpu"})
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    return [_run(run, f"{out_dir}/{i}") for i, run in enumerate(runs)]


def _run(run: dict[str, Any], out_dir: str) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from nanguard.integrations.hf import NanGuardCallback

    class FlooredTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            loss = floored_nll(outputs.logits, labels)
            return (loss, outputs) if return_outputs else loss

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=EMBD, n_head=2, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0)
    config.embd_pdrop = config.attn_pdrop = 0.0
    extra: dict[str, Any] = {}
    if run.get("zero") is not None:
        extra["deepspeed"] = {
            "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": run["zero"]},
            "steps_per_print": 10**9,
        }
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        max_steps=run.get("steps", 3),
        train_sampling_strategy="sequential",
        **extra,
    )
    callbacks = [NanGuardCallback(policy="skip")] if run.get("guard", True) else []
    data = Marked(64, run.get("mark"))
    if run["how"] in ("compute_loss_func", "nan_term"):
        trainer = Trainer(
            model=GPT2LMHeadModel(config),
            args=args,
            train_dataset=data,
            callbacks=callbacks,
            compute_loss_func=loss_func if run["how"] == "compute_loss_func" else nan_term_loss,
        )
    else:
        trainer = FlooredTrainer(model=GPT2LMHeadModel(config), args=args, train_dataset=data, callbacks=callbacks)
    trainer.train()
    params = list(trainer.model.parameters())
    diag = callbacks[0].last_diagnosis if callbacks else None
    return {
        "weights": hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in params)).hexdigest(),
        "skipped": callbacks[0].skipped if callbacks else None,
        "diagnosis": diag.to_dict() if diag is not None else None,
    }
