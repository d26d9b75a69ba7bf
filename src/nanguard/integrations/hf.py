"""Hugging Face ``Trainer`` callback: guard every optimizer step, skip bad ones without a trace.

In ``on_pre_optimizer_step`` (after backward and gradient clipping, before
``optimizer.step()``) the callback runs ``Guard.check`` on the step's loss and gradients.
Callbacks see neither the batch nor the loss, so the running Trainer's ``compute_loss`` and
``training_step`` record each micro-batch's inputs, RNG state and the loss it back-propagated,
whatever computes it (``hf_loss.py``); that loss is the one checked, and the one the events
log (the Trainer's own). A tripped step is replayed (the same ``compute_loss`` on the same
inputs and RNG state, scaled and back-propagated as ``training_step`` did) under ``ng.locate``
to name its cause, and the policy applies. A skipped step leaves the weights, the optimizer state, normalization running
statistics and the LR scheduler exactly as if it had not happened; ``state.global_step``
still counts it, and its loss and grad norm are left out of the logs (no fake ``loss 0.0``): the
logged ``loss`` averages the window's trained steps only, and ``train_loss`` (and the final
throughput metrics) count only the steps that updated the weights.

The counters go through the Trainer's own logging, so every ``report_to`` backend
(TensorBoard, W&B, ...) gets ``nanguard/skipped``, ``nanguard/trips`` and, on a trip,
``nanguard/cause``; a tripped step is always logged. The full diagnosis is printed once (by
the main process). ``run_dir`` defaults to ``<output_dir>/nanguard``. The guard's counters and
last diagnosis are kept in ``trainer.state.stateful_callbacks["NanGuardCallback"]`` (saved
with checkpoints).

Example:
    >>> from nanguard.integrations.hf import NanGuardCallback
    >>> guard_cb = NanGuardCallback(policy="skip", run_dir="runs/exp1")
    >>> trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[guard_cb])
    >>> trainer.train()
    >>> guard_cb.skipped, guard_cb.last_diagnosis
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nanguard import compat, dist, environ
from nanguard.findings import Diagnosis
from nanguard.guard import Guard
from nanguard.guard.health import Engine
from nanguard.integrations import GuardedCallback, guard_options, require
from nanguard.integrations.capture import HeldSchedulers, Micro, StepCapture
from nanguard.integrations.clipnorm import ClipNorm
from nanguard.integrations.hf_loss import EngineLoss, TrainerLoss, batch_of, step_loss

_callbacks: Any = require(  # Any: its classes are bases below, known only once imported
    "transformers.trainer_callback", "hf", "Hugging Face transformers"
)

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

__all__ = ["NanGuardCallback"]

log = logging.getLogger("nanguard")


class NanGuardCallback(GuardedCallback, _callbacks.TrainerCallback, _callbacks.ExportableState):
    """Checks each optimizer step for NaN/Inf, diagnoses a trip, and skips, rolls back or raises.

    ``policy`` and ``**options`` are those of ``ng.Guard`` (see ``GuardConfig``); ``run_dir``
    receives the per-rank event log and a bundle for each tripped step. With
    ``max_grad_norm > 0`` the guard checks the clipped gradients (non-finite values stay
    non-finite under clipping) and records the norm the Trainer's clip returned, before it
    clipped (the ``grad_norm`` it logs): a divergence the clip keeps finite is warned about.

    Example:
        >>> cb = NanGuardCallback(policy="raise")
        >>> Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb]).train()
        Traceback (most recent call last):
        nanguard.errors.NonFiniteError: ... optimizer.divergence ...
    """

    def __init__(self, policy: str = "skip", *, run_dir: str | Path | None = None, **options: Any) -> None:
        guard_options(policy, options)
        self.policy = policy
        self.run_dir = str(run_dir) if run_dir is not None else None
        self.options = options
        self.guard: Guard | None = None
        self.guard_state: dict[str, Any] | None = None  # restored from a checkpoint by the Trainer
        self._capture = StepCapture()
        self._hooks: list[Any] = []
        self._stepped = False
        self._held = HeldSchedulers()
        self.trips = 0
        self._trainer: Any = None  # a weak reference, once on_train_begin found the Trainer
        self._loss_before: torch.Tensor | None = None  # the Trainer's running loss sum before this step
        self._logs_through_trainer = False
        self._pending: dict[str, Any] = {}  # the trip entry waiting for the next log event
        self._good_since_log = 0
        self._skipped_since_log = 0  # skipped steps whose loss was taken back out of the Trainer's sum
        self._last_skipped = False
        self._engine_guard: Any = None  # a DeepSpeedGuard, under a DeepSpeed Trainer
        self._diag_before: Diagnosis | None = None
        self._loss: TrainerLoss | None = None  # the Trainer's compute_loss and training_step, recorded
        self._clip: ClipNorm | None = None  # the Trainer's clip: the grad norm before it clipped

    def state(self) -> dict[str, Any]:
        guard_state = self.guard.state_dict() if self.guard is not None else self.guard_state
        return {
            # The Trainer writes this state as JSON: options that are objects (on_event=) are the code's to pass again.
            "args": {"policy": self.policy, "run_dir": self.run_dir, **_plain(self.options)},
            "attributes": {"guard_state": guard_state},
        }

    # -- Trainer events --------------------------------------------------------------------
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model, optimizer = kwargs["model"], kwargs["optimizer"]
        trainer = _run_first(self)
        self._trainer = weakref.ref(trainer) if trainer is not None else None
        self._logs_through_trainer = trainer is not None
        default = os.path.join(args.output_dir, "nanguard") if args.output_dir else None
        run_dir = self.run_dir or environ.run_dir(None) or default
        self._remove_hooks()
        engine = _deepspeed_engine(trainer)
        if engine is not None:
            self._guard_engine(engine, run_dir)
            if trainer is not None:
                self._hooks = [EngineLoss(trainer, self._engine_guard.micro_step)]
            return
        self.guard = Guard(model, optimizer, self.policy, run_dir=run_dir, **self.options)
        if self.guard_state:
            self.guard.load_state_dict(self.guard_state)
        self._capture.watch(model)
        self._watch_clip(optimizer)
        if trainer is not None:  # the loss the Trainer back-propagates, whatever computes it
            self._loss = TrainerLoss(trainer, self._capture)
            self._hooks = [self._loss]
            if args.max_grad_norm and _data_parallel(trainer):
                # Its clip's total norm, of gradients DDP averaged, is the same on every rank and non-finite on
                # each when any rank's gradients are; a rank's NaN loss seeds its backward (carry_flags): a healthy
                # step is read from that norm, with no collective of the guard's.
                self.guard.attach_engine(Engine(reduces_norm=True))
                self._loss.carry = self.guard.carry_flags
            return
        self._hooks = [
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward, with_kwargs=True),
        ]

    def _guard_engine(self, engine: Any, run_dir: Any) -> None:
        """Under DeepSpeed the engine steps inside the Trainer's backward: a ``DeepSpeedGuard`` checks
        the step there, where ZeRO keeps its gradients, and skips it through the engine."""
        from nanguard.integrations.deepspeed import DeepSpeedGuard

        if self._engine_guard is not None:
            self._engine_guard.close()
        self._engine_guard = DeepSpeedGuard(engine, self.policy, run_dir=run_dir, **self.options)
        self._engine_guard.announce = False  # _record prints the diagnosis once
        self.guard = self._engine_guard.guard
        if self.guard_state and self.guard is not None:
            self.guard.load_state_dict(self.guard_state)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._diag_before = self.guard.last_diagnosis if self.guard is not None else None
        self._capture.take()
        if self._clip is not None:
            self._clip.clear()
        self._loss_before = _loss_sum(self._trainer)
        if self._loss_before is not None:
            self._loss_before = self._loss_before.clone()  # the Trainer adds to its sum in place

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        guard = self.guard
        if guard is None:
            return
        if self._engine_guard is not None:  # checked, and stepped or skipped, inside the backward
            self._stepped = False
            if self._engine_guard.step_skipped:
                self._forget_step_loss()
                self._record(state, self._diag_before)
            else:
                self._good_since_log += 1
                self._last_skipped = False
            return
        optimizer, scheduler = kwargs["optimizer"], kwargs.get("lr_scheduler")
        micro = self._capture.take()
        before = guard.last_diagnosis

        def on_raise() -> None:
            self._record(state, before)
            self._remove_hooks()
            guard.close()

        trained = self._loss
        self._stepped = self._capture.check(
            guard,
            step_loss(micro) if trained is not None else _step_loss(micro),
            micro,
            replay=(lambda: self._replay(micro)) if micro else None,
            batch=batch_of(micro) if trained is not None else _batch_of(micro),
            optimizer=optimizer,
            on_raise=on_raise,
            grad_norm=self._clip.take() if self._clip is not None else None,
        )
        if self._stepped:
            return
        self._forget_step_loss()
        # The Trainer steps the scheduler after any optimizer step; on_step_end puts it back.
        self._held.hold([scheduler] if scheduler is not None else [], optimizer)
        self._record(state, before)

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.guard is not None and self._stepped:
            self._stepped = False
            self._good_since_log += 1
            self._last_skipped = False
            self.guard.after_step()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self._pending and self._logs_through_trainer:
            control.should_log = True  # a trip is always logged, whatever logging_steps says
        self._held.release()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._remove_hooks()
        if self._engine_guard is not None:
            self._engine_guard.close()
        elif self.guard is not None:
            self.guard.close()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if self.guard is None or logs is None or "loss" not in logs or not self._logs_through_trainer:
            return  # evaluation logs, the final summary, or no trainer to log through
        # This callback runs first, so the backends that follow see the edited logs; the
        # history entry is a copy the Trainer made just before, edited the same way.
        entry = state.log_history[-1] if state.log_history and state.log_history[-1].get("loss") is logs["loss"] else {}
        extra = {"nanguard/skipped": self.guard.skipped, "nanguard/trips": self.trips, **self._pending}
        drop = ["loss"] if self._good_since_log == 0 else []  # every step of the window was skipped
        if self._good_since_log and self._skipped_since_log:
            # The Trainer divided the trained steps' loss sum by every step of the window.
            extra["loss"] = logs["loss"] * (self._good_since_log + self._skipped_since_log) / self._good_since_log
        if self._last_skipped:
            drop.append("grad_norm")  # the norm of the skipped step's gradients
        for target in (logs, entry):
            target.update(extra)
            for key in drop:
                target.pop(key, None)
        self._pending, self._good_since_log, self._skipped_since_log = {}, 0, 0

    # -- recording and replay --------------------------------------------------------------
    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if not module.training or not torch.is_grad_enabled():
            return  # evaluation or generation
        self._capture.record(args, kwargs)  # nothing during our own replay

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        micro = self._capture.micro
        if self._capture.replaying or not micro or micro[-1].loss is not None:
            return
        loss = _loss_of(output)
        if loss is not None:
            micro[-1].loss = loss.detach()

    def _replay(self, micro: list[Micro]) -> list[Any]:
        """Each micro-batch of the step as the Trainer ran it: its ``compute_loss``, scaled and
        back-propagated as ``training_step`` did (``hf_loss.py``); without the Trainer at hand, the
        model's forward and its own loss."""
        model = self.guard.model if self.guard is not None else None
        assert model is not None
        if self._loss is not None:
            return self._loss.replay(model, micro)
        dist.unobserved("the loss the Trainer back-propagated (no Trainer found: the model's own loss was replayed)")

        def run(m: Micro) -> Any:
            out = model(*m.args, **m.kwargs)
            loss = _loss_of(out)
            if loss is None:  # a loss computed outside the model: trace the forward alone
                return out
            (loss if _scaled(m) else loss / len(micro)).backward()
            return loss

        return self._capture.replay(model, micro, run)

    def _forget_step_loss(self) -> None:
        """Take a skipped step out of the Trainer's loss bookkeeping: its micro-batches' losses
        (or the stand-ins the Trainer adds for NaN ones) leave the running sum, and the step leaves
        the count ``train_loss`` divides by. Private Trainer attributes: when they are missing,
        the Trainer's own numbers stand."""
        trainer = self._trainer() if self._trainer is not None else None
        before, self._loss_before = self._loss_before, None
        total = _loss_sum(self._trainer)
        first = compat.hf_initial_step(trainer)
        if before is None or total is None or first is None:
            return
        total.copy_(before)
        compat.hf_set_initial_step(trainer, first + 1)
        self._skipped_since_log += 1

    def _record(self, state: TrainerState, before: Diagnosis | None) -> None:
        guard = self.guard
        assert guard is not None
        if guard.last_action not in ("skip", "rollback", "raise"):
            return  # a batch dropped after a rollback was counted by the guard already
        entry: dict[str, Any] = {
            "nanguard/skipped": guard.skipped,
            "nanguard/rollbacks": guard.rollbacks,
            "nanguard/action": guard.last_action,
        }
        self._last_skipped = True
        diag = guard.last_diagnosis
        if diag is not None and diag is not before:
            self.trips += 1
            entry["nanguard/cause"] = diag.cause
            entry["nanguard/diagnosis"] = diag.summary()
        if self._logs_through_trainer and guard.last_action != "raise":
            self._pending = entry
        else:
            # HF numbers a log entry by the steps completed after it: this step is global_step + 1.
            state.log_history.append({**entry, "nanguard/trips": self.trips, "step": state.global_step + 1})
        if isinstance(state.stateful_callbacks, dict):
            state.stateful_callbacks[type(self).__name__] = self.state()

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._loss = [], None
        if self._clip is not None:
            self._clip.close()
            self._clip = None

    def _watch_clip(self, optimizer: torch.optim.Optimizer) -> None:
        """Read the norm the Trainer's clip (``accelerator.clip_grad_norm_`` with ``max_grad_norm``,
        before ``on_pre_optimizer_step``) computed: the step's grad norm as the Trainer logs it."""
        self._clip = ClipNorm(p for group in optimizer.param_groups for p in group["params"])


