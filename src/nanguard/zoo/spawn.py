"""Run a function on N spawned gloo ranks on this machine (CPU), with a deadline, and collect JSON results.

Used by ``nanguard demo --ranks N``, ``nanguard zoo --ranks N``, the DDP benchmark and the
distributed tests. Each rank initializes the process group from a ``file://`` path, waits at
a barrier, runs ``fn(rank, world, *args)`` and writes its JSON result, or its traceback, for
the parent. The parent waits until every rank has answered or the deadline has passed.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from nanguard._io import atomic_write_text

__all__ = ["RanksFailed", "spawn_ranks"]

# After one rank fails, its peers are usually stuck in a collective: wait this long, then stop them.
_GRACE_S = 10.0


class RanksFailed(RuntimeError):
    """One or more ranks raised, crashed or missed the deadline; the message holds every rank's story."""


def _worker(rank: int, world: int, tmp: str, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> None:
    result: dict[str, Any]
    try:
        # Ranks share this machine's cores: a fixed share each, or they oversubscribe it.
        torch.set_num_threads(max(1, (os.cpu_count() or world) // world))
        tdist.init_process_group(
            "gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
        )
        tdist.barrier()
        result = {"ok": True, "value": fn(rank, world, *args)}
        # No rank tears the group down while a peer may still be in its last collective.
        tdist.barrier()
    except BaseException:
        result = {"ok": False, "error": traceback.format_exc()}
    try:
        text = json.dumps(result)
    except (TypeError, ValueError) as err:
        text = json.dumps({"ok": False, "error": f"the rank's result is not JSON: {err}"})
    atomic_write_text(Path(tmp, f"rank{rank}.json"), text)
    with contextlib.suppress(Exception):
        if tdist.is_initialized():
            tdist.destroy_process_group()
    # The result is on disk: leave without C++ static destructors, where gloo's and DDP's
    # worker threads can abort a finished rank ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(fn: Callable[..., Any], *args: Any, world: int = 2, timeout: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; return each rank's result, by rank.

    ``fn`` must be importable by the spawned processes (a module-level function) and return
    something JSON can hold. A rank that raises or crashes, or no answer within ``timeout``
    seconds, raises ``RanksFailed`` with every failed rank's traceback or status.

    Example:
        >>> spawn_ranks(demo_rank, "nan_pixels", 6, None, 0, world=2)
        [{'rank': 0, 'skipped': 1, ...}, {'rank': 1, 'skipped': 1, ...}]
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise ValueError(f"world must be an int >= 2, got {world!r}")
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _worker, args=(world, tmp, fn, args, timeout), nprocs=world, join=False, start_method="spawn"
        )
        results = _collect(context.processes, Path(tmp), timeout)
    failures = []
    for rank in range(world):
        outcome = results.get(rank)
        if isinstance(outcome, str):
            failures.append(f"rank {rank}: {outcome}")
        elif outcome is None:
            failures.append(f"rank {rank} reported nothing")
        elif not outcome["ok"]:
            failures.append(f"rank {rank} failed:\n{outcome['error']}")
    if failures:
        raise RanksFailed("\n".join(failures))
    return [results[rank]["value"] for rank in range(world)]


def _collect(procs: list[Any], tmp: Path, timeout: float) -> dict[int, Any]:
    """Each rank's result dict, or a string saying why there is none; stops every process."""
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    while len(results) < len(procs):
        now = time.monotonic()
        if now > deadline or (failed_at is not None and now > failed_at + _GRACE_S):
            break
        if _poll(procs, tmp, results) and failed_at is None:
            failed_at = now
        time.sleep(0.05)
    _stop(procs)
    for rank in range(len(procs)):
        results.setdefault(
            rank, f"no result before the deadline ({timeout:.0f}s, or {_GRACE_S:.0f}s after a peer failed)"
        )
    return results


def _poll(procs: list[Any], tmp: Path, results: dict[int, Any]) -> bool:
    """Add the answers of the ranks that answered since the last look; True when one of them failed."""
    failed = False
    for rank, proc in enumerate(procs):
        if rank in results:
            continue
        code = proc.exitcode  # read first: a rank writes its result before it exits
        path = tmp / f"rank{rank}.json"
        if path.exists():
            results[rank] = json.loads(path.read_text(encoding="utf-8"))
        elif code is not None:
            results[rank] = f"exited with code {code} and no result"
        else:
            continue
        failed = failed or isinstance(results[rank], str) or not results[rank]["ok"]
    return failed


def _stop(procs: list[Any]) -> None:
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
