"""Rank and world helpers that work with no process group (a single-process world)."""

from __future__ import annotations

import torch.distributed as tdist

__all__ = ["is_distributed", "rank", "rank_or_none", "world_size"]


def is_distributed() -> bool:
    return tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1


def rank() -> int:
    return tdist.get_rank() if tdist.is_available() and tdist.is_initialized() else 0


def world_size() -> int:
    return tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1


def rank_or_none() -> int | None:
    """The rank under torch.distributed, or None in a plain single process."""
    return rank() if tdist.is_available() and tdist.is_initialized() else None