def _data_parallel(trainer: Any) -> bool:
    """Does the Trainer train a DDP-wrapped model over every rank (gradients averaged before its clip)?"""
    wrapped = getattr(trainer, "model_wrapped", None)
    ddp = isinstance(wrapped, nn.parallel.DistributedDataParallel)
    return ddp and dist.is_distributed() and wrapped.process_group.size() == dist.world_size()  # type: ignore[union-attr]


def _deepspeed_engine(trainer: Any) -> Any:
    """The DeepSpeed engine a Trainer runs its model in, or None (no DeepSpeed, or not imported)."""
    deepspeed = sys.modules.get("deepspeed")
    wrapped = getattr(trainer, "model_wrapped", None)
    return wrapped if deepspeed is not None and isinstance(wrapped, deepspeed.DeepSpeedEngine) else None


def _run_first(callback: NanGuardCallback) -> Any:
    """Move ``callback`` to the front of its Trainer's callbacks; returns the Trainer, or None.

    Running first lets ``on_log`` add the counters before the ``report_to`` callbacks (added
    ahead of the user's) write the logs out.
    """
    trainer = compat.hf_trainer_of(callback)
    if trainer is not None:
        compat.hf_callbacks(trainer).sort(key=lambda c: c is not callback)  # stable: the others keep their order
    return trainer


