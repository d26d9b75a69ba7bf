"""Event logs of synthetic runs, for the report's tests and benchmarks: no training needed."""

from __future__ import annotations

import math
import random
from collections.abc import Container
from pathlib import Path

from nanguard.events import EventLog
from nanguard.findings import Diagnosis


def write_noisy_run(run_dir: Path, steps: int, trips: Container[int]) -> Path:
    """Write the rank-0 log of ``steps`` steps of a noisy, slowly falling loss whose ``trips``
    steps overflow and are skipped; returns ``run_dir``.

    Example:
        >>> write_noisy_run(tmp / "run", 6000, range(3000, 3008))   # then nanguard report tmp/run
    """
    rng = random.Random(0)
    log = EventLog(run_dir, rank=0)
    log.write("start", 0, config={}, world_size=1, path="host")
    skipped = 0
    for step in range(steps):
        if step in trips:
            diag = Diagnosis(cause="precision.overflow", kind="inf", phase="forward", step=step, rank=0)
            log.write("trip", step, action="skip", ranks=[0], diagnosis=diag.to_dict())
            log.write("skip", step, reason="precision.overflow")
            log.write("step", step, loss=None, grad_norm=None, skipped=True, scale=None)
            skipped += 1
        else:
            loss = abs(4.0 * math.exp(-step / 2000) + rng.gauss(0, 0.3))
            log.write("step", step, loss=loss, grad_norm=1.0 + rng.random(), skipped=False, scale=None)
    log.write("end", steps, skipped=skipped, rollbacks=0)
    log.close()
    return run_dir
