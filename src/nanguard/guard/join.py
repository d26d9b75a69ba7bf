"""DDP's ``join()`` (uneven inputs): a rank that ran out of batches shadows the guard's collectives.

Inside ``with ddp.join():`` a rank with no batch left loops in the join context, matching the
others' collectives with zeros: DDP's join hook shadows the forward's and the backward's. The
guard adds its own to the same hook (``install``, over a ``Shadow`` of the guard's parts): its last
gradient bucket carries the agreement's room (the guard's comm hook makes that room on every rank
whenever ``join()`` is on, so the shapes always match), or, when nothing rode, it takes part in the separate agreement
all-reduce. Its slot says ``JOINED`` and its step slot 0, so the mean loss and the grad norm are
over the ranks that step, and every rank knows the same set of joined ranks.

On a trip while a rank has joined, the stepping ranks' collectives are the diagnosis gather
(``dist.gather_diagnosis``), the hardware tracker's gather of where each rank runs (on the run's
first trip) and one flag saying whether the policy stopped the run; the joined
rank takes part in both and raises the same ``NonFiniteError`` when it did, so no rank is left
waiting. A stop the joined rank cannot foresee (a GradScaler collapse, spike skips in a row) ends
every step with that flag where it can happen (``tells_every_step``), and the finite divergence
trip, which needs the stepping ranks' history, waits while a rank has joined. The stepping ranks
skip what a joined rank cannot shadow: the replica fingerprint check,
the repeat check of a trip and ``check_batch``'s agreement before the forward.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed.algorithms.join import JoinHook

from nanguard import compat, dist
from nanguard.agreement import Layout
from nanguard.errors import NonFiniteError, OutOfStepError
from nanguard.guard.health import DeviceHealth, HealthCheck, HealthFlag
from nanguard.guard.progress import Progress

__all__ = ["Shadow", "in_join", "install", "tell_joined", "tells_every_step"]

log = logging.getLogger("nanguard")


@dataclass(eq=False)
class Shadow:
    """What a joined rank's shadow of the guard's step works with: the guard's parts, handed over
    as they are (the guard keeps this record; the join hook holds it weakly)."""

    health: HealthCheck
    progress: Progress
    """Where the run stands: the shadow reads the step and writes the others' diagnosis."""
    scaled: bool
    """The guard has a GradScaler."""
    tracker: Any = None
    """The run's hardware tracker (its first trip gathers every rank's whereabouts)."""
    disabled: bool = False
    skip_spikes: bool = False
    """The guard skips spikes (``GuardConfig.skip_spikes``): skips in a row may stop the run."""


def tells_every_step(scaled: bool, skip_spikes: bool) -> bool:
    """While a rank has joined, does every step end with the tell (``tell_joined``), not only a
    trip? Where a step the joined rank cannot judge may stop the run: a GradScaler's collapse (the
    joined rank holds no grad norm) and ``max_consecutive_skips`` reached by spike skips (it holds no
    loss history). Both sides read the same facts, the guard's configuration, so they make the same
    collectives: one small all-reduce a step, only while a rank has joined, only with a scaler or
    ``skip_spikes``."""
    return scaled or skip_spikes


def install(model: nn.Module, shadow: Shadow) -> None:
    """Make every ``Join`` built over ``model`` (a DDP model; ``ddp.join()`` included) run the
    guard's ``shadow`` after DDP's own on a joined rank. Nothing changes outside ``join()``."""
    if not isinstance(model, nn.parallel.DistributedDataParallel) or not dist.is_distributed():
        return
    # Join calls joinable.join_hook(**kwargs); a newer guard on the same model replaces the older
    # one's shadow rather than adding a second. The model is held weakly, as the shadow is: a hook
    # stored on the model that held it strongly (DDP's bound method) would make a reference cycle,
    # and the model, with the process group its reducer holds, would outlive the loop's last
    # reference until a garbage collection, perhaps into interpreter shutdown.
    ddp_hook = type(model).join_hook
    model_ref, ref = weakref.ref(model), weakref.ref(shadow)

    def join_hook(**kwargs: Any) -> JoinHook:
        ddp = model_ref()
        assert ddp is not None, "join_hook is called on the model that holds it"
        return _GuardedJoinHook(ddp_hook(ddp, **kwargs), ref)

    model.join_hook = join_hook  # type: ignore[method-assign]


