"""Wall time of the Hugging Face Trainer and TRL's SFTTrainer, with ``NanGuardCallback`` against without, interleaved.

The Trainer owns its loop, so the unit interleaved is a short ``trainer.train()`` (``--steps`` optimizer steps):
the guarded and the unguarded trainer of each configuration take turns, round after round, and a callback
times every step from one ``on_step_end`` to the next (everything the step does, nanguard's hooks, the Trainer's
logging and the callback's ``on_log`` included); the first steps of each round are left out (the data loader
starting). The ratio is the median guarded step over the median unguarded step; "guard's own share" is the
share of a guarded step spent in nanguard's callback and its recording wrappers, by cProfile: an upper bound
(cProfile slows Python code most) that does not drift with the machine's load as the wall ratio does.

Configurations: a GPT-2 (2 layers, d=64, T=32, batch 4) under ``transformers.Trainer`` with 2 accumulation
steps, and a Llama of the same size under TRL's ``SFTTrainer`` on a word-level tokenizer built here; AdamW,
``max_grad_norm=1.0``, nothing downloaded. Run: ``.venv/bin/python benchmarks/hf_overhead.py [--rounds N]``;
writes BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import os
import pstats
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"

import torch

from _common import machine, write_section

SEQ, BATCH, ACCUM, WIDTH, LAYERS = 32, 4, 2, 64, 2
SKIP = 2  # the first steps of each round: the data loader starting


class _Timer:
    """A Trainer callback: the seconds between consecutive ``on_step_end``s."""

    def __new__(cls) -> Any:
        from transformers import TrainerCallback

        class Timer(TrainerCallback):
            def __init__(self) -> None:
                self.times: list[float] = []
                self._last: float | None = None

            def on_train_begin(self, args, state, control, **kwargs):
                self._last, self._seen = None, 0

            def on_step_end(self, args, state, control, **kwargs):
                now = time.perf_counter()
                if self._last is not None and self._seen >= SKIP:
                    self.times.append(now - self._last)
                self._last, self._seen = now, self._seen + 1

        return Timer()


def _args(out: str, steps: int, cls: Any, **extra: Any) -> Any:
    return cls(
        output_dir=out,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUM,
        max_steps=steps,
        learning_rate=1e-4,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        **extra,
    )


def hf_trainer(guarded: bool, steps: int, out: str) -> tuple[Any, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from nanguard.integrations.hf import NanGuardCallback

    torch.manual_seed(0)
    config = GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=4, vocab_size=512, n_positions=SEQ)
    ids = torch.randint(512, (4096, SEQ), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    timer = _Timer()
    callbacks = [timer, *([NanGuardCallback()] if guarded else [])]
    trainer = Trainer(
        model=GPT2LMHeadModel(config),
        args=_args(out, steps, TrainingArguments),
        train_dataset=data,
        callbacks=callbacks,
    )
    return trainer, timer


def sft_trainer(guarded: bool, steps: int, out: str) -> tuple[Any, Any]:
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    from nanguard.integrations.hf import NanGuardCallback

    words = [f"w{i}" for i in range(509)]
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *words])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    gen = torch.Generator().manual_seed(0)
    texts = [" ".join(words[j] for j in torch.randint(509, (SEQ - 1,), generator=gen).tolist()) for _ in range(4096)]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=WIDTH,
        intermediate_size=4 * WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        max_position_embeddings=SEQ,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    timer = _Timer()
    callbacks = [timer, *([NanGuardCallback()] if guarded else [])]
    trainer = SFTTrainer(
        model=LlamaForCausalLM(config),
        args=_args(out, steps, SFTConfig, max_length=SEQ),
        train_dataset=Dataset.from_dict({"text": texts}),
        processing_class=tok,
        callbacks=callbacks,
    )
    return trainer, timer


CONFIGS: dict[str, Callable[[bool, int, str], tuple[Any, Any]]] = {
    "`Trainer`, GPT-2, 2 accumulation steps": hf_trainer,
    "TRL `SFTTrainer`, Llama": sft_trainer,
}
HOOKS = ("_compute_loss", "_training_step")  # nanguard's recording wrappers: their own time only


def guard_share(build: Callable[[bool, int, str], tuple[Any, Any]], steps: int, out: str) -> float:
    """The share of a guarded run's steps spent in nanguard's callback and wrappers, by cProfile."""
    trainer, _ = build(True, steps, out)
    profile = cProfile.Profile()
    profile.enable()
    trainer.train()
    profile.disable()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    total = sum(v[3] for k, v in stats.items() if k[2] == "_inner_training_loop")
    own = sum(v[3] for k, v in stats.items() if k[0].endswith("integrations/hf.py") and k[2].startswith("on_"))
    own += sum(v[2] for k, v in stats.items() if k[0].endswith("integrations/hf_loss.py") and k[2] in HOOKS)
    return own / total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per round")
    args = parser.parse_args()
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    sys.stdout = open(os.devnull, "w")  # the Trainers print a log line per step  # noqa: SIM115
    load = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for name, build in CONFIGS.items():
            pair = {guarded: build(guarded, args.steps, f"{out}/{guarded}") for guarded in (False, True)}
            for _ in range(args.rounds):
                for guarded in (False, True):
                    pair[guarded][0].train()
            plain, guarded_ms = (statistics.median(pair[g][1].times) for g in (False, True))
            share = guard_share(build, args.steps, f"{out}/profile")
            ratio = guarded_ms / plain
            rows.append(f"| {name} | {plain * 1e3:.1f} | {guarded_ms * 1e3:.1f} | {ratio:.3f}x | {share:.2%} |")
    sys.stdout = sys.__stdout__
    load_after = os.getloadavg()[0]
    conditions = (
        f"Median wall time of one optimizer step, {args.rounds} interleaved rounds of {args.steps} steps per "
        f"trainer (the first {SKIP} of each left out), 1-minute load average {load:.1f}-{load_after:.1f}:"
    )
    body = f"""## Hugging Face Trainer and TRL (`NanGuardCallback`)

{conditions}

| trainer | unguarded step ms | guarded step ms | ratio | guard's own share (cProfile) |
|---|---:|---:|---:|---:|
{chr(10).join(rows)}

`benchmarks/hf_overhead.py --rounds {args.rounds} --steps {args.steps}` on {machine()}. A step is
{ACCUM} micro-batches of {BATCH} sequences of {SEQ} tokens through a {LAYERS}-layer, {WIDTH}-wide model (GPT-2 under
`transformers.Trainer`, Llama under TRL's `SFTTrainer` with a word-level tokenizer built in the script), AdamW,
`max_grad_norm=1.0`, `logging_steps=1`; the guarded and the unguarded trainer take turns, one short `train()`
each per round, and a callback times each step from one `on_step_end` to the next, so everything the step
does is in it (nanguard's `compute_loss` and `training_step` wrappers, its check before the optimizer step,
its `on_log`). The last column is the share of a guarded run spent in nanguard's callback and wrappers,
by cProfile over one run of {args.steps} steps: an upper bound, since cProfile slows Python code most, and
one that does not drift with the machine's load as the wall ratio does. Where the load average is above
the machine's core count, the wall ratio measures the neighbours, not the callback: read the last column.
"""
    write_section("hf-overhead", body)
    print(body)


if __name__ == "__main__":
    main()
