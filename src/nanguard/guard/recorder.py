"""What a guarded run leaves on disk: the per-rank event log and a repro bundle per trip.

``recorder_for(run_dir, ...)`` gives a ``Recorder`` that writes under ``run_dir``, or a
``NullRecorder`` that drops everything when there is none, so the guard records without
asking which it has. The event kinds and their fields are described in ``nanguard.events``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from nanguard import dist
from nanguard.bundle import MAX_WEIGHTS_BYTES, clean_stale_bundles, save_bundle
from nanguard.events import EventLog, new_run_id
from nanguard.findings import Diagnosis
from nanguard.guard.history import Forecast
from nanguard.rng import get_rng_state
from nanguard.spikes import Spike
from nanguard.stats import local
from nanguard.tracer.headroom import Headroom

__all__ = ["NullRecorder", "Recorder", "recorder_for"]


class NullRecorder:
    """Drops every event and bundle: the recorder of a guard without ``run_dir``.

    Each method names one event kind; ``Recorder`` writes them. Either hands each event to
    ``listener`` (``Guard(on_event=...)``) as a dict: ``{"kind", "step", "rank", "run", **fields}``,
    as the event log's lines read (``run`` only when the run has an id: it has one with a ``run_dir``).
    """

    listener: Callable[[dict[str, Any]], None] | None = None
    writes = False
    """Does it keep the events itself (``Recorder``)? Else an event without a ``listener`` goes nowhere."""

    def __init__(self, *, rank: int | None = None, run: str | None = None) -> None:
        # What every event line starts with, so a listener's dicts read as the log's lines do.
        self._head = {k: v for k, v in (("rank", rank), ("run", run)) if v is not None}

    def start(self, config: Mapping[str, Any], world_size: int, path: str) -> None:
        self._write("start", 0, config=dict(config), world_size=world_size, path=path)

    def step(
        self, step: int, *, loss: float | None, grad_norm: float | None, scale: float | None, skipped: bool
    ) -> None:
        if self.writes or self.listener is not None:  # (each step's event: dropped without a call)
            # In stepline.KEYS order (kind, step and rank come first): the report reads these lines by columns.
            self._write("step", step, loss=loss, grad_norm=grad_norm, skipped=skipped, scale=scale)

    def trip(self, step: int, *, action: str, ranks: list[int], diagnosis: Diagnosis, **extra: Any) -> None:
        self._write("trip", step, action=action, ranks=ranks, diagnosis=diagnosis.to_dict(), **extra)

    def skip(self, step: int, reason: str) -> None:
        self._write("skip", step, reason=reason)

    def rollback(self, step: int, *, restored_step: int, skip_batches: int, reason: str, why: str = "") -> None:
        """``restored_step``: the step the restored snapshot was taken at; ``why``: why that snapshot."""
        self._write("rollback", step, restored_step=restored_step, skip_batches=skip_batches, reason=reason, why=why)

    def spike(self, step: int, spike: Spike, *, own: bool = False) -> None:
        """``own``: a spike of this rank's own loss (``History.own_spike``), not of the agreed values."""
        extra = {"own": True} if own else {}
        self._write(
            "spike", step, metric=spike.metric, value=spike.value, median=spike.median, score=spike.score, **extra
        )

    def forecast(self, step: int, forecast: Forecast) -> None:
        """The early divergence warning, as a ``spike`` event with ``predicted_overflow_in``."""
        self._write(
            "spike",
            step,
            metric=forecast.metric,
            value=forecast.value,
            growth=forecast.growth,
            predicted_overflow_in=forecast.predicted_overflow_in,
        )

    def warning(
        self,
        step: int,
        *,
        signal: str,
        module: str | None,
        value: float,
        trend: float,
        steps_left: int | None,
        fix: str,
        lr: Any,
        level: float,
        **extra: Any,
    ) -> None:
        """An early warning: ``signal`` (of ``module``, None for the whole run) at ``value``, growing
        ``trend``-fold a step, ``steps_left`` to a blow-up at that rate; ``fix``, the LR, the level it left;
        a precursor's adds its ``limit`` and the ``series`` of ``[step, value]`` samples it was fitted on."""
        self._write(
            "warning",
            step,
            signal=signal,
            module=module,
            value=value,
            trend=trend,
            steps_left=steps_left,
            fix=fix,
            lr=lr,
            level=level,
            **extra,
        )

    def overflow(self, step: int, *, scale: float, new_scale: float, streak: int) -> None:
        self._write("overflow", step, scale=scale, new_scale=new_scale, streak=streak)

    def remedy(self, *, step: int, cause: str, action: str, target: Any, reason: str) -> None:
        self._write("remedy", step, cause=cause, action=action, target=target, reason=reason)

    def headroom(self, step: int, headroom: Headroom) -> None:
        self._write(
            "headroom",
            step,
            module=headroom.module,
            dtype=headroom.dtype,
            absmax=headroom.absmax,
            limit=headroom.limit,
            close=headroom.close,
        )

    def drill(self, step: int, **fields: Any) -> None:
        """A planted fault's outcome on this rank (``nanguard.inject``)."""
        self._write("drill", step, **fields)

    def end(self, step: int, *, skipped: int, rollbacks: int) -> None:
        self._write("end", step, skipped=skipped, rollbacks=rollbacks)

    def bundle(
        self,
        diag: Diagnosis,
        step: int,
        batch: Any,
        rng: Mapping[str, torch.Tensor] | None,
        meta: Mapping[str, Any],
    ) -> str | None:
        """Save a repro bundle of a tripped step, with ``meta`` in its ``meta.json``; its path, or None."""
        return None

    def keeps_bundle(self, batch: Any) -> bool:
        """Whether a trip with this batch gets a bundle (its ``meta`` is worth building)."""
        return False

    def trip_and_bundle(
        self,
        step: int,
        *,
        action: str,
        ranks: list[int],
        diagnosis: Diagnosis,
        batch: Any,
        rng: Mapping[str, torch.Tensor] | None,
        meta: Mapping[str, Any],
        **extra: Any,
    ) -> str | None:
        """The trip event and its bundle (its path, or None); a failure warns, since recording must
        never kill training."""
        try:
            self.trip(step, action=action, ranks=ranks, diagnosis=diagnosis, **extra)
            return self.bundle(diagnosis, step, batch, rng, meta)
        except Exception as err:
            warnings.warn(f"nanguard: could not record the trip of step {step}: {err!r}", stacklevel=4)
            return None

    def close(self) -> None:
        pass

    def _write(self, kind: str, step: int, **fields: Any) -> None:
        self._tell(kind, step, fields)

    def _tell(self, kind: str, step: int, fields: dict[str, Any]) -> None:
        if self.listener is None:
            return
        try:
            self.listener({"kind": kind, "step": step, **self._head, **fields})
        except Exception as err:  # the user's hook must not kill the run either
            warnings.warn(
                f"nanguard: on_event failed on a {kind} event at step {step}: {err!r}; it gets no more events",
                stacklevel=4,
            )
            self.listener = None


