"""OLMo-core: guard its ``Trainer`` with one callback, DDP and FSDP, with or without ``SkipStepAdamW``.

OLMo-core's ``Trainer`` runs ``train_module.train_batch(batch)`` (each micro-batch's forward with
its own loss, and backward), then the callbacks' ``pre_optim_step``, then
``train_module.optim_step()`` (the clip, the LR, ``optim.step()``). Where OLMo-core clips over every
rank's gradients (DDP, FSDP over the whole world), ``NanGuardCallback`` checks the step at
``optim.step()``, after the clip, and reads it from the clip's norm, which each micro-batch's loss
carries its rank's flags into (``Guard.carry_flags``): no collective of the guard's on a healthy
step. Otherwise it checks at ``pre_optim_step`` (the gradients reduced, under FSDP each rank reading
its own shards), every rank agreeing in one small all-reduce. On a skip the gradients are dropped, so
OLMo-core's optimizer step changes nothing (``SkipStepAdamW`` too: it skips parameters without a
gradient), the step's loss and grad norm are taken out of the trainer's metrics (its "nan loss" check
would end the run a step late) and out of ``SkipStepOptimizer``'s rolling window (one NaN there makes
it skip every step after).

The micro-batches are recorded by hooks on the train module's model: their inputs, the loss
arguments the train module passes (``labels``, ``loss_div_factor``, ...), the RNG state and the
autocast. A trip is replayed on every rank with its gradient communication off, each micro-batch
through the model's own loss, and named with OLMo-core's module names, the micro-batch and the rank.

Example:
    >>> from nanguard.integrations.olmo_core import NanGuardCallback
    >>> trainer_config = trainer_config.with_callback("nanguard", NanGuardCallback(policy="skip"))
    >>> trainer = trainer_config.build(train_module, data_loader)
    >>> trainer.fit()
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanguard import compat, dist
from nanguard.findings import Diagnosis
from nanguard.guard import Guard
from nanguard.guard.health import Engine
from nanguard.integrations import GuardedCallback, guard_options, require
from nanguard.integrations.clipnorm import sums_every_rank
from nanguard.integrations.loop import LoopGuard, _loss_of

_callback: Any = require("olmo_core.train.callbacks.callback", "engines", "ai2-olmo-core")
_skip_step: Any = require("olmo_core.optim.skip_step_optimizer", "engines", "ai2-olmo-core")
_common: Any = require("olmo_core.train.common", "engines", "ai2-olmo-core")

__all__ = ["NanGuardCallback"]

log = logging.getLogger("nanguard")

_STEP_METRICS = (_common.TRAIN_CE_LOSS_METRIC, _common.TRAIN_Z_LOSS_METRIC, "train/Z loss unscaled")
"""What a skipped step's ``train_batch`` recorded about its loss: left out of the logs."""
_OPTIM_METRICS = (_common.OPTIM_GRAD_NORM_METRIC,)
"""What its ``optim_step`` recorded about gradients it did not apply."""


