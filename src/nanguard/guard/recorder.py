"""What a guarded run leaves on disk: the per-rank event log and a repro bundle per trip.

``recorder_for(run_dir, ...)`` gives a ``Recorder`` that writes under ``run_dir``, or a
``NullRecorder`` that drops everything when there is none, so the guard records without
asking which it has. The event kinds and their fields are described in ``nanguard.events``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from nanguard.events import EventLog
from nanguard.findings import Diagnosis
from nanguard.rng import get_rng_state
from nanguard.spikes import Spike

__all__ = ["NullRecorder", "Recorder", "recorder_for"]


class NullRecorder:
    """Drops every event and bundle: the recorder of a guard without ``run_dir``.

    Each method names one event kind; ``Recorder`` writes them.
    """

    def start(self, config: Mapping[str, Any], world_size: int, path: str) -> None:
        self._write("start", 0, config=dict(config), world_size=world_size, path=path)

    def step(
        self, step: int, *, loss: float | None, grad_norm: float | None, scale: float | None, skipped: bool
    ) -> None:
        self._write("step", step, loss=loss, grad_norm=grad_norm, skipped=skipped, scale=scale)

    def trip(self, step: int, *, action: str, ranks: list[int], diagnosis: Diagnosis, **extra: Any) -> None:
        self._write("trip", step, action=action, ranks=ranks, diagnosis=diagnosis.to_dict(), **extra)

    def skip(self, step: int, reason: str) -> None:
        self._write("skip", step, reason=reason)

    def rollback(self, step: int, *, restored_step: int, skip_batches: int, reason: str) -> None:
        self._write("rollback", step, restored_step=restored_step, skip_batches=skip_batches, reason=reason)

    def spike(self, step: int, spike: Spike) -> None:
        self._write("spike", step, metric=spike.metric, value=spike.value, median=spike.median, score=spike.score)

    def overflow(self, step: int, *, scale: float, new_scale: float, streak: int) -> None:
        self._write("overflow", step, scale=scale, new_scale=new_scale, streak=streak)

    def end(self, step: int, *, skipped: int, rollbacks: int) -> None:
        self._write("end", step, skipped=skipped, rollbacks=rollbacks)

    def bundle(
        self,
        diag: Diagnosis,
        step: int,
        batch: Any,
        rng: dict[str, torch.Tensor] | None,
        meta: Callable[[], dict[str, Any]],
    ) -> None:
        """Save a repro bundle of a tripped step (``meta`` is called only when one is written)."""

    def close(self) -> None:
        pass

    def _write(self, kind: str, step: int, **fields: Any) -> None:
        pass


class Recorder(NullRecorder):
    """Writes ``run_dir/events-rank{R}.jsonl`` and ``run_dir/bundles/``; a failed bundle
    only warns, since nanguard must never kill the run it watches.

    Example:
        >>> recorder = Recorder("runs/exp1", rank=0, max_bundle_bytes=64 * 2**20)
        >>> recorder.skip(3, reason="loss spike (z=7.1)")
    """

    def __init__(self, run_dir: str | Path, *, rank: int, max_bundle_bytes: int) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.max_bundle_bytes = max_bundle_bytes
        self.events = EventLog(self.run_dir, rank)
        from nanguard.bundle import clean_stale_bundles

        clean_stale_bundles(self.run_dir, rank)  # half-written bundles of a killed run of this rank

    def bundle(
        self,
        diag: Diagnosis,
        step: int,
        batch: Any,
        rng: dict[str, torch.Tensor] | None,
        meta: Callable[[], dict[str, Any]],
    ) -> None:
        if batch is None:
            return
        from nanguard.bundle import save_bundle

        try:
            path = save_bundle(
                self.run_dir,
                step=step,
                rank=self.rank,
                batch=batch,
                rng_state=rng or get_rng_state(),
                meta={"diagnosis": diag.to_dict(), **meta()},
                max_batch_bytes=self.max_bundle_bytes,
            )
            diag.evidence["bundle"] = str(path)
        except Exception as err:  # a failed bundle must not kill training
            warnings.warn(f"nanguard: could not write the bundle for step {step}: {err!r}", stacklevel=3)

    def close(self) -> None:
        self.events.close()

    def _write(self, kind: str, step: int, **fields: Any) -> None:
        self.events.write(kind, step, **fields)


def recorder_for(run_dir: str | Path | None, *, rank: int, max_bundle_bytes: int) -> NullRecorder:
    """A ``Recorder`` under ``run_dir``, or a ``NullRecorder`` when it is None."""
    if run_dir is None:
        return NullRecorder()
    return Recorder(run_dir, rank=rank, max_bundle_bytes=max_bundle_bytes)