class Recorder(NullRecorder):
    """Writes ``run_dir/events-rank{R}.jsonl`` and ``run_dir/bundles/``. It never raises:
    nanguard must never kill the run it watches, so a full disk or a failed bundle warns
    once and the run goes on.

    With a ``model`` and ``max_weights_bytes`` > 0, each bundle also carries the model's
    parameters and buffers as they were when the step tripped (``Guard(bundle_weights=...)``).

    Example:
        >>> recorder = Recorder("runs/exp1", rank=0, max_bundle_bytes=64 * 2**20)
        >>> recorder.skip(3, reason="loss spike (z=7.1)")
    """

    writes = True

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        rank: int,
        max_bundle_bytes: int,
        model: torch.nn.Module | None = None,
        max_weights_bytes: int = 0,
        run: str | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run = run if run is not None else new_run_id()  # every event carries a run id
        super().__init__(rank=rank, run=self.run)
        self.rank = rank
        self.max_bundle_bytes = max_bundle_bytes
        self.model = model if max_weights_bytes else None
        self.max_weights_bytes = max_weights_bytes
        self.events = EventLog(self.run_dir, rank, run=self.run)
        self._bundle_warned = False
        clean_stale_bundles(self.run_dir, rank)  # half-written bundles of a killed run of this rank

    def bundle(
        self,
        diag: Diagnosis,
        step: int,
        batch: Any,
        rng: Mapping[str, torch.Tensor] | None,
        meta: Mapping[str, Any],
    ) -> str | None:
        if batch is None:
            return None
        try:
            weights, note = _model_state(self.model, self.rank) if self.model is not None else (None, None)
            path = save_bundle(
                self.run_dir,
                step=step,
                rank=self.rank,
                batch=batch,
                rng_state=rng or get_rng_state(),
                meta={"diagnosis": diag.to_dict(), "run": self.run, **meta},
                max_batch_bytes=self.max_bundle_bytes,
                weights=weights,
                max_weights_bytes=self.max_weights_bytes,
                weights_note=note,
            )
            return str(path)
        except Exception as err:  # a failed bundle must not kill training
            if not self._bundle_warned:
                self._bundle_warned = True
                warnings.warn(
                    f"nanguard: could not write the bundle for step {step}: {err!r}; "
                    "later bundle failures are not reported",
                    stacklevel=3,
                )
            return None

    def keeps_bundle(self, batch: Any) -> bool:
        return batch is not None

    def close(self) -> None:
        self.events.close()

    def _write(self, kind: str, step: int, **fields: Any) -> None:
        self.events.write(kind, step, **fields)
        self._tell(kind, step, fields)


