"""Send a plain loop's trips and skips to TensorBoard or W&B: ``Guard(on_event=...)``.

Neither package is imported here: the writer or run you pass in is the only link to it.

What is logged: ``nanguard/trips`` and ``nanguard/skips``, the run's totals so far, at every step (a step
function from a zero baseline: a trip is a rise, not a lone dot), ``nanguard/rollbacks``,
``nanguard/overflows`` and ``nanguard/warnings`` from their first one on, ``nanguard/cause`` at a trip,
``nanguard/precursor/<signal>`` (the precursor's value) and ``nanguard/steps_left`` at an early
warning, and ``nanguard/scale`` (a GradScaler's scale). The loss and the gradient norm are your loop's own
curves: ``curves=True`` adds the guard's (``nanguard/loss``, ``nanguard/grad_norm``: across ranks, before clipping).

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
COUNTED = ("trip", "skip", "rollback", "overflow", "warning")
BASELINE = ("trip", "skip")  # logged from step 0 on; the others once they happened


def scalars_of(event: Event, counts: dict[str, int], *, curves: bool = False) -> dict[str, float | str]:
    """The ``nanguard/*`` values of one guard event; ``counts`` carries the totals between events.

    Example:
        >>> scalars_of({"kind": "step", "step": 3, "loss": 2.5, "grad_norm": 1.0, "skipped": False}, {})
        {'nanguard/trips': 0.0, 'nanguard/skips': 0.0}
        >>> scalars_of({"kind": "step", "step": 3, "loss": 2.5, "skipped": False}, {}, curves=True)["nanguard/loss"]
        2.5
    """
    kind = event.get("kind")
    out: dict[str, float | str] = {}
    if kind == "step":
        keys = ("loss", "grad_norm", "scale") if curves and not event.get("skipped") else ("scale",)
        for key in keys:
            if event.get(key) is not None:
                out[f"nanguard/{key}"] = float(event[key])
        for counted in COUNTED:
            if counted in BASELINE or counts.get(counted):
                out[f"nanguard/{counted}s"] = float(counts.get(counted, 0))
    elif kind in COUNTED:
        counts[kind] = counts.get(kind, 0) + 1
        out[f"nanguard/{kind}s"] = float(counts[kind])
        if kind == "trip":
            out["nanguard/cause"] = str(event.get("diagnosis", {}).get("cause", "unknown"))
        if kind == "warning":
            if isinstance(event.get("value"), (int, float)):
                out[f"nanguard/precursor/{event.get('signal')}"] = float(event["value"])
            if isinstance(event.get("steps_left"), (int, float)):
                out["nanguard/steps_left"] = float(event["steps_left"])
    return out


def to_tensorboard(writer: Any, *, curves: bool = False) -> Callable[[Event], None]:
    """An ``on_event`` that writes to a ``SummaryWriter`` at the guard's step: scalars, and the cause as text.

    ``curves=True`` adds the guard's loss and gradient norm (off: they would repeat your loop's own).
    """
    counts: dict[str, int] = {}

    def on_event(event: Event) -> None:
        for key, value in scalars_of(event, counts, curves=curves).items():
            if isinstance(value, str):
                writer.add_text(key, value, event["step"])
            else:
                writer.add_scalar(key, value, event["step"])

    return on_event


def to_wandb(run: Any, *, curves: bool = False) -> Callable[[Event], None]:
    """An ``on_event`` that logs to a W&B run (``wandb.init(...)``) on an axis of its own.

    The values are plotted against ``nanguard/step`` (the guard's step, declared with the run's
    ``define_metric``), and logged without ``step=``: a loop that logs with a step axis of its own
    (samples seen, tokens) keeps it, and no value is refused as "less than the current step".
    """
    run.define_metric("nanguard/step", hidden=True)
    run.define_metric("nanguard/*", step_metric="nanguard/step")
    counts: dict[str, int] = {}

    def on_event(event: Event) -> None:
        values: dict[str, Any] = dict(scalars_of(event, counts, curves=curves))
        if values:
            run.log({**values, "nanguard/step": event["step"]})

    return on_event
