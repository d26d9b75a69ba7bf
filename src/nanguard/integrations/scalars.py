"""Send a plain loop's per-step scalars and trips to TensorBoard or W&B: ``Guard(on_event=...)``.

Neither package is imported here: the writer or run you pass in is the only link to it.

Example:
    >>> from torch.utils.tensorboard import SummaryWriter
    >>> from nanguard.integrations.scalars import to_tensorboard
    >>> guard = ng.Guard(model, optimizer, on_event=to_tensorboard(SummaryWriter("runs/tb")))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["scalars_of", "to_tensorboard", "to_wandb"]

Event = dict[str, Any]


def scalars_of(event: Event, counts: dict[str, int]) -> dict[str, float | str]:
    """The ``nanguard/*`` values of one guard event; ``counts`` carries the trip and skip totals.

    Example:
        >>> scalars_of({"kind": "step", "step": 3, "loss": 2.5, "grad_norm": 1.0, "skipped": False}, {})
        {'nanguard/loss': 2.5, 'nanguard/grad_norm': 1.0}
    """
    kind = event.get("kind")
    out: dict[str, float | str] = {}
    if kind == "step" and not event.get("skipped"):
        for key in ("loss", "grad_norm", "scale"):
            if event.get(key) is not None:
                out[f"nanguard/{key}"] = float(event[key])
    elif kind in ("trip", "skip", "rollback", "overflow"):
        counts[kind] = counts.get(kind, 0) + 1
        out[f"nanguard/{kind}s"] = float(counts[kind])
        if kind == "trip":
            out["nanguard/cause"] = str(event.get("diagnosis", {}).get("cause", "unknown"))
    return out


def to_tensorboard(writer: Any) -> Callable[[Event], None]:
    """An ``on_event`` that writes to a ``SummaryWriter``: scalars, and the cause as text."""
    counts: dict[str, int] = {}

    def on_event(event: Event) -> None:
        for key, value in scalars_of(event, counts).items():
            if isinstance(value, str):
                writer.add_text(key, value, event["step"])
            else:
                writer.add_scalar(key, value, event["step"])

    return on_event


def to_wandb(run: Any) -> Callable[[Event], None]:
    """An ``on_event`` that logs to a W&B run (``wandb.init(...)``) at the guard's step."""
    counts: dict[str, int] = {}

    def on_event(event: Event) -> None:
        values = scalars_of(event, counts)
        if values:
            run.log(values, step=event["step"])

    return on_event
