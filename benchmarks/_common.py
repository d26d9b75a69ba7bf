"""Shared bits of the benchmarks: timing by interleaved medians and the BENCHMARKS.md writer."""

from __future__ import annotations

import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

BENCHMARKS = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    threads = torch.get_num_threads()
    version = torch.__version__
    return f"{platform.system()} {cpu}, {os.cpu_count()} CPU threads, torch {version}, {threads} intra-op threads"


class CountOps(TorchDispatchMode):
    """Runs each aten op and counts it (``ops``): the floor of any tracer that sees every op."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def interleaved(configs: dict[str, Callable[[], None]], rounds: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds per call of each config, running them round-robin so drift hits all alike."""
    for fn in configs.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(rounds):
        for name, fn in configs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def write_section(name: str, body: str) -> None:
    """Replace the ``<!-- name -->`` ... ``<!-- /name -->`` section of BENCHMARKS.md."""
    text = BENCHMARKS.read_text() if BENCHMARKS.exists() else "# Benchmarks\n"
    block = f"<!-- {name} -->\n{body.strip()}\n<!-- /{name} -->"
    pattern = re.compile(rf"<!-- {re.escape(name)} -->.*?<!-- /{re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    BENCHMARKS.write_text(text)
