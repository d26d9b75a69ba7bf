"""The guard's parts, built from its options and wired into the step's stages: ``GuardParts``, the
base of ``Guard`` (``guard/core.py``), which adds the step. Every part is built here and handed only
the parts it works with (``Runner``, ``Measure``, ``Apply``, the DDP ``join()`` shadow), never the guard.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from nanguard import compat, dist, environ
from nanguard.events import new_run_id
from nanguard.guard.apply import Apply
from nanguard.guard.arguments import listener
from nanguard.guard.attempt import Attempt, Runner
from nanguard.guard.config import GuardConfig
from nanguard.guard.deferred import Waiting, deferred_mode
from nanguard.guard.diagnoser import Diagnoser
from nanguard.guard.disabled import Disabled
from nanguard.guard.health import HealthCheck, StepHealth, check_after_loads
from nanguard.guard.history import History
from nanguard.guard.join import Shadow, install
from nanguard.guard.measure import Measure
from nanguard.guard.policy import Policy
from nanguard.guard.precursors import PrecursorCheck
from nanguard.guard.progress import PolicyView, Progress
from nanguard.guard.recorder import recorder_for
from nanguard.guard.recovery import Recovery
from nanguard.guard.remedies import Remedies
from nanguard.guard.resume import Resume
from nanguard.hardware import Tracker, where
from nanguard.inject import Fault, injector_for
from nanguard.stats import local

__all__ = ["GuardParts"]


class GuardParts:
    """The parts of a guard and the stages they are wired into; ``Guard`` sets the options first.

    Example:
        >>> guard = ng.Guard(model, optimizer)   # a GuardParts: guard.health, guard.recovery, guard.measure...
        >>> guard.measure.health is guard.health
        True
    """

    config: GuardConfig
    disabled: bool
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any

    def _build(
        self,
        run_dir: str | os.PathLike[str] | None,
        comm_hook: tuple[Any, Callable[..., Any]] | None,
        on_event: Callable[[dict[str, Any]], None] | None,
        inject: str | list[Fault] | None,
    ) -> None:
        c, model, optimizer, scheduler = self.config, self.model, self.optimizer, self.scheduler
        self.rank, self.progress = dist.rank(), Progress()
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        self.health = HealthCheck(
            self._params,
            scaler=self.scaler,
            comm=dist.watch_communication(model, comm_hook),
            param_check_every=c.param_check_every,
            check_loaded=True,
            agree_loss=c.skip_spikes,
        )
        self._load_hook = check_after_loads(model, self.health)  # a later load_state_dict is checked too
        self.recovery = Recovery(model, optimizer, scaler=self.scaler, config=c, scheduler=scheduler)
        self.history = History.from_config(c)
        self.diagnoser = Diagnoser(
            model, optimizer, self.history, locate=c.locate, module_stats=c.module_stats, comm=self.health.comm
        )
        self.diagnoser.prove = c.prove
        # One id for this run on every rank, in every event: runs that reuse a run_dir stay apart.
        self.run_id = dist.rank_zeros(new_run_id) if run_dir is not None else None
        self.recorder = recorder_for(
            run_dir,
            rank=self.rank,
            max_bundle_bytes=c.max_bundle_bytes,
            model=model,
            bundle_weights=c.bundle_weights,
            run=self.run_id,
        )
        self.recorder.listener = listener(on_event, self.disabled)
        inject = None if self.disabled else environ.inject(inject)
        self.injector = injector_for(inject, model, write=self.recorder.drill, steps=self.progress)
        here = where(self._params[0].device if self._params else None)
        self.tracker = Tracker(run_dir, here=here, warn_after=c.hardware_warn_after, run=self.run_id)
        self._drilling = bool(self.injector.faults)  # a fire drill planted faults (none: its calls are skipped)
        self._spikes_before = 0  # the spikes seen before a drilled step
        self.policy = Policy(c)
        self._remedies = Remedies(model, optimizer, c, self.recorder, run_dir, scheduler=scheduler)
        self._state = PolicyView(self.recovery, self._remedies, self.progress)
        every = 0 if self.disabled else c.precursor_every  # sampled in the step, read without a sync
        self.precursors = PrecursorCheck(model, optimizer, c, self.progress, self.recorder, self._remedies, every=every)
        self._remedies.headroom.emit = self.precursors.watch_headroom(self._remedies.headroom.emit)
        self._choose_paths()
        self._wire()
        self._pending: tuple[Attempt, StepHealth] | None = None  # a checked step whose update is to be recorded
        self._waiting: Waiting | None = None  # deferred: the last step, its verdict not read yet
        self.recorder.start(asdict(c), dist.world_size(), "device" if self._fused else "host")
        if self.policy.takes_snapshots:
            self.recovery.take_snapshot(self.progress.step)
        self._shadow = Shadow(
            self.health, self.progress, self.scaler is not None, self.tracker, self.disabled, c.skip_spikes
        )
        install(model, self._shadow)  # DDP join(): a rank out of batches shadows the guard's collectives

    def _choose_paths(self) -> None:
        """The paths every step takes, fixed by the parts the guard was built with."""
        c = self.config
        # Only the GPUs this model lives on draw random numbers for its step.
        self._cuda_devices = sorted({p.device.index or 0 for p in self._params if p.device.type == "cuda"})
        self._fused = compat.supports_found_inf(self.optimizer)
        self._sharded = any(local(p) is not p for p in self._params)  # FSDP2: each rank holds a shard
        # The fused optimizer skips a bad update on the device; a spike verdict (after the host
        # read) and a clip (before the step) need the host path.
        self._device_step = self._fused and self.scaler is None and not c.skip_spikes and c.clip_grad_norm is None
        self._deferred = deferred_mode(c, self.optimizer, self.scaler, self._fused, self._cuda_devices)
        # The buffers saved before each forward (BatchNorm's running statistics): a model without any saves none.
        self._buffers = self.recovery.buffers if self.recovery.buffers.buffers else None

    def _wire(self) -> None:
        """The step's stages, each over the parts it works with."""
        self.runner = Runner(
            self.model,
            self.optimizer,
            self.scaler,
            self.health,
            self._remedies.headroom,
            self.recovery,
            locate=self.config.locate,
            device=self._params[0].device if self._params else None,
        )
        self.measure = Measure(
            model=self.model,
            optimizer=self.optimizer,
            scaler=self.scaler,
            config=self.config,
            health=self.health,
            history=self.history,
            diagnoser=self.diagnoser,
            recovery=self.recovery,
            remedies=self._remedies,
            policy=self.policy,
            sharded=self._sharded,
        )
        self.apply = Apply(
            model=self.model,
            optimizer=self.optimizer,
            scaler=self.scaler,
            config=self.config,
            params=self._params,
            health=self.health,
            history=self.history,
            recovery=self.recovery,
            remedies=self._remedies,
            recorder=self.recorder,
            injector=self.injector,
            tracker=self.tracker,
            progress=self.progress,
        )
        self._plain = Disabled(self.optimizer, self.scaler, self.progress, self.apply)
        self._resume = Resume(self.config, self.progress, self.recovery, self.history, self._remedies, self.policy)
