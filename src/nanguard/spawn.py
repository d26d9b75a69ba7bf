"""Run a function on N spawned gloo ranks on this machine (CPU), and collect JSON results.

Used by ``nanguard demo --ranks N`` and ``nanguard zoo --ranks N``. Each rank initializes
the process group from a ``file://`` path, waits at a barrier, runs ``fn(**kwargs)`` and
writes its JSON result (or its traceback) for the parent.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

__all__ = ["spawn_ranks"]


def _worker(rank: int, world: int, tmp: str, target: str, kwargs: dict[str, Any]) -> None:
    result: dict[str, Any]
    try:
        # Ranks share this machine's cores: one intra-op thread each, or they oversubscribe it.
        torch.set_num_threads(max(1, (os.cpu_count() or world) // world))
        # A rank that fails leaves the others in a collective: they give up after the timeout.
        tdist.init_process_group(
            "gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world, timeout=timedelta(seconds=120)
        )
        tdist.barrier()
        module, _, name = target.partition(":")
        result = {"ok": True, "value": getattr(importlib.import_module(module), name)(**kwargs)}
        tdist.barrier()
    except Exception:
        result = {"ok": False, "error": traceback.format_exc()}
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    with contextlib.suppress(Exception):
        if tdist.is_initialized():
            tdist.destroy_process_group()
    # The result is on disk: leave without C++ static destructors, where gloo's and DDP's
    # worker threads can abort a finished rank ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(target: str, world: int, **kwargs: Any) -> list[dict[str, Any]]:
    """Run ``target`` ("pkg.module:function") on ``world`` gloo ranks; one result dict per rank.

    Each dict has ``ok`` and either ``value`` (the function's JSON-able return) or ``error``
    (the rank's traceback).

    Example:
        >>> spawn_ranks("nanguard.demo_dist:demo_rank", 2, fault="nan_pixels", steps=6, run_dir=None)
    """
    if world < 2:
        raise ValueError(f"world must be >= 2, got {world}")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, tmp, target, kwargs), nprocs=world, join=True)
        out = []
        for rank in range(world):
            path = Path(tmp, f"rank{rank}.json")
            out.append(json.loads(path.read_text()) if path.exists() else {"ok": False, "error": "no result"})
        return out
