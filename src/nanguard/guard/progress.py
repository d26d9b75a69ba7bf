"""Where a guarded run stands: the one record the guard's parts share instead of the guard.

``Guard.step_count``, ``last_action``, ``last_diagnosis`` and ``last_grad_norm`` read it. The parts
that report where the run is (the apply, the DDP ``join()`` shadow, the fire drill's injector) are
handed this record, never the guard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanguard.findings import Diagnosis

__all__ = ["Progress"]


@dataclass
class Progress:
    """The run's counters and its latest outcome.

    Example:
        >>> progress = Progress()
        >>> progress.step, progress.action
        (0, None)
    """

    step: int = 0
    """Steps checked so far (``Guard.step_count``): the index the next step is checked as."""
    calls: int = 0
    """``Guard.step``/``check`` calls, undone by nothing: the step index the ranks agree on."""
    action: str | None = None
    """The latest step's action (``Guard.last_action``)."""
    diagnosis: Diagnosis | None = None
    """The latest trip's diagnosis (``Guard.last_diagnosis``)."""
    grad_norm: float | torch.Tensor | None = None
    """The latest checked step's gradient norm, across ranks, before clipping (``Guard.last_grad_norm``);
    a tensor until read, where a disabled guard computed it."""
