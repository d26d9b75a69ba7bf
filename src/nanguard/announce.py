"""How a trip is told on the console: the run's first trip whole, later ones in a line.

The first trip a guard sees is printed with its whole diagnosis (cause, where, your line, what to try)
by rank 0, whatever the entry point (``Guard.step``, ``check``, ``LoopGuard``, Fabric, Lightning,
Hugging Face, the engines); every later trip, and every trip on the other ranks, is one line. All of it
goes through the ``nanguard`` logger at WARNING, so a plain script shows it without configuring logging.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from nanguard import dist
from nanguard.findings import Diagnosis
from nanguard.text import diagnosis_text

__all__ = ["Announcer"]

log = logging.getLogger("nanguard")


class Announcer:
    """Tells each trip once: whole the first time on rank 0, then one line.

    Example:
        >>> tell = Announcer()
        >>> tell(0, 3, diag, "skip")   # the line, then the whole diagnosis
        >>> tell(0, 4, diag, "skip")   # the line alone
    """

    def __init__(self) -> None:
        self.told_whole = False

    def __call__(self, rank: int, step: int, diag: Diagnosis, action: str) -> None:
        who = f"rank {rank}: " if dist.is_distributed() else ""
        line = f"nanguard: {who}step {step}: {replace(diag, step=None).summary()} -> {action}"
        if self.told_whole or rank != 0:
            log.warning("%s", line)
            return
        self.told_whole = True
        log.warning("%s\n%s", line, diagnosis_text(diag))
