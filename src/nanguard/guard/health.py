"""Step health: one rank's loss, gradients and parameters reduced to a few device scalars,
agreed across ranks in one collective, and read to the host once as a ``StepHealth``.

Each rank encodes what it found as ``HealthFlag`` bits. ``dist.agree`` gives every rank
every other rank's flags, so all ranks take the same decision. Under DDP's default hook,
``HealthCheck.riding`` makes the flags ride in the gradient all-reduce instead, so a healthy step
adds no collective at any world size: on 2 ranks with the loss in the last bucket's payload
(``DDPCommWatch._ride``; ``DeviceHealth.agree`` then only reads what rode); on 3 or more as a NaN a
flagging rank writes into its bucket (``DDPCommWatch._poison``), every rank's flags and the mean
loss then summed by one all-reduce on that step only (``DeviceHealth.read``). Under FSDP2, tensor
parallel and 2D whose closure clips, the flags ride in the norm the loop's ``clip_grad_norm_`` reduced
over every rank, a flagging rank's backward root multiplied by NaN (``HealthCheck.clip_rides``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import IntFlag
from typing import Any

import torch
from torch import nn

from nanguard import compat, dist
from nanguard.agreement import Layout, step_slot
from nanguard.dist import CommWatch
from nanguard.guard.history import UNAGREED
from nanguard.stats import float_groups, local, total_norm

__all__ = [
    "DeviceHealth",
    "Engine",
    "HealthCheck",
    "HealthFlag",
    "HostCopy",
    "StepHealth",
    "check_after_loads",
    "loop_grad_norm",
]


class HealthFlag(IntFlag):
    """What one rank found in its step (small ints: exact in the float32 agreement vector)."""

    OK = 0
    LOCAL = 1
    """This rank's own loss, or its own gradients before communication, are non-finite."""
    PARAMS = 2
    """The parameters are non-finite: after the previous update, or as the guard found them (built
    or loaded, ``HealthCheck.checked``)."""
    SYNCED = 4
    """The gradients it holds now (after any all-reduce) are non-finite."""
    WIRE = 8
    """Its own gradients were finite, but overflowed the comm hook's wire dtype (float16 compression)."""
    JOINED = 16
    """It ran out of inputs inside DDP's ``join()``: it takes no step and only shadows the others' collectives."""
    LOADED = 32
    """With PARAMS: the check covered the parameters as built or loaded, which no update of the guard wrote."""


_PARAMS, _LOCAL, _SYNCED = int(HealthFlag.PARAMS), int(HealthFlag.LOCAL), int(HealthFlag.SYNCED)


@dataclass(frozen=True)
class StepHealth:
    """What every rank agrees about one step, after the step's one host read.

    Example:
        >>> h = StepHealth(step=3, loss=2.0, grad_norm=float("nan"), scale=None, own_loss=2.0,
        ...                rank_flags=(HealthFlag.OK, HealthFlag.LOCAL))
        >>> h.ranks_with(HealthFlag.LOCAL)
        [1]
    """

    step: int
    loss: float
    """The loss averaged over ranks: decisions and history use it. ``history.UNAGREED`` (NaN) on a finite
    step whose flags reached the ranks in a reduction the loop makes (DDP's gradient all-reduce on 3 or more
    ranks, the loop's clip norm under FSDP2/TP, an engine's reduced norm): no collective agreed a mean loss,
    and each rank's own differs, so the history's rules go by the grad norm alone (the rule: ``guard/history.py``)."""
    grad_norm: float
    """The global gradient norm (over shards under FSDP2)."""
    scale: float | None
    """The GradScaler's scale, None without one."""
    own_loss: float
    """This rank's own loss: its event log keeps this rank's curve."""
    rank_flags: tuple[HealthFlag, ...]
    rank_steps: tuple[int, ...] = ()
    """Each rank's step slot (``agreement.step_slot``: its guard call index + 1, 0 when it takes no step)."""

    def ranks_with(self, flag: HealthFlag) -> list[int]:
        bit = int(flag)  # as ints: an IntFlag's & runs in Python, several times each step
        return [r for r, f in enumerate(self.rank_flags) if int(f) & bit]

    @property
    def joined(self) -> list[int]:
        """Ranks that ran out of inputs inside DDP's ``join()`` and only shadow this step."""
        return self.ranks_with(HealthFlag.JOINED)

    @property
    def out_of_step(self) -> dict[int, int]:
        """Each stepping rank's guard call index, when they differ (ranks out of step); else {}."""
        if not self.rank_steps:  # one process: no other rank to be out of step with
            return {}
        steps = {r: s - 1 for r, s in enumerate(self.rank_steps) if s > 0}
        return steps if len(set(steps.values())) > 1 else {}

    @property
    def bad_ranks(self) -> list[int]:
        """Ranks whose own loss or gradients were non-finite."""
        return self.ranks_with(HealthFlag.LOCAL)

    @property
    def synced_bad(self) -> bool:
        return bool(self.ranks_with(HealthFlag.SYNCED))

    def trip_kind(self, *, scaled: bool) -> str | None:
        """The branch the guard's decision takes, alike on every rank: ``"params"`` (the last update
        left non-finite parameters), ``"overflow"`` (a GradScaler overflow), ``"trip"`` (a non-finite
        step to replay), or None (finite: step, unless a spike says skip)."""
        seen = 0  # every rank's flags together: the flags asked for below are on some rank's
        for flags in self.rank_flags:
            seen |= int(flags)
        if seen & _PARAMS:
            return "params"
        if scaled and not math.isfinite(self.grad_norm) and not seen & _LOCAL:
            return "overflow"
        if seen & (_LOCAL | _SYNCED):
            return "trip"
        return None