def in_join(model: nn.Module) -> bool:
    """Is ``model`` a DDP model inside an enabled ``join()`` context?"""
    return isinstance(model, nn.parallel.DistributedDataParallel) and compat.ddp_join_enabled(model)


class _GuardedJoinHook(JoinHook):
    def __init__(self, inner: JoinHook, shadow: weakref.ref[Shadow]) -> None:
        self.inner = inner
        self.shadow = shadow

    def main_hook(self) -> None:
        guard = self.shadow()
        if guard is None or guard.disabled:
            self.inner.main_hook()
            return
        comm = guard.health.comm
        at = Layout(dist.world_size())

        def extras() -> torch.Tensor:
            return at.vector(rank=dist.rank(), code=float(HealthFlag.JOINED), step=None)  # no step: slot 0

        guard.health.comm.reset()
        if isinstance(comm, dist.DDPCommWatch):
            comm.shadowing = extras
        try:
            self.inner.main_hook()
        finally:
            if isinstance(comm, dist.DDPCommWatch):
                comm.shadowing = None
        _shadow_step(guard)

    def post_hook(self, is_last_joiner: bool) -> None:
        self.inner.post_hook(is_last_joiner)


def _shadow_step(guard: Shadow) -> None:
    """The joined rank's part of one guarded step of the others: the agreement, then a trip's collectives."""
    carried = guard.health.carried()
    if carried is not None and not bool((carried[Layout(dist.world_size()).steps] > 0).any()):
        carried = None  # the last bucket made room, but nobody rode in it: they agree separately
    zero = torch.zeros(())
    mine = DeviceHealth(grad_norm=zero, loss=zero, scale=torch.ones(()), flags=torch.tensor(int(HealthFlag.JOINED)))
    agreed = mine.agree(sharded=False, carried=carried, step=None)
    h = mine.read(guard.progress.step, agreed, scaled=False)
    if h.out_of_step:
        raise OutOfStepError(h.out_of_step)
    kind = h.trip_kind(scaled=guard.scaled)
    if kind not in ("params", "trip"):
        # A GradScaler overflow, a spike or a healthy step: judged by the stepping ranks alone (the
        # joined rank holds neither their grad norm nor their history); it learns whether they stopped.
        if tells_every_step(guard.scaled, guard.skip_spikes):
            raised, step = _tell(False, None)
            if raised:
                log.warning(
                    "nanguard: rank %d (joined): the ranks still stepping stopped at step %d", dist.rank(), step
                )
                raise NonFiniteError(
                    None, f"the ranks still stepping stopped the run at step {step} (this rank had joined)"
                )
        return
    diag = dist.gather_diagnosis(None, h.bad_ranks) if kind == "trip" else None
    if guard.tracker is not None:
        guard.tracker.everyone()  # the stepping ranks' trip gathers every rank's whereabouts once
    raised, step = _tell(False, None)
    if diag is not None:
        diag = guard.progress.diagnosis = replace(diag, step=step)
        log.warning("nanguard: rank %d (joined): step %d of the others: %s", dist.rank(), step, diag.summary())
    if raised:
        raise NonFiniteError(diag, f"{diag}\n(the ranks still stepping stopped)" if diag else None)


def _tell(raised: bool, step: int | None) -> tuple[bool, int]:
    """One all-reduce (max) of ``[raised, step]``: did any rank's policy stop the run, and the step
    of the stepping ranks (a joined rank sends ``[0, -1]``)."""
    vec = torch.tensor([int(raised), -1 if step is None else step], dtype=torch.int64)
    tdist.all_reduce(vec, op=tdist.ReduceOp.MAX)
    return bool(vec[0]), int(vec[1])


def tell_joined(raised: bool, step: int) -> None:
    """After the handling of a trip at ``step`` while a rank has joined: tell it whether the policy raised."""
    _tell(raised, step)