def _model_state(model: torch.nn.Module, rank: int) -> tuple[dict[str, torch.Tensor], str | None]:
    """The state dict a replay's model loads: names as the user's module has them (no DDP
    ``module.`` or ``torch.compile`` ``_orig_mod.`` prefix); a sharded model gives this rank's shards."""
    inner = dist.unwrap(model)
    while isinstance(compiled := getattr(inner, "_orig_mod", None), torch.nn.Module):  # torch.compile's wrapper
        inner = dist.unwrap(compiled)
    state = {key: value for key, value in inner.state_dict(keep_vars=True).items() if isinstance(value, torch.Tensor)}
    shards = {key: local(value).detach() for key, value in state.items()}
    if any(local(value) is not value for value in state.values()):
        return shards, f"rank {rank}'s local shards of a sharded (DTensor/FSDP2) model, not the full weights"
    return shards, None


def recorder_for(
    run_dir: str | os.PathLike[str] | None,
    *,
    rank: int,
    max_bundle_bytes: int,
    model: torch.nn.Module | None = None,
    bundle_weights: bool | int = False,
    run: str | None = None,
) -> NullRecorder:
    """A ``Recorder`` under ``run_dir``, or a ``NullRecorder`` when it is None.

    ``bundle_weights`` (``GuardConfig.bundle_weights``): True stores ``model``'s weights in
    each bundle up to ``MAX_WEIGHTS_BYTES``, an int up to that many bytes, False/0 never. ``run``: the
    run's id, written into every event and bundle.
    A ``run_dir`` that is not a path, or names an existing file, is a ValueError.
    """
    if run_dir is None:
        return NullRecorder(rank=rank, run=run)
    if not isinstance(run_dir, (str, os.PathLike)) or isinstance(run_dir, bytes):
        raise ValueError(f"run_dir must be a str or os.PathLike directory path or None, got {type(run_dir).__name__}")
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"run_dir must be a directory, but {str(path)!r} is a file")
    limit = MAX_WEIGHTS_BYTES if bundle_weights is True else int(bundle_weights)
    return Recorder(path, rank=rank, max_bundle_bytes=max_bundle_bytes, model=model, max_weights_bytes=limit, run=run)
