"""Rank/world helpers that work with no process group, flag agreement, replay and fingerprints.

With no process group every helper acts as a world of one, so callers never branch on
whether they run distributed.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from nanguard.findings import Diagnosis

__all__ = [
    "agree",
    "fingerprint",
    "gather_diagnosis",
    "is_distributed",
    "rank",
    "rank_or_none",
    "replay_locally",
    "unwrap",
    "world_size",
]


def _initialized() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def is_distributed() -> bool:
    return _initialized() and tdist.get_world_size() > 1


def rank() -> int:
    return tdist.get_rank() if _initialized() else 0


def world_size() -> int:
    return tdist.get_world_size() if _initialized() else 1


def rank_or_none() -> int | None:
    """The rank under torch.distributed, or None in a plain single process."""
    return rank() if _initialized() else None


def agree(code: torch.Tensor) -> torch.Tensor:
    """Every rank's ``code`` (a small int device scalar), as a [world_size] tensor.

    One all-reduce of world_size int32 values: each rank writes its own slot.
    """
    if not is_distributed():
        return code.reshape(1)
    codes = torch.zeros(tdist.get_world_size(), dtype=torch.int32, device=code.device)
    codes[tdist.get_rank()] = code
    tdist.all_reduce(codes)
    return codes


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP/DataParallel wrappers, so names match theirs."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


@contextlib.contextmanager
def _no_grad_sync(model: nn.Module) -> Iterator[None]:
    if isinstance(model, nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
        return
    setter = getattr(model, "set_requires_gradient_sync", None)  # FSDP2 fully_shard
    if callable(setter):
        setter(False)
        try:
            yield
        finally:
            setter(True)
        return
    yield


def replay_locally(model: nn.Module, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` with gradient communication off, so a rank sees only its own data and compute."""
    with _no_grad_sync(model):
        return fn()


def _all_gather_bytes(payload: bytes, device: torch.device) -> list[bytes]:
    """All-gather variable-length bytes as uint8 tensors: no pickle crosses the wire."""
    world = tdist.get_world_size()
    data = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        if payload
        else torch.zeros(0, dtype=torch.uint8, device=device)
    )
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    tdist.all_gather(sizes, size)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    chunks = [torch.zeros_like(padded) for _ in range(world)]
    tdist.all_gather(chunks, padded)
    return [bytes(c[: int(s)].cpu().tolist()) for c, s in zip(chunks, sizes, strict=True)]


def _comm_device() -> torch.device:
    if tdist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_diagnosis(diag: Diagnosis | None, flagged: list[int]) -> Diagnosis | None:
    """Combine each rank's local replay into one diagnosis every rank agrees on.

    ``rank`` is the originating rank: the first rank whose own replay reproduces the fault,
    preferring ranks that flagged it; ``ranks`` are all ranks that reproduce it. None when
    no rank reproduces it (a transient fault).
    """
    if not is_distributed():
        return diag
    payload = json.dumps(diag.to_dict()).encode() if diag is not None else b""
    gathered = _all_gather_bytes(payload, _comm_device())
    local = {r: Diagnosis.from_dict(json.loads(p)) for r, p in enumerate(gathered) if p}
    if not local:
        return None
    reproducing = sorted(local)
    origin = next((r for r in reproducing if r in flagged), reproducing[0])
    chosen = local[origin]
    chosen.rank = origin
    chosen.ranks = reproducing
    chosen.evidence["flagged_ranks"] = flagged
    chosen.evidence["per_rank_causes"] = {str(r): d.cause for r, d in local.items()}
    return chosen


def fingerprint(model: nn.Module) -> list[float]:
    """A cheap per-parameter fingerprint: the L2 norm of each parameter, in float64."""
    params = [p.detach() for p in unwrap(model).parameters()]
    if not params:
        return []
    norms = torch._foreach_norm(params, 2.0)
    return torch.stack([n.double().cpu() for n in norms]).tolist()
