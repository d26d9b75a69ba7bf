"""False spike warnings on clean runs, and the divergence scenario still caught at the same step.

Sources, each trained under a default ``ng.Guard`` (its loss and grad-norm spike detectors, and the
warning when the loss or the grad norm leaves its recent level tenfold):
the zoo's healthy scenarios, a healthy tiny Hugging Face GPT-2 (needs the ``bench`` extra), and a
noisy linear regression. The rate is warnings per 10,000 clean steps. The zoo's ``lr_too_high``
divergence scenario runs as in ``nanguard zoo``: its trip step and cause must not change. The
clipped divergence (AdamW at 10,000x its LR, ``clip_grad_norm_(..., 1.0)`` under ``LoopGuard``) must
be warned about within the first steps its loss has grown tenfold.

Run: ``.venv/bin/python benchmarks/spike_rate.py [--steps N]``; writes BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import nanguard as ng
from _common import machine, write_section
from nanguard.integrations.loop import LoopGuard
from nanguard.zoo import get
from nanguard.zoo.runner import run_scenario
from nanguard.zoo.scenarios import build

_WARNINGS: list[dict[str, Any]] = []  # the departure warnings of the source running now


def _guard(model: nn.Module, optimizer: torch.optim.Optimizer) -> ng.Guard:
    _WARNINGS.clear()
    return ng.Guard(
        model, optimizer, policy="skip", on_event=lambda e: _WARNINGS.append(e) if e["kind"] == "warning" else None
    )


def _count(guard: ng.Guard, steps: int, step: Callable[[int], None]) -> int:
    for i in range(steps):
        step(i)
    assert guard.skipped == 0, "a clean run tripped"
    return guard.spikes + len(_WARNINGS)


def clipped_divergence(steps: int = 12) -> tuple[int | None, int | None]:
    """AdamW at 10,000x its LR under a clip to 1.0, through ``LoopGuard``: (the first step whose loss is
    10x the median before it, the step warned at)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4 * 10_000)
    events: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(0)
    losses: list[float] = []
    with LoopGuard(model, opt, on_event=events.append):
        for _ in range(steps):
            ids = torch.randint(64, (4, 16), generator=gen)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
    grown = next((i for i in range(1, steps) if losses[i] >= 10 * statistics.median(losses[:i])), None)
    warned = next((e["step"] for e in events if e["kind"] == "warning"), None)
    return grown, warned


def zoo_healthy(name: str, steps: int) -> int:
    run = build(get(name), seed=0)
    guard = _guard(run.model, run.optimizer)

    def step(i: int) -> None:
        batch = run.batch(i)
        guard.step(run.closure(batch), batch=batch)

    return _count(guard, steps, step)


def hf_gpt2(steps: int) -> int | None:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = _guard(model, opt)
    gen = torch.Generator().manual_seed(0)

    def step(i: int) -> None:
        ids = torch.randint(64, (4, 16), generator=gen)

        def closure() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss

        guard.step(closure)

    return _count(guard, steps, step)


def noisy_regression(steps: int) -> int:
    torch.manual_seed(0)
    true_w = torch.randn(16, 1)
    model = nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = _guard(model, opt)
    gen = torch.Generator().manual_seed(1)

    def step(i: int) -> None:
        x = torch.randn(32, 16, generator=gen)
        y = x @ true_w + 0.5 * torch.randn(32, 1, generator=gen)

        def closure() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        guard.step(closure)

    return _count(guard, steps, step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=1000, help="steps per training source (regression: 10x)")
    args = parser.parse_args()
    logging.getLogger("nanguard").setLevel(logging.ERROR)  # the warnings are what we count
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows: list[tuple[str, int, int | None]] = []
    for name in ("healthy_padding_mask", "healthy_bf16_large_activations"):
        rows.append((f"zoo {name}", args.steps, zoo_healthy(name, args.steps)))
    rows.append(("HF GPT-2 (2 layers, d=32), AdamW", args.steps, hf_gpt2(args.steps)))
    rows.append(("noisy linear regression, SGD", 10 * args.steps, noisy_regression(10 * args.steps)))
    lr = run_scenario(get("lr_too_high"))
    grown, warned = clipped_divergence()
    seconds = time.perf_counter() - start
    counted = [(s, w) for _, s, w in rows if w is not None]
    total_steps, total = sum(s for s, _ in counted), sum(w for _, w in counted)
    table = "\n".join(
        f"| {name} | {steps} | {'n/a' if w is None else w} | {'n/a' if w is None else f'{w / steps * 1e4:.1f}'} |"
        for name, steps, w in rows
    )
    got = lr.got or {}
    body = f"""## Spike warnings on clean runs

Default `ng.Guard` spike detectors and departure warning (loss, grad norm), warnings over clean training runs:

| source | steps | warnings | per 10,000 steps |
|---|---:|---:|---:|
{table}
| **all** | {total_steps} | {total} | {total / max(total_steps, 1) * 1e4:.1f} |

Target: <= 1 warning per 10,000 clean steps. Divergence must still be caught at the same step.
Divergence scenario `lr_too_high`: tripped at step {lr.detect_step} with `{got.get("cause")}` (expected step
{lr.expected_step}, the plain run's first bad step, `optimizer.divergence`). Clipped divergence (AdamW at
10,000x its LR, `clip_grad_norm_(..., 1.0)`, `LoopGuard`, never NaN): the loss first stood 10x its recent level
at step {grown}, warned at step {warned} with the LR named. The run took {seconds:.0f} s.

Machine: {machine()}. Reproduce: `.venv/bin/python benchmarks/spike_rate.py --steps {args.steps}`."""
    write_section("spike-rate", body)
    print(body)


if __name__ == "__main__":
    main()