class NanGuardCallback(GuardedCallback, _callback.Callback):
    """An OLMo-core ``Trainer`` callback that checks each optimizer step for NaN/Inf, diagnoses a
    trip, and skips, rolls back or raises, every rank agreeing.

    ``policy`` and ``**options`` are those of ``ng.Guard`` (see ``GuardConfig``); ``run_dir``
    (default ``<trainer.save_folder>/nanguard``) receives each rank's event log and a bundle per
    trip. ``check_batch=True`` checks each micro-batch before its forward: a token id past the
    vocabulary on one rank is named there (``data.index_out_of_range``) and the step skipped on
    every rank, instead of an ``IndexError`` on that rank while its peers wait. The trainer's
    metrics get ``nanguard/skipped`` and ``nanguard/trips`` with the first step and when they
    change; ``step_skipped`` says whether the latest step was skipped. The guard's counters are
    saved with the trainer's state.

    Example:
        >>> callback = NanGuardCallback(policy="skip", check_batch=True)
        >>> trainer = trainer_config.with_callback("nanguard", callback).build(train_module, data_loader)
        >>> trainer.fit()
        >>> callback.skipped, callback.last_diagnosis
    """

    priority = 100
    """Before other callbacks' ``pre_optim_step``: where the check is made there, a callback that reads the
    gradients sees a skipped step's dropped (where it is made at ``optim.step()``, its gradients as they were)."""

    def __init__(self, policy: str = "skip", *, run_dir: str | Path | None = None, **options: Any) -> None:
        guard_options(policy, options)
        self.policy = policy
        self.run_dir = str(run_dir) if run_dir is not None else None
        self.options = options
        self.loop: TrainModuleGuard | None = None
        self._state: dict[str, Any] = {}  # loaded with a checkpoint before the guard exists
        self._window_before: tuple[Any, Any] | None = None
        self._skipped_now = False
        self._logged: tuple[float, float] | None = None  # the guard's metrics as last recorded

    @property
    def guard(self) -> Guard | None:  # type: ignore[override]
        return self.loop.guard if self.loop is not None else None

    @property
    def step_skipped(self) -> bool:
        """Whether the latest step was skipped (a trip under ``skip`` or ``rollback``, a rejected batch)."""
        loop = self.loop
        if loop is not None and loop.rides_norm and loop.verdict is not None:
            return not loop.verdict  # checked in optim_step: known before this callback's post_train_batch
        return self._skipped_now

    @property
    def trips(self) -> int:
        return self.loop.trips if self.loop is not None else 0

    # -- the trainer's moments -----------------------------------------------------------------
    def pre_train(self) -> None:
        trainer = self.trainer
        if self.loop is not None:
            self.loop.close()
        run_dir = self.run_dir or str(Path(str(trainer.save_folder), "nanguard"))
        self.loop = TrainModuleGuard(trainer.train_module, self.policy, run_dir=run_dir, **self.options)
        if self._state and self.loop.guard is not None:
            self.loop.guard.load_state_dict(self._state)
        self._logged = None

    def pre_step(self, batch: dict[str, Any]) -> None:
        if self.loop is not None:
            self.loop.begin()  # the dry run's forward, or a step OLMo-core skipped, is no micro-batch of this one
            self._window_before = _latest(self.loop.optimizer)
            self._skipped_now = False

    def pre_optim_step(self) -> None:
        loop = self.loop
        if loop is not None and not loop.rides_norm:  # else checked in optim_step, after OLMo-core's clip
            self._checked(loop.check())

    def post_train_batch(self) -> None:
        loop = self.loop
        if loop is None:
            return
        if loop.rides_norm and loop.verdict is not None:
            self._checked(loop.verdict)
        if self._skipped_now:
            compat.olmo_drop_metrics(self.trainer, _OPTIM_METRICS)
            _forget(loop.optimizer, self._window_before, losses=False)  # the norm of gradients it did not apply

    def _checked(self, ok: bool) -> None:
        """The step's verdict: a skipped step's loss out of the logs and of ``SkipStepOptimizer``'s window;
        the guard's two metrics recorded when they change (and with the first step), so OLMo-core, which
        reads each metric without a reduce type on the host, reads them on no healthy step."""
        loop = self.loop
        assert loop is not None
        self._skipped_now = not ok
        if not ok:
            compat.olmo_drop_metrics(self.trainer, _STEP_METRICS)
            _forget(loop.optimizer, self._window_before, losses=True)
        counts = (float(self.skipped), float(loop.trips))
        if counts != self._logged:
            self._logged = counts
            self.trainer.record_metric("nanguard/skipped", counts[0], namespace=None)
            self.trainer.record_metric("nanguard/trips", counts[1], namespace=None)

    def close(self) -> None:
        if self.loop is not None:
            self._state = self.loop.state_dict()
            self.loop.close()

    def state_dict(self) -> dict[str, Any]:
        return self.loop.state_dict() if self.loop is not None and self.loop.guard is not None else dict(self._state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._state = dict(state_dict)
        if self._state and self.loop is not None and self.loop.guard is not None:
            self.loop.guard.load_state_dict(self._state)

    @property
    def last_diagnosis(self) -> Diagnosis | None:
        return self.guard.last_diagnosis if self.guard is not None else None


class TrainModuleGuard(LoopGuard):
    """``LoopGuard`` over an OLMo-core ``TransformerTrainModule``: its model's training forwards are
    recorded (each returns its micro-batch's share of the step's loss, so the step's loss is their
    sum), and ``check`` decides the step before ``optim_step``.

    Example:
        >>> loop = TrainModuleGuard(trainer.train_module, "skip")
        >>> loop.begin(); trainer.train_module.train_batch(batch)
        >>> loop.check()
        True
    """

    _rides = False  # OLMo-core's clip norm carries the flags where it can (attach_engine)

    def __init__(self, train_module: Any, policy: str = "skip", *, run_dir: str | Path | None = None, **options: Any):
        model, optimizer = getattr(train_module, "model", None), getattr(train_module, "optim", None)
        if not isinstance(model, torch.nn.Module) or not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                "train_module must be an OLMo-core train module with a model and an optimizer "
                f"(a TransformerTrainModule not built eval_only), got {type(train_module).__name__}"
            )
        guard_options(policy, options)
        self.train_module = train_module
        guard = Guard(model, optimizer, policy, run_dir=run_dir, **options)
        self._watch(model, optimizer, guard, scheduler=None, mean=False, user=model)
        self.verdict: bool | None = None
        """The step's verdict once checked (True: stepped), None before."""
        # OLMo-core's clip (``optim_step``, at max_grad_norm) reduces the total norm over every rank: where it sums
        # every rank's own gradients (DDP, FSDP over the whole world) the step is checked after it, at the
        # optimizer's step, and a healthy step is read from that norm; each micro-batch's loss carries its rank's
        # flags into its backward (carry_flags), so a NaN loss with finite gradients reaches it too.
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.rides_norm = bool(
            dist.is_distributed() and getattr(train_module, "max_grad_norm", None) and sums_every_rank(params)
        )
        """Checked at the optimizer's step, after OLMo-core's clip, and read from its norm (not at pre_optim_step)."""
        if self.rides_norm:
            guard.attach_engine(Engine(reduces_norm=True))

    def begin(self) -> None:
        """A step starts: forget forwards recorded since the last check (the trainer's dry run)."""
        self._capture.take()
        self._verdict = None
        self.verdict = None

    def check(self) -> bool:
        """This step's verdict (True: let OLMo-core step), decided once; the optimizer's step asks again."""
        return self._decide()

    def _decide(self) -> bool:
        self.verdict = super()._decide()
        return self.verdict

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        recorded = bool(self._capture.micro) and self._capture.micro[-1].loss is None
        super()._after_forward(module, args, kwargs, output)
        if not self.rides_norm or not recorded or self._capture.replaying or self.guard is None:
            return
        loss = _loss_of(output)
        if loss is not None and loss.requires_grad:
            self.guard.carry_flags(loss)  # into the norm OLMo-core's clip reduces, on every rank

    def _loop_norm(self) -> torch.Tensor | None:
        """The norm OLMo-core's clip made whole (a plain tensor, the same on every rank), read as the step's."""
        return self._clip.take(reduced=True)


def _latest(optimizer: Any) -> tuple[Any, Any] | None:
    """The newest loss and grad norm in a ``SkipStepOptimizer``'s rolling window; None for another optimizer."""
    if not isinstance(optimizer, _skip_step.SkipStepOptimizer):
        return None
    losses, norms = compat.olmo_skip_step_history(optimizer)
    return (losses[-1] if losses else None), (norms[-1] if norms else None)


def _forget(optimizer: Any, before: tuple[Any, Any] | None, *, losses: bool) -> None:
    """Take what a skipped step appended to ``SkipStepOptimizer``'s rolling window back out: its loss
    (``losses``), or the grad norm its ``optim_step`` measured on no gradients."""
    if before is None:
        return
    window = compat.olmo_skip_step_history(optimizer)[0 if losses else 1]
    if window and window[-1] is not before[0 if losses else 1]:
        window.pop()
