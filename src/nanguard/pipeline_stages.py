"""Pipeline parallel (``torch.distributed.pipelining``): what each stage of this rank received and
sent while a tripped step is replayed.

A stage runs a slice of the model on activations received from the stage before it (the first
stage: on the batch) and, in backward, on gradients received from the stage after it. The stage
where a non-finite value was *created* is the one whose received values were finite and whose
outputs are not; a stage that received non-finite values is downstream of it. ``watch_stages``
records each microbatch's boundary tensors during the replay and reads them once it is over
(host reads, on a trip only: the tracer must not see these reads as the model's ops).

Example:
    >>> with watch_stages() as stages:
    ...     schedule.step(x)
    >>> stages.evidence()
    {'index': 0, 'stages': 2, 'forward': {...}, 'backward': {...}, 'created': 'forward'}
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from nanguard import compat
from nanguard.stats import local
from nanguard.tree import tensors

__all__ = ["Boundary", "StageWatch", "watch_stages"]


@dataclass
class Boundary:
    """One microbatch of one stage: what it received and what it sent on, in one phase."""

    stage: int
    stages: int
    phase: str  # "forward" | "backward"
    received: list[torch.Tensor]
    sent: list[torch.Tensor]


@dataclass
class StageWatch:
    """The boundary tensors of every microbatch this rank's stages ran."""

    seen: list[Boundary] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.seen)

    def evidence(self) -> dict[str, Any] | None:
        """The stage that created the first non-finite value, as plain JSON, or None when no stage ran.

        ``forward`` / ``backward``: whether the stage received and sent non-finite values in that
        phase; ``created``: the phase where it turned finite inputs into non-finite outputs (None
        where it did not: it only passed on what it received)."""
        if not self.seen:
            return None
        by_stage: dict[int, dict[str, dict[str, bool]]] = {}
        for b in self.seen:
            phase = by_stage.setdefault(b.stage, {}).setdefault(b.phase, {"received": False, "sent": False})
            phase["received"] |= _nonfinite(b.received)
            phase["sent"] |= _nonfinite(b.sent)
        stages = self.seen[0].stages

        def created(s: int) -> str | None:
            fwd = by_stage[s].get("forward", {"received": False, "sent": False})
            bwd = by_stage[s].get("backward", {"received": False, "sent": False})
            if fwd["sent"] and not fwd["received"]:
                return "forward"
            # A backward runs on the gradients received and on the forward's saved activations.
            if bwd["sent"] and not (bwd["received"] or fwd["received"] or fwd["sent"]):
                return "backward"
            return None

        # The data's path: forward through the stages in order, then backward in reverse.
        order = sorted(by_stage, key=lambda s: (created(s) != "forward", s if created(s) == "forward" else -s))
        first = next((s for s in order if created(s) is not None), order[0])
        return {
            "index": first,
            "stages": stages,
            "forward": by_stage[first].get("forward"),
            "backward": by_stage[first].get("backward"),
            "created": created(first),
        }


def _nonfinite(ts: list[torch.Tensor]) -> bool:
    with torch.no_grad():
        return any(not bool(torch.isfinite(local(t)).all()) for t in ts if t.is_floating_point())


def _floats(value: Any) -> list[torch.Tensor]:
    return [t for t in tensors(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


@contextlib.contextmanager
def watch_stages() -> Iterator[StageWatch]:
    """Record every pipeline stage's microbatch boundaries while open (nothing when no stage runs)."""
    watch = StageWatch()

    def forward(stage: Any, received: tuple[Any, ...], output: Any) -> None:
        watch.seen.append(Boundary(stage.stage_index, stage.num_stages, "forward", _floats(received), _floats(output)))

    def backward(stage: Any, received: Any, sent: Any) -> None:
        watch.seen.append(Boundary(stage.stage_index, stage.num_stages, "backward", _floats(received), _floats(sent)))

    with contextlib.ExitStack() as stack:
        with contextlib.suppress(ImportError):  # a torch built without torch.distributed.pipelining
            stack.enter_context(compat.pipeline_stage_hooks(forward, backward))
        yield watch
