"""Spawn gloo ranks for a test: file:// init, a barrier before the body, tracebacks to the parent."""

from __future__ import annotations

import contextlib
import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp


def _entry(target: Callable[..., Any], rank: int, world: int, tmp: str, results: Any, args: tuple) -> None:
    try:
        torch.set_num_threads(1)
        tdist.init_process_group(
            "gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world, timeout=timedelta(seconds=90)
        )
        tdist.barrier()
        results.put((rank, "ok", target(rank, world, tmp, *args)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    # Flush the result to the parent, then leave without C++ static destructors, which can
    # abort a finished rank ("terminate called without an active exception").
    results.close()
    results.join_thread()
    with contextlib.suppress(Exception):
        if tdist.is_initialized():
            tdist.destroy_process_group()
    os._exit(0)


def run_ranks(target: Callable[..., Any], tmp_path: Any, *args: Any, world: int = 2, timeout: float = 120) -> list[Any]:
    """Run ``target(rank, world, tmp, *args)`` on ``world`` spawned ranks; return their results by rank.

    A rank that raises, or a hang past ``timeout`` seconds, fails the test with every
    rank's traceback or status.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(target, r, world, str(tmp_path), results, args)) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(got) < world and time.monotonic() < deadline:
        try:
            rank, status, value = results.get(timeout=1.0)
            got[rank] = (status, value)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs) and len(got) < world:
                time.sleep(1.0)
                continue
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    missing = [r for r in range(world) if r not in got]
    errors = {r: v for r, (s, v) in got.items() if s == "error"}
    if missing or errors:
        lines = [f"rank {r}: no result (hang or crash) before the {timeout:.0f}s deadline" for r in missing]
        lines += [f"rank {r} failed:\n{tb}" for r, tb in errors.items()]
        raise AssertionError("\n".join(lines))
    return [got[r][1] for r in range(world)]
