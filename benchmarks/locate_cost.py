"""Cost of ``ng.locate`` against the plain step: ratio of medians, interleaved.

Users meet ``locate`` on a faulty step (the guard replays a tripped one), where NaN flows
through most later ops, forward and backward, and every one of them is tracked. The faulty
rows plant the fault early: a forward hook takes the log of a module's output (about half
of it negative), so NaN runs through the rest of the forward and the whole backward. The
healthy rows time the same models without the fault, for comparison.

Run: ``.venv/bin/python benchmarks/locate_cost.py [--rounds N] [--gpt2-rounds N] [--no-gpt2]``;
writes BENCHMARKS.md. The GPT-2 row (81M parameters) needs transformers.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import nanguard as ng
from _common import interleaved, machine, write_section
from nanguard.zoo import GPT, GPTConfig, synthetic_batch, train_step


def _plant_log_fault(module: nn.Module) -> None:
    """From now on ``module`` returns the log of its output: NaN wherever the output was negative."""
    module.register_forward_hook(lambda _m, _args, output: output.log())


def _row(label: str, step: Callable[[], Any], model: nn.Module, rounds: int, warmup: int) -> tuple[str, float]:
    times = interleaved(
        {"plain": step, "locate": lambda: ng.locate(step, model=model)},
        rounds=rounds,
        warmup=warmup,
    )
    ratio = times["locate"] / times["plain"]
    return f"| {label} | {times['plain'] * 1e3:.0f} | {times['locate'] * 1e3:.0f} | {ratio:.2f}x |", ratio


def _gpt(cfg: GPTConfig, faulty: bool) -> tuple[GPT, Callable[[], Any], str]:
    torch.manual_seed(0)
    model = GPT(cfg)
    batch = synthetic_batch(cfg, torch.Generator().manual_seed(0))
    where = "healthy step"
    if faulty:
        _plant_log_fault(model.blocks[0].mlp.fc)
        where = "faulty step (log of blocks.0.mlp.fc's output)"
    return model, lambda: train_step(model, batch), where


def _gpt2() -> tuple[nn.Module, Callable[[], Any]]:
    """GPT-2 small's widths with 6 layers (81M parameters), 2 x 128 tokens, fault in h.4's MLP activation."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=6, n_embd=768, n_head=12, vocab_size=50257, n_positions=128)
    model = GPT2LMHeadModel(config)
    _plant_log_fault(model.transformer.h[4].mlp.act)
    ids = torch.randint(0, config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    return model, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--gpt2-rounds", type=int, default=5)
    parser.add_argument("--no-gpt2", action="store_true", help="skip the 81M GPT-2 row")
    args = parser.parse_args()
    rows = []
    for label, cfg in (
        ("tiny GPT (the zoo's default)", GPTConfig()),
        ("small GPT", GPTConfig(n_layer=4, n_embd=384, n_head=6, block_size=64)),
    ):
        shape = f"{cfg.n_layer} layers, d={cfg.n_embd}, T={cfg.block_size}, batch 8"
        for faulty in (False, True):
            model, step, where = _gpt(cfg, faulty)
            if faulty:  # the benchmark times the fault it claims to time
                diag = ng.locate(step, model=model)
                assert diag is not None and diag.cause == "op.log_domain", diag
            rows.append(_row(f"{label}: {shape}, {where}", step, model, args.rounds, warmup=3)[0])
            print(rows[-1], flush=True)
    gpt2 = not args.no_gpt2 and importlib.util.find_spec("transformers") is not None
    if gpt2:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            model, step = _gpt2()
            diag = ng.locate(step, model=model)
            assert diag is not None and diag.cause == "op.log_domain", diag
            label = (
                "GPT-2 (transformers): 6 layers, d=768, vocab 50257, 2 x 128 tokens, 1 thread, "
                "faulty step (log of h.4.mlp.act's output)"
            )
            rows.append(_row(label, step, model, args.gpt2_rounds, warmup=1)[0])
            print(rows[-1], flush=True)
        finally:
            torch.set_num_threads(threads)
    table = "\n".join(rows)
    rounds = f"{args.rounds} interleaved rounds" + (f" ({args.gpt2_rounds} for GPT-2)" if gpt2 else "")
    body = f"""## Locate replay cost

`ng.locate(step)` against the same plain step (float32 forward + backward), ratio of the medians of
{rounds}. A faulty step is the case users meet: the guard replays a tripped step, where NaN
flows through every op after the fault, forward and backward, and each is tracked; the healthy
rows are for comparison. Target: <= 3x one training step. The tracer's cost is per op, so the
ratio falls as ops get bigger.

| model, step | plain step ms | locate ms | ratio |
|---|---:|---:|---:|
{table}

Machine: {machine()}. Reproduce: `.venv/bin/python benchmarks/locate_cost.py {" ".join(sys.argv[1:])}`
(`make bench` runs the defaults)."""
    write_section("locate-cost", body)
    print(body)


if __name__ == "__main__":
    main()
