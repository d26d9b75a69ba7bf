"""The norm a loop's own clip computed: what ``clip_grad_norm_`` returns (and the HF Trainer logs).

A guard that checks the step after the loop clipped (``LoopGuard`` at ``optimizer.step()``, the
HF callback at ``on_pre_optimizer_step``) sees the clipped gradients, whose norm stays at the
clip's ``max_norm`` however far the run diverges. ``ClipNorm`` keeps the norm the first clip of the
guarded parameters computed since the step began, as the device tensor the clip made; the guard
records it as the step's grad norm and reads it with the check's one host read (no added read, no
collective). A norm that is a DTensor split over ranks is not kept: making it whole is a collective.

Example:
    >>> clip = ClipNorm(optimizer_params)
    >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # seen
    >>> guard.check(loss, grad_norm=clip.take())
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from nanguard import compat, dist

__all__ = ["ClipNorm", "sums_every_rank"]


class ClipNorm:
    """Watches every ``clip_grad_norm_`` of the process for the one that clips ``params``.

    Example:
        >>> clip = ClipNorm(model.parameters())
        >>> norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        >>> float(clip.take()) == float(norm)
        True
        >>> clip.close()
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._ids = frozenset(id(p) for p in params)
        self._norm: torch.Tensor | None = None
        self._split = False  # the clip's norm was a DTensor (its value may be this rank's alone)
        ref = weakref.ref(self)

        def seen(parameters: Any, total_norm: torch.Tensor) -> None:
            me = ref()
            if me is not None:
                me._seen(parameters, total_norm)

        # A guard nobody closed stops watching once it is gone.
        self._stop = weakref.finalize(self, compat.watch_clips(seen))

    def _seen(self, parameters: Any, total_norm: torch.Tensor) -> None:
        if self._norm is not None:
            return  # the step's first clip saw the gradients as the backward left them
        if any(id(p) in self._ids for p in parameters):
            self._norm = _whole(total_norm)
            self._split = getattr(total_norm, "placements", None) is not None

    def take(self, *, reduced: bool = False) -> torch.Tensor | None:
        """The norm the step's clip computed (None when nothing clipped the parameters); the next
        clip starts a new step. ``reduced``: only a norm the clip was given as a plain tensor (torchtitan's
        clip reduces it over the mesh first); a DTensor one may hold what only this rank saw."""
        norm, self._norm = self._norm, None
        return None if reduced and self._split else norm

    def clear(self) -> None:
        """A new step begins: a clip that ran after the last check is not this step's."""
        self._norm = None

    def close(self) -> None:
        self._stop()
        self._norm = None


def _whole(norm: torch.Tensor) -> torch.Tensor | None:
    """``norm`` as a plain tensor holding the whole value, without communicating: a DTensor only when
    every rank of its mesh holds the whole (replicated) value; None otherwise."""
    placements = getattr(norm, "placements", None)
    if placements is None:
        return norm.detach()
    if all(p.is_replicate() for p in placements):
        return compat.inner_tensor(norm)
    return None


def sums_every_rank(params: Sequence[torch.Tensor], *, pipelined: bool = False) -> bool:
    """Does a clip's total norm of these parameters' gradients (``get_total_norm``, made whole) add up every
    rank's own gradients? Plain parameters (replicated by DDP, which averages their gradients first; or a pipeline
    stage of one rank), or DTensors on one mesh, of the whole world (or, ``pipelined``, of a stage: the clip then
    sums the stages' norms over the pipeline mesh), with some parameter sharded on each of its dimensions: the
    total norm is then a partial sum over every dimension, into which a replicated parameter's norm enters as
    each rank's own (scaled by ``1 / size ** (1 / p)``), so a NaN in any rank's gradient reaches it (FSDP2, TP,
    2D). A dimension where every parameter is replicated (HSDP's) keeps a rank's own there.

    Example:
        >>> sums_every_rank(list(fully_sharded_model.parameters()))
        True
    """
    placed = [p for p in params if getattr(p, "placements", None) is not None]
    if not placed:
        return True
    mesh: Any = placed[0].device_mesh  # type: ignore[attr-defined]
    if len(placed) != len(params) or any(p.device_mesh != mesh for p in placed):  # type: ignore[attr-defined]
        return False
    world = dist.world_size()
    whole = mesh.size() == world or (pipelined and world % mesh.size() == 0)
    sharded = [any(p.placements[d].is_shard() for p in placed) for d in range(mesh.ndim)]  # type: ignore[attr-defined]
    return whole and all(sharded)