@dataclass(frozen=True)
class DeviceHealth:
    """One rank's step as device scalars, before any host read."""

    grad_norm: torch.Tensor
    loss: torch.Tensor
    scale: torch.Tensor
    flags: torch.Tensor
    """int32 ``HealthFlag`` bits of this rank."""
    pending: torch.Tensor | None = None
    """This rank's own agreement vector when the step's flags reached the other ranks only by poisoning
    the gradient all-reduce (``HealthCheck.carried``): summed across ranks on a step that tripped only."""

    def agree(self, *, sharded: bool, carried: torch.Tensor | None = None, step: int | None = 0) -> torch.Tensor:
        """Every rank's flags, the mean loss, the global grad norm: from ``carried`` (what rode in
        the gradient all-reduce, from ``HealthCheck.carried``) when given, else by one collective.

        Riding, the grad norm is this rank's own: DDP leaves the same averaged gradients on
        every rank. Decisions use only what rode, so a rank-local change to its gradients after
        the all-reduce cannot split the ranks' decisions (its update shows in the next
        parameter check, which rides too).
        """
        if carried is None:
            return dist.agree(self.flags, self.loss, self.grad_norm * self.grad_norm, sharded=sharded, step=step)
        at = Layout(dist.world_size())
        agreed = carried.clone()
        agreed[at.loss] = carried[at.loss] / carried[at.norm].clamp_min(1)  # over the ranks whose loss was known
        agreed[at.norm] = self.grad_norm.float().to(carried.device)
        return agreed

    @staticmethod
    def found_inf(agreed: torch.Tensor) -> torch.Tensor:
        """A device float, nonzero when any rank flagged: what a fused optimizer skips on."""
        return (torch.remainder(agreed[Layout(dist.world_size()).codes], float(HealthFlag.JOINED)).amax() > 0).float()

    def read(self, step: int, agreed: torch.Tensor, *, scaled: bool) -> StepHealth:
        at = Layout(dist.world_size())
        extra = torch.stack([self.scale.float(), self.loss.float(), self.grad_norm.float()]).to(agreed.device)
        values: list[float] = torch.cat([agreed, extra]).tolist()  # the one host read of this step
        read = at.read(values)
        if self.pending is not None and any(c & HealthFlag.SYNCED for c in read.codes):
            # Poisoned: some rank flagged (alike on every rank). Who, and the mean loss: one all-reduce.
            gathered = self.agree(sharded=False, carried=_summed(self.pending, scaled=scaled))
            values = torch.cat([gathered, extra]).tolist()
            read = at.read(values)
        return StepHealth(
            step=step,
            loss=read.loss,
            # One process reads its own norm: the agreement squares it in float32, past 1.8e19 an overflow.
            grad_norm=read.norm if at.world > 1 else values[at.own_norm],
            scale=values[at.own_scale] if scaled else None,
            own_loss=values[at.own_loss],
            rank_flags=tuple(HealthFlag(c) for c in read.codes),
            rank_steps=read.steps if at.world > 1 else (),
        )