def _loss_sum(trainer_ref: Any) -> torch.Tensor | None:
    """The Trainer's running sum of step losses since its last log."""
    return compat.hf_loss_sum(trainer_ref() if trainer_ref is not None else None)


def _loss_of(output: Any) -> torch.Tensor | None:
    """The loss as ``Trainer.compute_loss`` reads it: ``outputs["loss"]``, else the first element."""
    if isinstance(output, Mapping):
        loss = output.get("loss")
    elif isinstance(output, (tuple, list)) and output:
        loss = output[0]
    else:
        loss = None
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def _scaled(m: Micro) -> bool:
    # The Trainer passes num_items_in_batch to models that accept loss kwargs; their loss is
    # then already normalized over the whole accumulated step, and the Trainer does not divide it.
    return m.kwargs.get("num_items_in_batch") is not None


def _step_loss(micro: list[Micro]) -> torch.Tensor | None:
    losses = [m.loss for m in micro]
    if not losses or any(loss is None for loss in losses):
        return None  # gradients alone decide
    total = torch.stack([loss.float().reshape(()) for loss in losses])  # type: ignore[union-attr]
    return total.sum() if all(_scaled(m) for m in micro) else total.mean()


def _batch_of(micro: list[Micro]) -> Any:
    if not micro:
        return None
    batches = [{**{f"args[{i}]": a for i, a in enumerate(m.args)}, **m.kwargs} for m in micro]
    return batches[0] if len(batches) == 1 else batches


def _plain(options: dict[str, Any]) -> dict[str, Any]:
    """The options a JSON file can hold: numbers, strings, booleans, None."""
    return {k: v for k, v in options.items() if v is None or isinstance(v, (bool, int, float, str))}
