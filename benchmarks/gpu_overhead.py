"""Guard overhead and host syncs on one GPU: a GPT-2-small-sized GPT (12 layers, d=768, vocab 50257,
T=1024) in bfloat16 autocast, AdamW fused and unfused, each against the same unguarded loop.

Per configuration: the median step time over interleaved rounds (each step timed to its end with a
device sync, outside the guard), and the host syncs per step counted with
``torch.cuda.set_sync_debug_mode("warn")`` over untimed steps (a guarded loop minus the plain one).
The Guard runs with default settings: ``sync="auto"`` reads each step's flags one step late with
the fused optimizer and within the step with the unfused one.

Run: ``.venv/bin/python benchmarks/gpu_overhead.py [--rounds N] [--batch B]`` on a CUDA machine
(a few minutes on one GPU); writes the ``overhead-gpu`` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable

import torch

import nanguard as ng
from _common import write_section
from nanguard.zoo import GPT, GPTConfig, synthetic_batch

GPT2_SMALL = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)


def _gpt2_small() -> GPT:
    model = GPT(GPT2_SMALL)
    model.lm_head.weight = model.wte.weight  # tied, as in GPT-2: 124M parameters
    return model


def _loop(fused: bool, guarded: bool, batch_size: int) -> tuple[Callable[[], None], ng.Guard | None]:
    torch.manual_seed(0)
    model = _gpt2_small().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, foreach=None if fused else True)
    pool = [
        {k: v.cuda() for k, v in synthetic_batch(GPT2_SMALL, torch.Generator().manual_seed(i), batch_size).items()}
        for i in range(4)
    ]
    guard = ng.Guard(model, opt) if guarded else None
    it = iter(range(1 << 62))

    def closure(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(**batch)
        loss.backward()
        return loss

    def step() -> None:
        batch = pool[next(it) % len(pool)]
        if guard is None:
            closure(batch)
            opt.step()
        else:
            guard.step(lambda: closure(batch), batch=batch)

    return step, guard


def _syncs(step: Callable[[], None], n: int) -> float:
    """Host syncs per step, as ``set_sync_debug_mode("warn")`` reports them."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(n):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in seen) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_overhead.py needs a CUDA device")
    keys = [(fused, guarded) for fused in (True, False) for guarded in (False, True)]
    configs = {key: _loop(*key, args.batch) for key in keys}
    for step, _ in configs.values():
        for _ in range(3):
            step()
    times: dict[tuple[bool, bool], list[float]] = {key: [] for key in configs}
    for _ in range(args.rounds):
        for key, (step, _) in configs.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times[key].append(time.perf_counter() - start)
    syncs = {key: _syncs(step, 5) for key, (step, _) in configs.items()}
    for _, guard in configs.values():
        if guard is not None:
            guard.close()
    rows = []
    for fused in (True, False):
        plain, guarded = (sorted(times[(fused, g)])[args.rounds // 2] for g in (False, True))
        mode = "deferred" if configs[(fused, True)][1]._deferred else "immediate"  # type: ignore[union-attr]
        rows.append(
            f"| AdamW {'fused' if fused else 'foreach'} | {mode} | {plain * 1e3:.1f} | {guarded * 1e3:.1f} | "
            f"{guarded / plain:.4f}x | {syncs[(fused, True)] - syncs[(fused, False)]:+.1f} |"
        )
    with torch.device("meta"):
        n_params = sum(p.numel() for p in _gpt2_small().parameters())
    conditions = (
        f"GPT ({n_params / 1e6:.0f}M parameters), batch {args.batch}, bfloat16 "
        f"autocast, default Guard, median of {args.rounds} interleaved rounds:"
    )
    body = f"""## Guard overhead (GPU)

{conditions}

| optimizer | guard read | plain ms | guarded ms | ratio | syncs added per step |
|---|---|---:|---:|---:|---:|
{chr(10).join(rows)}

The GPT has {GPT2_SMALL.n_layer} layers, d={GPT2_SMALL.n_embd}, vocab {GPT2_SMALL.vocab_size},
T={GPT2_SMALL.block_size}.
Syncs: host syncs per step that `torch.cuda.set_sync_debug_mode("warn")` reports, guarded minus plain.
Target: Guard <= 1.005x and no host sync added per step.

Machine: {torch.cuda.get_device_name()}, torch {torch.__version__}.
Reproduce: `.venv/bin/python benchmarks/gpu_overhead.py`."""
    write_section("overhead-gpu", body)
    print(body)


if __name__ == "__main__":
    main()