class HostCopy:
    """A step's health on its way to the host without a sync: one non-blocking copy into pinned
    memory and an event (on the CPU, the tensors themselves), read later with ``read``.

    Example:
        >>> copy = HostCopy(measured, agreed)   # step N: no host read
        >>> health = copy.read(step=N, scaled=False)   # step N+1: waits for step N's flags only
    """

    def __init__(self, measured: DeviceHealth, agreed: torch.Tensor) -> None:
        self.layout = Layout.for_size(agreed.numel())
        extra = torch.stack([measured.scale.float(), measured.loss.float(), measured.grad_norm.float()])
        packed = torch.cat([agreed, extra.to(agreed.device)])
        self.event: Any = None
        self.pending = measured.pending
        if packed.device.type == "cuda":
            self.values = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self.values.copy_(packed, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.values = packed

    def read(self, step: int, *, scaled: bool) -> StepHealth:
        if self.event is not None:
            self.event.synchronize()  # the copy only, not the work queued after it
        v, at = self.values, self.layout
        host = DeviceHealth(
            grad_norm=v[at.own_norm], loss=v[at.own_loss], scale=v[at.own_scale], flags=v[:0], pending=self.pending
        )
        return host.read(step, v[: at.size], scaled=scaled)


@dataclass(frozen=True)
class Engine:
    """What an engine that keeps the step's tensors itself (DeepSpeed ZeRO's partitions) or reduces the
    step's gradient norm itself tells the guard (``Guard.attach_engine``): where the gradients' norm and the
    updated weights are read, what a snapshot keeps and a rollback restores, and whether the norm the loop
    passes to ``check(grad_norm=)`` already stands for every rank.

    Example:
        >>> guard.attach_engine(Engine(grad_norm=partition_norm, params=masters, sharded=True, tensors=parts))
        >>> guard.attach_engine(Engine(reduces_norm=True))   # torchtitan: its clip reduced the norm over the mesh
    """

    grad_norm: Callable[[], torch.Tensor | None] | None = None
    """This rank's gradient norm as a device scalar (None: the parameters' ``.grad``)."""
    params: Sequence[torch.Tensor] | None = None
    """The weights the engine updates on this rank (its fp32 partitions), for the parameter check (None: the
    optimizer's)."""
    sharded: bool = False
    tensors: Callable[[], list[torch.Tensor]] | None = None
    """The engine's own tensors a snapshot keeps and a rollback restores."""
    holds_parameters: bool = False
    """The engine restores the parameters from ``tensors`` (the module's own are views of them)."""
    reduces_norm: bool = False
    """The ``grad_norm`` given to ``check`` is the engine's total norm, reduced over every rank: the same
    value on each, non-finite on each when any rank's gradients are (its loss and parameter check ride in
    too: ``Guard.carry_flags``). A step with a finite one is read from it alone, without a collective."""
    watch: CommWatch | None = None
    """What sees this rank's own gradients before the engine reduces them (None: nothing)."""


class HealthCheck:
    """Measures a rank's step on the device; checks parameters after an update, to be read
    with the next step so the check adds no host sync. The check sees parameters the next forward
    does not use (an embedding row no batch picked), which no loss or gradient would show; taken
    right after the update, it does not blame the update for what changed the parameters later.

    Example:
        >>> check = HealthCheck(params, scaler=None, comm=dist.CommWatch(), param_check_every=1)
        >>> health = check.on_device(loss)        # device scalars, no host read
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        *,
        scaler: Any,
        comm: CommWatch,
        param_check_every: int,
        check_loaded: bool = False,
        agree_loss: bool = False,
    ) -> None:
        self.params = list(params)
        self.agree_loss = agree_loss
        """The policy acts on the mean loss (``skip_spikes``): it is summed across ranks every step."""
        if isinstance(comm, dist.DDPCommWatch):
            comm.agree_loss = agree_loss
        # The parameters the guard was built with (or a state dict loaded later) are checked once,
        # with the first step: a NaN row no batch uses would otherwise pass as the first update's fault.
        self.watch_loads = check_loaded and param_check_every > 0
        self.unchecked = self.watch_loads
        self.checked: str | None = None
        """What the parameter check read with the latest step covered: "loaded" (the parameters as
        built or loaded, before any update of this guard), "update" (the last update), or None."""
        self._queued: str | None = None
        # Grouped by device and dtype once. DTensor shards are taken anew each step, and a
        # sparse gradient (found on the first step that has one) needs its values coalesced.
        self._groups: list[list[torch.Tensor]] | None = None
        self._placed = any(local(p) is not p for p in self.params)  # DTensor parameters (FSDP2, TP, 2D)
        if not self._placed:
            self._groups = float_groups(self.params)
        self.scaler = scaler
        self.comm = comm
        self.param_check_every = param_check_every
        self._param_norm: torch.Tensor | None = None
        self._flag_tables: dict[torch.device, tuple[dict[tuple[bool, bool], torch.Tensor], torch.Tensor]] = {}
        self._one: dict[torch.device, torch.Tensor] = {}
        self._ones_zeros: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.grad_source: Callable[[], torch.Tensor | None] | None = None
        """Where an engine keeps this rank's gradients (``read_engine``); None: the parameters' ``.grad``."""
        self.sharded = False
        """Each rank's gradients are its own partition: the squared norms add up across ranks."""
        self.reduces_norm = False
        """The loop's ``grad_norm`` is reduced over every rank by the engine (``Engine.reduces_norm``)."""
        self.pending: torch.Tensor | None = None
        """Set by ``carried`` when the step's flags poisoned the gradient all-reduce (``take_pending``)."""
        self._clip_norm: torch.Tensor | None = None
        self._clip_loss: Callable[[], torch.Tensor | None] | None = None
        self._clip_poisoned = False  # the clip's norm reduces an element a flagging rank made NaN
        self._param_ids: frozenset[int] | None = None

    def read_engine(
        self, grad_norm: Callable[[], torch.Tensor | None], params: Sequence[torch.Tensor], *, sharded: bool
    ) -> None:
        """Read the gradients where an engine keeps them (DeepSpeed ZeRO's partitions): ``grad_norm``
        gives this rank's gradient norm as a device scalar; ``params`` are the weights the engine
        updates on this rank (its fp32 partitions), for the parameter check.

        Example:
            >>> guard.health.read_engine(lambda: partition_norm(), master_partitions, sharded=True)
        """
        self.grad_source, self.sharded = grad_norm, sharded
        self.params, self._param_ids = list(params), None
        self._groups = float_groups(self.params)

    def carry(self, loss: torch.Tensor, checked: torch.Tensor | None = None) -> None:
        """Under ``reduces_norm`` (``Guard.carry_flags``): the gradient flowing into ``loss`` in its backward
        times NaN when this rank's ``checked`` loss (``loss``'s own value by default) or its queued parameter
        check is non-finite, else times 1.0 (the same bits). No host read."""
        if not self.reduces_norm or not loss.requires_grad:
            return
        if checked is None:
            local = compat.inner_tensor(loss)  # a DTensor loss: this rank's value
            checked = loss if local is None else local
        self.check_loaded()
        seed = _without_grad(self._seed, checked)
        assert seed is not None  # _seed always makes one
        loss.register_hook(lambda grad: compat.times_local(grad, seed))  # a DTensor grad: on this rank's values

    def _seed(self, checked: torch.Tensor) -> torch.Tensor:
        """``1 + 0 * checked (+ 0 * the queued parameter norm)``: exactly 1.0 when all are finite, NaN when any
        is not (``inf * 0`` is NaN), as a 0-dim float32 tensor (float64 for a float64 loss); two kernels, no host
        read."""
        one, zero = self._constants(checked.device)
        if checked.ndim:
            checked = (checked.float() * 0).sum()  # a sum of zeros, or NaN: never a finite sum that overflowed
        seed = torch.addcmul(one, checked, zero)
        if self._param_norm is not None:
            seed = torch.addcmul(seed, self._param_norm.to(seed.device), zero)
        return seed

    def _constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 0-dim 1 and 0 on ``device``, made once (never written to)."""
        pair = self._ones_zeros.get(device)
        if pair is None:
            pair = self._ones_zeros[device] = (torch.ones((), device=device), torch.zeros((), device=device))
        return pair

    def read_by_norm(self, loss: Any, norm: Any, step: int, call: int) -> StepHealth | None:
        """Under ``reduces_norm``: a step read from the engine's reduced norm and this rank's loss alone, in one
        host read and without measuring anything else. A finite norm speaks for every rank (each rank's loss and
        parameter check ride in it: ``carry``), so no rank flagged; None when the norm is non-finite (the queued
        parameter check left for ``on_device``: the ranks then agree on who flagged what) or in one process.

        Example:
            >>> health = check.read_by_norm(loss, engine_norm, step=7, call=7)   # None: agree instead
        """
        n = _own(norm) if isinstance(norm, torch.Tensor) else torch.as_tensor(norm)  # a DTensor: this rank's
        device = n.device
        own_loss = _own(loss) if isinstance(loss, torch.Tensor) else loss
        row = [_loss_scalar(n, device), _loss_scalar(own_loss, device)]
        if self.scaler is not None:
            row.append(compat.scaler_scale(self.scaler).to(device).float().reshape(()))
        values: list[float] = torch.stack(row).tolist()  # the one host read of this step
        group = compat.default_group()
        if not math.isfinite(values[0]) or group is None or group.size() < 2:
            return None  # one process reads its own norm (``DeviceHealth.read``)
        self._take_param_norm()  # covered: a non-finite one made the norm non-finite (``carry``)
        steps = [0] * group.size()
        steps[group.rank()] = int(step_slot(call))
        return StepHealth(
            step=step,
            loss=UNAGREED,  # no collective averaged it (as ``measure._from_norm``)
            grad_norm=values[0],
            scale=values[2] if self.scaler is not None else None,
            own_loss=values[1],
            rank_flags=(HealthFlag.OK,) * len(steps),
            rank_steps=tuple(steps),
        )

    def on_device(self, loss: Any, loop_norm: Any = None) -> DeviceHealth:
        """This rank's step as device scalars. ``loop_norm``: the norm the loop's clip computed before
        clipping, recorded as the step's grad norm; the flags still come from the gradients as they are."""
        gn = self._grad_norm()
        device = gn.device if gn is not None else _device_of(loss)
        gn = gn if gn is not None else torch.zeros((), device=device)
        pn = self._take_param_norm()
        pn = _own(pn.to(device)) if pn is not None else gn.new_zeros(())
        lv = _own(_loss_scalar(loss, device))  # a DTensor loss or norm: this rank's own value
        gn = _own(gn)
        # One isfinite over [loss, grad norm, parameter norm], and the flags looked up from its
        # three bits: few kernels on the step's path.
        bad = torch.isfinite(torch.stack([lv, gn, pn])).logical_not_()
        pre_comm = self.comm.local_flag(device)
        merge = pre_comm is None and not dist.is_distributed()
        table, bits = self._tables(device)
        flags = torch.take(table[(self.scaler is not None, merge)], (bad * bits).sum())  # a device index: no read
        if pre_comm is not None and self.scaler is None:
            flags = flags | pre_comm.to(torch.int32) * HealthFlag.LOCAL  # its own gradients, before DDP averaged them
        wire = self.comm.wire_flag(device)
        if wire is not None:
            flags = flags + wire.to(torch.int32) * HealthFlag.WIRE
        if self.checked == "loaded":
            flags = flags + bad[2].to(torch.int32) * HealthFlag.LOADED
        if self.scaler is not None:
            scale = compat.scaler_scale(self.scaler).to(device).float().reshape(())
        else:
            scale = self._one[device]
        norm = gn if loop_norm is None else _loss_scalar(loop_norm, device)
        return DeviceHealth(grad_norm=norm, loss=lv, scale=scale, flags=flags)

    @property
    def alone(self) -> bool:
        """Does this process decide alone (no other rank, no comm watch)? Then ``read_alone`` serves."""
        group = compat.default_group()  # ``dist.is_distributed()``, inline: asked each step
        return type(self.comm) is CommWatch and (group is None or group.size() < 2)

    def read_alone(self, loss: Any, step: int, loop_norm: Any = None) -> StepHealth:
        """The step of a process that decides alone, read at once: the loss, the two norms and the
        scale in one host read, the flags looked up on the host (``on_device`` makes them device
        tensors for the paths that must not read, at a dozen small kernels a step).

        Example:
            >>> health = check.read_alone(loss, step=7)   # when check.alone
        """
        gn = self._grad_norm()
        pn = self._take_param_norm()
        lv = _loss_scalar(loss, gn.device if gn is not None else _device_of(loss))
        scale = compat.scaler_scale(self.scaler) if self.scaler is not None else None
        clip = None if loop_norm is None else _loss_scalar(loop_norm, lv.device)
        own_loss, grad_norm, param_norm, scale_value, clip_norm = _host_floats([lv, gn, pn, scale, clip])
        assert own_loss is not None  # the loss is always read
        # One test of the three on the common step: their sum (float64, of float32 values) is finite exactly
        # when each is.
        finite = math.isfinite(own_loss + (grad_norm or 0.0) + (param_norm or 0.0))
        flags = 0 if finite else self._host_flags(own_loss, grad_norm, param_norm)
        return StepHealth(
            step=step,
            loss=own_loss or 0.0,
            grad_norm=(grad_norm if clip_norm is None else clip_norm) or 0.0,
            scale=scale_value,
            own_loss=own_loss or 0.0,
            rank_flags=(_FLAG_OF[flags],),
        )

    def _host_flags(self, own_loss: float, grad_norm: float | None, param_norm: float | None) -> int:
        """``read_alone``'s flags of a step whose values are not all finite, looked up on the host."""
        loss_bad = not math.isfinite(own_loss)
        grads_bad = grad_norm is not None and not math.isfinite(grad_norm)
        params_bad = param_norm is not None and not math.isfinite(param_norm)
        flags = _FLAGS[(self.scaler is not None, True)][loss_bad + 2 * grads_bad + 4 * params_bad]
        return flags | (HealthFlag.LOADED if params_bad and self.checked == "loaded" else 0)

    def _tables(self, device: torch.device) -> tuple[dict[tuple[bool, bool], torch.Tensor], torch.Tensor]:
        """The flags of each (loss bad, grads bad, params bad) pattern, indexed by their bits, on ``device``."""
        if device not in self._flag_tables:
            self._flag_tables[device] = (
                {key: torch.tensor(table, dtype=torch.int32, device=device) for key, table in _FLAGS.items()},
                torch.tensor([1, 2, 4], device=device),
            )
            self._one[device] = torch.ones((), device=device)
        return self._flag_tables[device]

    def after_update(self, step: int) -> None:
        """Queue a parameter check of the update of ``step`` (every ``param_check_every`` steps)."""
        every = self.param_check_every
        if every and step % every == 0:
            self._queue_param_norm("update")

    def check_loaded(self) -> None:
        """Before a step's forward: queue a check of the parameters as they are, once after the
        guard was built and after each ``load_state_dict`` into the model (``loaded``)."""
        if self.unchecked:
            self.unchecked = False
            self._queue_param_norm("loaded")

    def loaded(self) -> None:
        """A state dict was loaded into the model: check its parameters with the next step."""
        self.unchecked = self.watch_loads

    def _queue_param_norm(self, covers: str) -> None:
        groups = self._groups if self._groups is not None else float_groups(self.params)
        enabled = torch.is_grad_enabled()  # under no_grad's grad mode, as ``_without_grad``
        compat.set_grad_enabled(False)
        try:
            self._param_norm = total_norm(groups)  # non-finite exactly when a parameter is
        finally:
            compat.set_grad_enabled(enabled)
        self._queued = covers

    def _take_param_norm(self) -> torch.Tensor | None:
        """The queued parameter check, read with this step (``checked`` says what it covers)."""
        if self.unchecked:  # check() calls no hook before the forward: the parameters are still as loaded
            self.check_loaded()
        pn, self._param_norm = self._param_norm, None
        self.checked, self._queued = (self._queued if pn is not None else None), None
        return pn

    def _grad_norm(self) -> torch.Tensor | None:
        """This step's gradient norm over the parameters' precomputed groups; None without gradients.
        Under no_grad's grad mode, as ``_without_grad`` (the grad mode switched here: one call less a step)."""
        enabled = torch.is_grad_enabled()
        compat.set_grad_enabled(False)
        try:
            if self.grad_source is not None:
                return self.grad_source()
            if self._groups is not None:
                groups = []
                for ps in self._groups:
                    grads = [p.grad for p in ps if p.grad is not None]
                    if grads:
                        groups.append(grads)
                try:
                    return total_norm(groups) if groups else None
                except (RuntimeError, NotImplementedError):
                    self._groups = None  # a sparse gradient: the foreach kernels take dense tensors only
            return self._loose_grad_norm()
        finally:
            compat.set_grad_enabled(enabled)

    def _loose_grad_norm(self) -> torch.Tensor | None:
        """The gradient norm without the precomputed groups: DTensor shards, a sparse gradient."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if dist.is_distributed() and any(local(g) is not g for g in grads):
            return _placed_norm(grads)
        groups = float_groups(grads)
        return total_norm(groups) if groups else None

    @contextlib.contextmanager
    def riding(self, step: int = 0) -> Iterator[None]:
        """Around ``Guard.step``'s closure: the flags (and on 2 ranks the loss) ride in DDP's gradient
        all-reduce (``dist.DDPCommWatch``).

        The loss is the sum of the tensors ``backward`` was called on (micro-batches summed,
        divided by the GradScaler's scale, a power of two, so exactly), known before the last
        bucket is sent; the closure's return value stays this rank's own loss. Each rank sends
        ``[one-hot code slot x world, loss, 1 if its loss was known, one-hot step slot x world]``:
        LOCAL covers its own gradients before averaging and its loss's finiteness, PARAMS the last
        update; the step slot holds ``agreement.step_slot(step)`` (the layout: ``agreement.Layout``).
        """
        self.check_loaded()  # before the backward: the check's flag rides in its all-reduce
        if self.clip_rides:
            with self._watching_clips(None), dist.backward_roots(self._poisoned_root):
                yield
            return
        if not self.comm.rides:
            yield
            return
        with dist.backward_roots() as roots, self.comm.ride(lambda pre_comm: self._extras(pre_comm, roots, step)):
            yield

    @contextlib.contextmanager
    def riding_loop(self, step: int, loss: Callable[[], torch.Tensor | None]) -> Iterator[None]:
        """``riding`` for a loop that calls its own backward (``LoopGuard``), open from its step's first
        forward to the check; ``loss()`` is the loop's loss so far (None: unknown). In DDP's gradient
        all-reduce as under ``riding``; or in the loop's ``clip_grad_norm_`` over DTensor gradients, where
        a flagging rank makes one element the clip's norm reduces NaN before the norm is computed
        (``_before_clip``): its backward's root is the loop's to call, not the guard's.

        Example:
            >>> with check.riding_loop(guard.progress.calls, lambda: loss):
            ...     loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        """
        self.check_loaded()
        if self.clip_rides:
            with self._watching_clips(loss):
                yield
            return
        if not self.comm.rides:
            yield
            return

        def extras(pre_comm: torch.Tensor) -> torch.Tensor:
            value = loss()
            return self._extras(pre_comm, [] if value is None else [value], step)

        with self.comm.ride(extras):
            yield

    @contextlib.contextmanager
    def _watching_clips(self, loss: Callable[[], torch.Tensor | None] | None) -> Iterator[None]:
        """The clips watched: before each norm (``_before_clip``; ``loss``, the loop's), after (``_seen_clip``)."""
        self._clip_norm, self._clip_loss, self._clip_poisoned = None, loss, False
        stop = compat.watch_clips(self._seen_clip, before=self._before_clip)
        try:
            yield
        finally:
            stop()
            self._clip_loss = None

    @property
    def rides(self) -> bool:
        """Does ``riding`` carry the flags in a reduction the loop makes (DDP's gradient all-reduce, or
        the loop's own ``clip_grad_norm_`` over DTensor gradients)?"""
        return self.comm.rides or (self._placed and self.clip_rides)  # (no DTensor parameters: no call)

    @property
    def clip_rides(self) -> bool:
        """Can the flags ride in the loop's ``clip_grad_norm_`` (``_seen_clip``)? Under torch.distributed
        with DTensor parameters (FSDP2, tensor parallel, 2D), no DDP comm watch, no engine, and a policy
        that needs no mean loss. The same on every rank (the model and the configuration are)."""
        return (
            self._placed
            and self.grad_source is None
            and not self.agree_loss
            and type(self.comm) is CommWatch
            and dist.is_distributed()
        )

    def _poisoned_root(self, root: torch.Tensor) -> torch.Tensor:
        """The backward's root times 1.0, or times NaN when this rank's own signal is bad (the root
        non-finite, the queued parameter check non-finite): then every gradient this rank contributes
        is NaN, and so is the norm the loop's clip reduces over the mesh, on every rank. Healthy, the
        gradient flowing into the root is multiplied by 1.0: the same bits."""
        if compat.inner_tensor(root) is not None or not root.is_floating_point():
            return root  # a DTensor root: its own ops would have to redistribute a plain factor
        with torch.no_grad():
            bad = torch.isfinite(root).all().logical_not()
            if self._param_norm is not None:
                bad = bad | torch.isfinite(self._param_norm.to(root.device)).logical_not()
            factor = torch.where(bad, math.nan, 1.0).to(root.dtype)
        return root * factor

    def _before_clip(self, grads: list[torch.Tensor]) -> None:
        """Before a clip computes its total norm: when this rank's own signal is bad (the loop's loss, the
        queued parameter check, a gradient whose norm the clip does not reduce over every rank: a plain
        tensor, a DTensor on a smaller mesh), one element of a gradient sharded over every rank is made NaN,
        so the reduced norm is NaN on every rank; healthy, it is multiplied by 1.0 (the same bits). Without
        such a gradient the norm carries nothing (``_seen_clip`` then keeps none)."""
        target, unreduced, sharded = _by_reduction(grads)
        self._clip_poisoned = sharded
        if target is None:
            return  # (a rank holding no element of a sharded gradient: its flags stay its own)
        loss = self._clip_loss() if self._clip_loss is not None else None
        checks = [t.detach().float().reshape(-1)[:1] for t in (loss, self._param_norm) if t is not None]
        if unreduced:
            checks.append(total_norm(float_groups(unreduced)).float().reshape(1))
        if not checks:
            return
        with torch.no_grad():
            bad = torch.isfinite(torch.cat([c.to(target.device) for c in checks])).all().logical_not()
            target.view(-1)[:1].mul_(torch.where(bad, math.nan, 1.0).to(target.dtype))

    def _seen_clip(self, params: Any, norm: torch.Tensor) -> None:
        """Keep the norm a clip computed over every guarded parameter when every rank holds it whole
        (the loop reduced it) and a gradient it reduced over every rank could carry the flags
        (``_before_clip``); a clip of a part would miss a non-finite gradient elsewhere."""
        if self._param_ids is None:
            self._param_ids = frozenset(id(p) for p in self.params)
        poisoned, self._clip_poisoned = self._clip_poisoned, False
        if poisoned and self._param_ids <= {id(p) for p in params} and _whole_on_every_rank(norm, params):
            inner = compat.inner_tensor(norm)
            self._clip_norm = (inner if inner is not None else norm).detach()

    @property
    def clip_norm_held(self) -> bool:
        """Did the loop's clip reduce a norm the flags rode in during the step's closure (``take_clip_norm``)?"""
        return self._clip_norm is not None

    def take_clip_norm(self) -> torch.Tensor | None:
        """The global grad norm the loop's clip reduced during the step's closure (else None); once."""
        norm, self._clip_norm = self._clip_norm, None
        return norm

    def by_clip(self, measured: DeviceHealth, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The agreement of a step whose flags rode in the loop's clip norm (``measured.grad_norm``):
        what every rank knows alike, no collective (as ``_poisoned``), and this rank's own vector,
        summed only on a step whose clip norm is non-finite."""
        at = Layout(dist.world_size())
        device = measured.grad_norm.device
        own = at.vector(
            rank=dist.rank(),
            code=measured.flags.to(device),
            loss=measured.loss.to(device),
            norm=1.0,
            step=step,
            device=device,
        )
        bad = torch.isfinite(measured.grad_norm.float()).logical_not().float().reshape(1)
        agreed = self._poisoned(torch.cat([own, bad]), at)
        pending = self.take_pending()
        assert pending is not None
        return agreed, pending

    def carried(self) -> torch.Tensor | None:
        """What rode in this step's gradient all-reduce as ``[code x world, loss sum, ranks with a
        known loss, step slot x world]``, SYNCED set on every rank's code when an averaged bucket was non-finite
        (without a GradScaler, whose business overflowing gradients are); None when nothing rode."""
        raw = self.comm.carried()
        self.pending = None
        if raw is None:
            return None
        at = Layout(dist.world_size())
        if not self.comm.summed:
            return self._poisoned(raw, at)
        codes = raw[at.codes].to(torch.int32)
        if self.scaler is None:
            codes = codes | (raw[-1] > 0).to(torch.int32) * HealthFlag.SYNCED
        return torch.cat([codes.float(), raw[at.loss : at.size]])  # raw[-1]: the bucket's own flag

    def _poisoned(self, raw: torch.Tensor, at: Layout) -> torch.Tensor:
        """The agreement of a step whose flags poisoned the gradient all-reduce (``DDPCommWatch._poison``):
        what every rank knows alike without a collective. SYNCED on every rank's code when an averaged
        bucket was non-finite (some rank flagged, or the values went bad on the wire): the host read then
        sums this rank's own vector (``pending``) with the others' (``DeviceHealth.read``). No mean loss:
        NaN, which the history's rules leave out; every step slot this rank's own."""
        self.pending = raw[: at.size]
        bad = raw[-1] > 0
        vec = at.zeros(raw.device)
        vec[at.codes] = bad.float() * float(HealthFlag.SYNCED)
        vec[at.loss] = UNAGREED
        vec[at.norm] = 1.0
        vec[at.steps] = raw[at.step(dist.rank())]
        return vec

    def take_pending(self) -> torch.Tensor | None:
        """This rank's own agreement vector of the step just carried by poisoning (else None); once."""
        pending, self.pending = self.pending, None
        return pending

    def _extras(self, pre_comm: torch.Tensor, roots: list[torch.Tensor], step: int) -> torch.Tensor:
        device = pre_comm.device
        known = bool(roots)
        loss = sum((r.detach().float().mean().to(device) for r in roots), torch.zeros((), device=device))
        if self.scaler is not None:
            loss = loss / compat.scaler_scale(self.scaler).to(device).float().reshape(())
        loss_bad = ~torch.isfinite(loss)
        local = loss_bad if self.scaler is not None else loss_bad | pre_comm  # as on_device() decides
        code = local.to(torch.int32) * HealthFlag.LOCAL
        if self._param_norm is not None:
            params = HealthFlag.PARAMS + (HealthFlag.LOADED if self._queued == "loaded" else 0)
            code = code + (~torch.isfinite(self._param_norm.to(device))).to(torch.int32) * params
        return Layout(dist.world_size()).vector(
            rank=dist.rank(), code=code, loss=loss, norm=float(known), step=step, device=device
        )

    def forget_update(self) -> None:
        """Drop a queued parameter check: the parameters it covered were restored (from the guard's
        own snapshot or a finite replica, so the load that restored them needs no check either)."""
        self._param_norm, self._queued = None, None
        self.unchecked = False


def _whole_on_every_rank(norm: torch.Tensor, params: Any) -> bool:
    """Does every rank hold ``norm`` whole: a DTensor replicated over a mesh of every rank, or a plain
    tensor the loop made whole from DTensor gradients on such a mesh (torchtitan's ``full_tensor``)?"""
    world = dist.world_size()
    placements = getattr(norm, "placements", None)
    if placements is not None:
        mesh = norm.device_mesh  # type: ignore[attr-defined]  # a DTensor
        return mesh.size() == world and all(p.is_replicate() for p in placements)
    for p in params:
        grad = getattr(p, "grad", None)
        if grad is not None and getattr(grad, "placements", None) is not None:
            return bool(grad.device_mesh.size() == world)
    return False


def _by_reduction(grads: list[torch.Tensor]) -> tuple[torch.Tensor | None, list[torch.Tensor], bool]:
    """How a clip's total norm reduces ``grads``: the local part of the first gradient sharded on every
    dimension of a mesh of the whole world that holds an element here (the poisoned one), the local parts of
    those whose norm stays this rank's own (a plain tensor, a DTensor on a smaller mesh; a DTensor replicated
    on a mesh of the whole world has its norm reduced over it, every rank's copy in it), and whether such a
    sharded gradient exists (the same on every rank: placements are)."""
    world = dist.world_size()
    target, unreduced, sharded = None, [], False
    for g in grads:
        placements = getattr(g, "placements", None)
        reach = None if placements is None else _reach(g.device_mesh, placements, world)  # type: ignore[attr-defined]
        if reach is None:
            unreduced.append(local(g))
        elif reach:
            sharded = True
            if target is None and local(g).numel():
                target = local(g)
    return target, unreduced, sharded


_REACH: dict[Any, bool | None] = {}


def _reach(mesh: Any, placements: Any, world: int) -> bool | None:
    """A DTensor gradient's norm: reduced over every rank (True: sharded on every dimension, so one element
    carries a flag; False: replicated somewhere), or not over every rank (None: a smaller mesh)."""
    key = (mesh, placements, world)
    if key not in _REACH:  # a strided shard (FSDP2 over tensor parallel) is no is_shard(), but a shard
        shards = all(p.is_shard() or type(p).__name__ == "_StridedShard" for p in placements)
        _REACH[key] = None if mesh.size() != world else shards
    return _REACH[key]


def _summed(pending: torch.Tensor, *, scaled: bool) -> torch.Tensor:
    """Every rank's own agreement vector summed (one all-reduce, on a poisoned step only), as it
    would have ridden in the payload: SYNCED on every code without a GradScaler (an averaged bucket
    was non-finite; with one, overflowing gradients are the scaler's business)."""
    summed = dist.sum_across(pending.clone())
    at = Layout(dist.world_size())
    if not scaled:
        summed[at.codes] = (summed[at.codes].to(torch.int32) | HealthFlag.SYNCED).float()
    return summed


def check_after_loads(model: nn.Module, check: HealthCheck) -> Any:
    """After each ``model.load_state_dict`` (the wrapper's or the inner module's), check the
    loaded parameters with the next step; returns the hook's handle.

    Example:
        >>> handle = check_after_loads(model, guard.health)
        >>> model.load_state_dict(torch.load("ckpt.pt"))   # checked with the next step
    """

    def hook(module: nn.Module, incompatible_keys: Any) -> None:
        check.loaded()

    return dist.unwrap(model).register_load_state_dict_post_hook(hook)


_TABLE_KEYS = [(scaled, merge) for scaled in (False, True) for merge in (False, True)]


def _flag_table(scaled: bool, merge: bool) -> list[int]:
    """Flags by ``loss_bad + 2 * grads_bad + 4 * params_bad``. With a GradScaler, overflowing
    gradients are the scaler's business: only a bad loss is a trip. ``merge``: a single process
    without a comm watch counts its (own) gradients as local."""
    table = []
    for index in range(8):
        loss_bad, grads_bad, params_bad = index & 1, index >> 1 & 1, index >> 2 & 1
        local = loss_bad | (grads_bad if merge else 0)
        flags = HealthFlag.LOCAL * loss_bad if scaled else HealthFlag.LOCAL * local + HealthFlag.SYNCED * grads_bad
        table.append(int(flags + HealthFlag.PARAMS * params_bad))
    return table


_FLAGS = {key: _flag_table(*key) for key in _TABLE_KEYS}
_FLAG_OF = tuple(HealthFlag(bits) for bits in range(2 * HealthFlag.LOADED))  # looked up: no enum call a step


def _placed_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """This rank's share of the global gradient norm of DTensor gradients (tensor parallel, FSDP2, 2D
    meshes), such that the squares summed over all ranks (``dist.agree``) are the global norm's square.

    Each rank holds its local shard; a shard on a ``Replicate`` mesh dimension is held alike by each
    rank along it, so its square is counted once by weighting it with 1 / (ranks holding that
    copy). Every rank runs the same model (SPMD): a DTensor on a sub-mesh (a head sharded over the
    dp dimension of a dp x tp mesh) is held alike by each of the ``world / mesh size`` sub-meshes,
    and a plain tensor among DTensors by every rank. A ``Partial`` gradient counts as replicated.
    """
    by_copies: dict[int, list[torch.Tensor]] = {}
    world = dist.world_size()
    for g in grads:
        placements = getattr(g, "placements", None)
        if placements is None:
            copies = _copies(g)
        else:
            key = (g.device_mesh, placements, world)  # type: ignore[attr-defined]
            copies = _COPIES.get(key) or _COPIES.setdefault(key, _copies(g))
        by_copies.setdefault(copies, []).append(g)
    parts = []
    for copies, tensors in by_copies.items():
        norm = total_norm(float_groups(tensors))
        parts.append(norm * norm / copies if copies > 1 else norm * norm)
    device = parts[0].device
    return torch.stack([p.to(device) for p in parts]).sum().sqrt()


# ``_copies`` by (mesh, placements): a step's gradients repeat the same few layouts, and reading a
# mesh's sizes in Python each step cost more than the norm under tensor parallelism.
_COPIES: dict[Any, int] = {}


def _copies(t: torch.Tensor) -> int:
    """How many ranks hold the same values as this rank's local part of ``t``."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return dist.world_size()
    mesh = t.device_mesh  # type: ignore[attr-defined]  # a DTensor
    copies = max(1, dist.world_size() // mesh.size())
    for dim, placement in enumerate(placements):
        if placement.is_replicate() or placement.is_partial():  # (a strided shard is no is_shard())
            copies *= mesh.size(dim)
    return copies


def _loss_scalar(loss: Any, device: torch.device) -> torch.Tensor:
    """The loss as a float32 scalar on ``device`` (its first element; 0 for None)."""
    if type(loss) is torch.Tensor or isinstance(loss, torch.Tensor):  # (a plain tensor: no call)
        t = loss.detach() if loss.requires_grad else loss
        t = t.reshape(-1)[0] if t.ndim else t
        return t if t.device == device and t.dtype == torch.float32 else _to32(t, device)
    return torch.tensor(float(loss) if loss is not None else 0.0, device=device)


def _host_floats(tensors: list[torch.Tensor | None]) -> list[float | None]:
    """Scalars read to the host as float32 values in one read (None stays None). The first tensor is
    never None; it stands in for the missing ones in the stack (no kernel: each step reads this)."""
    first = tensors[0]
    assert first is not None
    device = first.device
    for t in tensors:  # the first one off the CPU, if any, is where the row is read (loops: no call a step)
        if t is not None and t.device.type != "cpu":
            device = t.device
            break
    row: list[Any] = list(tensors)
    for i, t in enumerate(tensors):
        if t is None:
            row[i] = first  # a stand-in (no kernel)
        elif t.device != device or t.dtype != torch.float32 or t.ndim:
            row[i] = _to32(t, device)
    read: list[float | None] = torch.stack(row).tolist()
    for i, t in enumerate(tensors):
        if t is None:
            read[i] = None
    return read


def _to32(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` as a float32 scalar on ``device`` (the callers pass one that is not one already: no
    kernel on the step's path)."""
    return t.to(device, torch.float32).reshape(())


def _own(t: torch.Tensor) -> torch.Tensor:
    """This rank's own value of a DTensor scalar (its local tensor), else ``t``."""
    inner = compat.inner_tensor(t)
    return inner if inner is not None else t


def _without_grad(fn: Callable[..., torch.Tensor | None], *args: Any) -> torch.Tensor | None:
    """``fn(*args)`` under ``torch.no_grad()``'s grad mode, at two calls where the context manager
    makes a dozen (the guard's two reads run it every step)."""
    enabled = torch.is_grad_enabled()
    compat.set_grad_enabled(False)
    try:
        return fn(*args)
    finally:
        compat.set_grad_enabled(enabled)


def _device_of(loss: Any) -> torch.device:
    return loss.device if isinstance(loss, torch.Tensor) else torch.device("cpu")


def loop_grad_norm(params: Sequence[torch.Tensor], clip: float | None) -> torch.Tensor:
    """What a loop without nanguard computes: ``clip_grad_norm_(params, clip)`` (the clip, and its
    total norm), or with no clip the same norm unclipped; left on the device (no host read). A
    DTensor norm is made whole here, on every rank alike: a later read on one rank communicates nothing."""
    if clip is not None:
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    full = compat.full_tensor(norm)
    return full if full is not None else norm
