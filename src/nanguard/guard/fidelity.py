"""Is the replay the step that was trained? What a finite replay could not observe.

A finite replay says something about the hardware only when it ran the computation that was
trained: the same loss, back-propagated into the same parameters. Every entry point replays through
code it was given or recorded (a closure, ``check()``'s ``replay``, a framework's recorded
micro-batches), and each can fall short of the step: a loss computed where the recording does not
reach, a term added after it, a backward that never runs. The checks here compare what the replay
did with what the step left behind, and say each difference through ``dist.unobserved``, so that a
finite replay that saw less than the step is ``unknown`` with ``evidence["unobserved"]``, never a
hardware suspicion (``diagnose.transient_fault``).

- ``loss_differs``: a finite loss the step trained that the replay computes otherwise;
- ``watched``: a replay wrapped to compare its loss with the step's, and to name the parameters
  the step gave gradients that the replay leaves without.

Both run on a trip only.

Example:
    >>> with dist.observing() as gaps:
    ...     watched(replay, model, trained=loss)()
    >>> gaps
    ['the loss the step trained (2.31; the replay computes 0.87)']
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanguard import dist

__all__ = ["RTOL", "loss_differs", "watched"]

RTOL: dict[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
}
"""How far a replayed loss may sit from the trained one, relatively, by the loss's dtype (a kernel
that reduces in another order stays well inside)."""


def loss_differs(trained: Any, replayed: Any, where: str = "") -> bool:
    """Say (``dist.unobserved``) and return True when the step trained a finite loss ``trained`` and
    the replay computes another finite ``replayed``: the replay ran another computation. A
    non-finite one on either side is the question the replay answers, not a difference.

    Example:
        >>> loss_differs(torch.tensor(2.31), torch.tensor(0.87), " of micro-batch 1")
        True
    """
    if not (_scalar(trained) and _scalar(replayed)):
        return False
    with torch.no_grad():
        a, b = float(trained.detach().float()), float(replayed.detach().float())
    if not (math.isfinite(a) and math.isfinite(b)):
        return False
    rtol = RTOL.get(trained.dtype, RTOL[torch.float32])
    if abs(a - b) <= rtol * max(abs(a), abs(b)) + 1e-12:
        return False
    dist.unobserved(f"the loss the step trained{where} ({a:.6g}; the replay computes {b:.6g})")
    return True


def watched(closure: Callable[[], Any], model: nn.Module, trained: Any) -> Callable[[], Any]:
    """``closure`` that, when it has run, says what of the step it did not reproduce: a scalar loss
    it returns that differs from ``trained``, and the parameters that held a gradient before it
    (the step's) and none after it (no backward reached them).

    Example:
        >>> replay_trip(model, watched(closure, model, trained=loss), ...)
    """
    params = [(n, p) for n, p in dist.unwrap(model).named_parameters() if p.requires_grad]

    def run() -> Any:
        had = [(n, p) for n, p in params if p.grad is not None]
        out = closure()
        loss_differs(trained, out)
        missed = [n for n, p in had if p.grad is None]
        if missed:
            shown = ", ".join(missed[:3]) + (f" and {len(missed) - 3} more" if len(missed) > 3 else "")
            dist.unobserved(f"the gradients of {len(missed)} parameter(s) the step trained ({shown})")
        return out

    return run


def _scalar(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point()
