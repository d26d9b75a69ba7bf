"""``Guard``: the step, read top to bottom in ``Guard.step`` (the parts are built and wired in
``guard/parts.py``, ``GuardParts``, its base):

    attempt (run the closure: ``Attempt``) -> measure (``Verdict``) -> decide (``Policy.decide``:
    ``Action``) -> apply (step, skip, rollback, remedy, raise; recorded)

Each part owns its state and gets plain data, never the guard: ``guard/attempt.py`` runs the
forward and backward, ``guard/measure.py`` reads the health and diagnoses a trip,
``guard/policy.py`` makes every decision, ``guard/apply.py`` carries it out, ``guard/deferred.py``
reads a step one call late. ``Progress`` is the one record of where the run stands. See the
package docstring for the host and device paths, and docs/how-it-works.md for the drawing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from nanguard import dist, environ
from nanguard.errors import NonFiniteError
from nanguard.findings import Diagnosis
from nanguard.guard.accumulate import accumulation_closure, micro_batch_list
from nanguard.guard.arguments import check_parts
from nanguard.guard.attempt import Attempt, Rng, check_args, unscale
from nanguard.guard.config import OPTIONS_DOC, GuardConfig, with_options
from nanguard.guard.deferred import Waiting
from nanguard.guard.health import Engine
from nanguard.guard.parts import GuardParts
from nanguard.guard.policy import DEFER, Action
from nanguard.guard.progress import Outcome
from nanguard.guard.verdict import Verdict
from nanguard.inject import Fault, NullInjector
from nanguard.rng import capture_rng

__all__ = ["Guard"]


_D = GuardConfig()  # the options' defaults, shown in Guard's signature


class Guard(GuardParts):
    """Guards each optimizer step: detect, diagnose, and skip, roll back or raise.

    ``closure`` follows the ``torch.optim`` convention: it zeroes the gradients, runs
    forward and backward, and returns the loss. With a ``torch.amp.GradScaler`` pass it
    as ``scaler=`` and call ``scaler.scale(loss).backward()`` in the closure; the guard
    unscales, steps and updates the scaler. An Accelerate-prepared optimizer brings its
    own scaler (``accelerator.scaler``), used once. A rollback restores a ``scheduler=`` too,
    and ``policy="auto"`` scales its ``base_lrs`` when it lowers the LR.

    Example:
        >>> guard = ng.Guard(model, optimizer, policy="skip", run_dir="runs/exp1")
        >>> for batch in loader:
        ...     def closure():
        ...         optimizer.zero_grad()
        ...         loss = model(**batch).loss
        ...         loss.backward()
        ...         return loss
        ...     loss = guard.step(closure, batch=batch)   # None when the step was skipped
        >>> guard.skipped, guard.last_diagnosis

    After a rollback, the next ``rollback_skip_batches`` calls to ``step`` drop their batch
    without running the closure and return None; ``guard.last_action`` is then
    ``"drop_batch"``, so the loop knows which batches were skipped. ``guard.last_grad_norm``
    is the latest checked step's gradient norm, across ranks and before clipping (what a loop
    logs); NaN or Inf on a step that tripped, None before the first.

    Pass ``batch=`` to ``step``: a trip's replay names the input that held the bad values
    (``batch['pixel_values']``), a repro bundle stores it, and ``check_batch=True`` audits
    it before the forward. Under DDP the guard wraps the model's comm hook to see each
    rank's own gradients before averaging; a custom hook goes in as ``comm_hook=(state,
    hook)``. ``on_event=fn`` gets each recorded event as a dict (see ``integrations.scalars``);
    ``inject="nan_grad@step=100,rank=3;..."`` plants a fire drill's faults (``nanguard.inject``,
    also ``NANGUARD_INJECT``).

    The options follow, one line each (declared once, as ``GuardConfig``'s fields in ``guard/config.py``).
    """

    def __init__(  # every option a keyword of its own in the signature: with_options, below the class
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        policy: str = _D.policy,
        *,
        scaler: Any = None,
        scheduler: Any = None,
        run_dir: str | os.PathLike[str] | None = None,
        comm_hook: tuple[Any, Callable[..., Any]] | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        inject: str | list[Fault] | None = None,
        **options: Any,
    ) -> None:
        scaler = check_parts(model, optimizer, scaler, scheduler)
        self.config = GuardConfig.from_options(environ.policy(policy), options)  # an unknown name: ValueError
        self.disabled = environ.disabled()  # NANGUARD_DISABLE=1: a plain optimizer step, no files
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self._build(None if self.disabled else environ.run_dir(run_dir), comm_hook, on_event, inject)

    # Where the run stands (``Progress``), and the counters the parts own, read where users always found them.
    step_count = property(lambda self: self.progress.step, doc="Steps checked so far.")
    last_diagnosis = property(lambda self: self.progress.diagnosis, doc="The latest trip's diagnosis, or None.")
    last_action = property(lambda self: self.progress.action, doc="The latest step's action, or None.")
    skipped = property(lambda self: self.recovery.skipped, doc="How many steps were skipped.")
    rollbacks = property(lambda self: self.recovery.rollbacks, doc="How many rollbacks ran.")
    overflows = property(lambda self: self.recovery.overflows, doc="GradScaler overflow steps.")
    consecutive_skips = property(lambda self: self.recovery.consecutive_skips, doc="Skips and rollbacks in a row.")
    overflow_streak = property(lambda self: self.recovery.overflow_streak, doc="Overflow steps in a row.")
    spikes = property(lambda self: self.history.spikes, doc="Loss and grad-norm spikes seen.")
    remedies = property(lambda self: self._remedies.entries, doc="Remedies applied, oldest first.")
    loss_spikes = property(lambda self: self.history.loss_spikes, doc="The loss spike detector.")
    grad_spikes = property(lambda self: self.history.grad_spikes, doc="The grad-norm spike detector.")

    @property
    def last_grad_norm(self) -> float | None:
        """The latest checked step's gradient norm (see the class docstring)."""
        if isinstance(self.progress.grad_norm, torch.Tensor):
            self.progress.grad_norm = float(self.progress.grad_norm)
        return self.progress.grad_norm

    # -- the step ------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any], batch: Any = None, sample_ids: Any = None) -> Any:
        """Run ``closure``, check it, then step the optimizer or recover.

        Returns the closure's loss, or None when the step was skipped or its batch dropped.
        A skip or an error (even ``KeyboardInterrupt``) leaves no trace: README, "What nanguard guarantees".
        """
        if not callable(closure):
            raise ValueError(f"closure must be callable, got {type(closure).__name__}")
        if self.disabled:
            return self._plain.step(closure)
        self.progress.calls += 1
        if self._waiting is not None:
            self._settle()
        if self.recovery.scheduler_pending is not None:  # the loop has stepped its scheduler since the snapshot
            self.recovery.settle_scheduler()
        self._remedies.begin_step(sample_ids)
        if (self.recovery.drop_batches > 0 or self.config.check_batch) and self._dropped(batch):
            return None
        if self.progress.step >= self.precursors.next:  # a sampled step: its hooks go on (a comparison else)
            self.precursors.arm(self.progress.step)
        attempt = self._attempt(closure, batch)
        try:
            self.runner.run(attempt)
            verdict = self._on_device(attempt) if self._device_step else self.measure.step(attempt)
            return self._apply(attempt, verdict, self.policy.decide(verdict, self._state))
        except BaseException as err:
            self._undo(attempt, err, attempt.step, name_origin=True)
            raise
        finally:
            if self._drilling and self._waiting is None:  # deferred: the drill's outcome comes with the verdict
                self._end_drill()

    def step_accumulated(
        self,
        micro_batches: Iterable[Any],
        loss_fn: Callable[[Any], Any],
        *,
        mean: bool = True,
        sample_ids: Any = None,
    ) -> Any:
        """One optimizer step over several micro-batches, as ``step``.

        ``loss_fn(micro_batch)`` runs the forward and returns the loss; the guard zeroes the
        gradients, divides each loss by the number of micro-batches (``mean=False``: as is),
        scales it with the guard's ``scaler=`` and runs backward, inside the model's ``no_sync()``
        (DDP) for all but the last micro-batch. The check sees the summed loss and a trip replays
        every micro-batch. Returns that sum, or None when the step was skipped.

        Example:
            >>> micro = [get_batch() for _ in range(4)]
            >>> loss = guard.step_accumulated(micro, lambda b: model(**b).loss)
        """
        batches = micro_batch_list(micro_batches, loss_fn, mean)
        closure = accumulation_closure(self.model, self.optimizer, self.scaler, batches, loss_fn, mean=mean)
        return self.step(closure, batch=batches, sample_ids=sample_ids)

    def check(
        self,
        loss: Any,
        *,
        replay: Callable[[], Any] | None = None,
        batch: Any = None,
        rng: Rng | None = None,
        grad_norm: Any = None,
    ) -> bool:
        """The closure-free form, for loops that own backward and ``optimizer.step()``.

        Call it after backward and before the optimizer step; step only when it returns
        True, then call ``after_step()``. ``replay`` re-runs the forward and backward (it
        is traced by ``ng.locate`` on a trip); ``rng`` is the RNG state captured before the
        forward (``nanguard.rng.get_rng_state()``), so the replay draws the same numbers.
        ``grad_norm``: when the loop clipped before the check, what its ``clip_grad_norm_``
        returned (the norm before the clip), recorded and judged as the step's grad norm; it is
        read with the check's one host read (the non-finite check still reads the gradients).

        Example:
            >>> loss = model(batch).mean(); loss.backward()
            >>> if guard.check(loss, replay=lambda: rerun(batch), batch=batch):
            ...     optimizer.step()
            ...     guard.after_step()
        """
        value = check_args(loss, replay, rng, grad_norm)
        if self.disabled:
            self._plain.check()
            return True
        self.progress.calls += 1
        self._settle()
        if self.recovery.scheduler_pending is not None:  # the loop has stepped its scheduler since the snapshot
            self.recovery.settle_scheduler()
        # The forward this call checks ran before it: headroom was measured as it ran (armed by the last call).
        self._remedies.headroom.collect(self.progress.step)
        try:
            return self._check(value, replay, batch, rng, grad_norm)
        finally:
            self._remedies.headroom.arm(self.progress.step)  # the next due step's forward, as it runs

    def _check(self, value: Any, replay: Callable[[], Any] | None, batch: Any, rng: Rng | None, grad_norm: Any) -> bool:
        if self._dropped(batch):
            self.health.comm.reset()
            return False
        # The loop ran its own forward and backward: no buffer backup was taken before them.
        attempt = Attempt(self.progress.step, self.progress.calls - 1, batch, rng, replay, owns_buffers=False)
        attempt.value = self._begin_drill().loss(value) if self._drilling else value
        attempt.loop_norm = grad_norm
        try:
            unscale(self.scaler, self.optimizer)
            attempt.unscaled = True
            verdict = self.measure.step(attempt)
            if not self._act(attempt, verdict, self.policy.decide(verdict, self._state)).update:
                return False
            self.apply.clip()
            return True
        finally:
            if self._drilling:  # a fire drill planted faults (none: its calls are skipped)
                self._end_drill()

    def after_step(self) -> None:
        """Record a finished optimizer update: history, step event, parameter check, snapshot."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        attempt, h = pending
        good_steps = self.apply.updated(h)
        # The replicas' check, a stage of the same step: a rank that joined (DDP join(), out of
        # batches) cannot shadow the fingerprint gather.
        replicas, snapshot = self.policy.due(good_steps)
        if replicas and dist.is_distributed() and not h.joined:
            verdict = self.measure.replicas(h.step)
            if verdict is not None:
                self._act(attempt, verdict, self.policy.decide(verdict, self._state))
        self.progress.fold(self.apply.finish(h, snapshot=snapshot))
        if self.progress.step >= self.precursors.next:  # the next forward is sampled (a Guard.check loop's runs first)
            self.precursors.arm(self.progress.step)

    # -- the stages --------------------------------------------------------------------
    def _attempt(self, closure: Callable[[], Any], batch: Any) -> Attempt:
        """A step's attempt, before its forward: the drill planted, the RNG state and the buffers saved."""
        if self._drilling:
            closure = self._begin_drill().wrap(closure)
        progress = self.progress
        attempt = Attempt(progress.step, progress.calls - 1, batch, capture_rng(self._cuda_devices), closure, True)
        if self._buffers is not None:
            self._buffers.save()
        return attempt

    def _on_device(self, attempt: Attempt) -> Verdict:
        """The device path's verdict: the fused optimizer steps between the agreement and the host read
        (the attempt's update, skipped on the device when any rank is bad)."""
        reading = self.measure.agree(attempt, queue=self._deferred)
        self.runner.update_on_device(reading.found_inf())
        return self.measure.read(reading, attempt, updated=True)

    def _apply(self, attempt: Attempt, verdict: Verdict, action: Action) -> Any:
        """``step()``'s action applied; a step that goes ahead is updated and recorded. The loss, or None."""
        outcome = self._act(attempt, verdict, action)
        if action is DEFER:  # its verdict and bookkeeping come with the next call
            assert verdict.queued is not None
            self._waiting = Waiting(attempt, verdict.queued)
            return attempt.loss
        if not outcome.update:
            return None
        self.apply.update(device_step=self._device_step)
        self.after_step()
        return attempt.loss

    def _act(self, attempt: Attempt, verdict: Verdict, action: Action) -> Outcome:
        """Apply ``action`` and fold its outcome into ``progress``; an update that goes ahead is
        recorded by ``after_step``. A stop the policy chose is raised here."""
        outcome = self.apply(attempt, verdict, action)
        self.progress.fold(outcome)
        if outcome.error is not None:
            raise outcome.error
        if outcome.update:
            self._pending = (attempt, verdict.health) if verdict.health is not None else None
        return outcome

    def _undo(self, attempt: Attempt, err: BaseException, count: int, *, name_origin: bool) -> None:
        """The closure, a replay or the update raised: no trace of the step is left (``Runner.undo``)."""
        if not isinstance(err, NonFiniteError):
            self.progress.step, self._pending = count, None
        self.runner.undo(attempt, err, name_origin=name_origin)

    def _settle(self) -> None:
        """Deferred mode: read the last step's flags (its update is running on the device, which
        skipped it if bad) and finish that step as the immediate path would have."""
        w, self._waiting = self._waiting, None
        if w is None:
            return
        attempt, count = w.attempt, self.progress.step
        attempt.unscaled = False  # the deferred path has no GradScaler
        h = w.copy.read(attempt.step, scaled=False)
        try:
            verdict = self.measure.verdict(h, attempt, updated=True)
            if self._act(attempt, verdict, self.policy.decide(verdict, self._state)).update:
                self.after_step()
        except BaseException as err:
            self._undo(attempt, err, count, name_origin=False)
            raise
        finally:
            self._end_drill()

    def _dropped(self, batch: Any) -> bool:
        """The batch is not run: one of the batches after a rollback, or one ``check_batch`` rejected."""
        if self.recovery.drop_batches > 0 and self.recovery.take_drop():
            self.progress.fold(self.apply.drop_batch())
            return True
        if not self.config.check_batch:
            return False
        verdict = self.measure.batch(batch, self.progress.step)
        if verdict is None:
            return False
        self._act(self._no_attempt(verdict.step, batch), verdict, self.policy.decide(verdict, self._state))
        return True

    def _no_attempt(self, step: int, batch: Any) -> Attempt:
        """What a verdict reached without running the step (a rejected batch, replicas that differ) applies to."""
        return Attempt(step, self.progress.calls - 1, batch, None, None, owns_buffers=False)

    def attach_engine(self, engine: Engine) -> None:
        """The seam for an engine that keeps the step's tensors itself (DeepSpeed ZeRO) or reduces the step's
        gradient norm itself (``Engine``): the health is read where it keeps them, a snapshot keeps them too
        (the first one is taken again, with them); a healthy step is read from the engine's reduced norm.

        Example:
            >>> guard.attach_engine(Engine(grad_norm=partition_norm, params=masters, sharded=True, tensors=parts))
        """
        health = self.health
        if engine.grad_norm is not None:
            params = engine.params if engine.params is not None else health.params
            health.read_engine(engine.grad_norm, params, sharded=engine.sharded)
        if engine.watch is not None:
            health.comm = engine.watch
        # A spike skip decides on the loss, which only an agreement makes the same on every rank.
        health.reduces_norm = engine.reduces_norm and not self.config.skip_spikes
        self.recovery.engine_tensors, self.recovery.engine_holds_parameters = engine.tensors, engine.holds_parameters
        if self.recovery.snapshot is not None and engine.tensors is not None:
            self.recovery.take_snapshot(self.progress.step)

    def carry_flags(self, loss: torch.Tensor, *, checked: torch.Tensor | None = None) -> None:
        """Under ``Engine.reduces_norm``: ``loss``'s backward seeds its gradients with NaN when this rank's loss
        (or its parameter check) is non-finite, so the engine's reduced norm carries it to every rank (a loss
        that is NaN while its gradients are finite, say in a term only logged); otherwise times 1.0, exactly.
        Call it on the tensor the loop back-propagates, before its backward; ``checked``: the loss the check
        will see, when it is not ``loss``'s value. No host read.

        Example:
            >>> loss = model(x).mean(); guard.carry_flags(loss); engine.backward(loss)
        """
        if not self.disabled:
            self.health.carry(loss, checked)

    def engine_verdict(
        self,
        step: int,
        replay: Callable[[], Any],
        *,
        action: str,
        batch: Any = None,
        rng: Rng | None = None,
        **extra: Any,
    ) -> Diagnosis | None:
        """The seam for an engine's own verdicts on a step the guard let through (DeepSpeed's loss
        scaler skipping an fp16 overflow): ``replay`` re-runs that step; it is traced and judged with the
        run's history as a trip is, the ranks agree, and a trip event with ``action`` (and ``extra``
        fields) records it. Returns the agreed diagnosis, None when no rank's replay found one. Every
        rank calls it together.

        Example:
            >>> diag = guard.engine_verdict(7, lambda: rerun(micro), action="overflow", batch=micro, scale=scale)
        """
        diag, flagged = self.measure.engine(step, replay, batch=batch, rng=rng)
        if diag is not None:
            self.apply.engine_trip(step, diag, action=action, ranks=flagged, **extra)
        return diag

    # -- around the step -----------------------------------------------------------------
    def _begin_drill(self) -> NullInjector:
        """Plant this step's faults; the injector then wraps its closure (``step``) or loss (``check``)."""
        self._spikes_before = self.history.spikes
        self.injector.begin(self.progress.step)
        return self.injector

    def _end_drill(self) -> None:
        p = self.progress
        self.injector.end(action=p.action, diagnosis=p.diagnosis, spiked=self.history.spikes > self._spikes_before)

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Counters, history and detector windows, so a resumed run keeps them (``guard/resume.py``)."""
        self._settle()
        return self._resume.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._resume.load_state_dict(state)

    def close(self) -> None:
        """End the run: its last event written and the log closed, the hooks the guard put on the model and
        optimizer removed, and the snapshots' host memory let go (a guard is freed only by a garbage
        collection: its parts refer to each other). What it counted stays readable.

        Example:
            >>> guard.close(); guard.skipped, guard.last_diagnosis
        """
        self._settle()
        self._remedies.headroom.close()
        self.precursors.close()
        self._load_hook.remove()
        self.recovery.snapshot = None
        self.recorder.end(self.progress.step, skipped=self.skipped, rollbacks=self.rollbacks)
        self.recorder.close()


Guard.__doc__ = f"{(Guard.__doc__ or '').rstrip()}\n{OPTIONS_DOC}"  # the options, one line each, from their fields
Guard.__init__.__signature__ = with_options(Guard.__init__)  # type: ignore[attr-defined]
