"""The NANGUARD_* environment variables: what a job script sets per run without touching code.

Every ``Guard`` reads them when it is built; ``nanguard doctor`` shows them.
"""

from __future__ import annotations

import os
from typing import TypeVar

T = TypeVar("T")

__all__ = ["POLICIES", "VARIABLES", "disabled", "inject", "policy", "run_dir"]

POLICIES = ("skip", "rollback", "raise", "auto")
"""Every policy a Guard takes (``GuardConfig`` checks against this one tuple)."""

VARIABLES: tuple[tuple[str, str], ...] = (
    ("NANGUARD_POLICY", "skip|rollback|raise|auto: the policy of every Guard, overriding the one in the code"),
    ("NANGUARD_RUN_DIR", "where every Guard writes events and bundles when the code passes no run_dir"),
    ("NANGUARD_DISABLE", "1: every Guard is a plain optimizer step (no checks, no files), e.g. for a timing run"),
    ("NANGUARD_INJECT", "a fire drill: faults to plant, e.g. nan_grad@step=100,rank=3;stall@step=600,rank=1,seconds=5"),
)


def policy(default: str) -> str:
    """NANGUARD_POLICY when set, else ``default``.

    Example:
        >>> os.environ["NANGUARD_POLICY"] = "rollback"; policy("skip")
        'rollback'
    """
    value = os.environ.get("NANGUARD_POLICY", "").strip()
    if not value:
        return default
    if value not in POLICIES:
        raise ValueError(f"NANGUARD_POLICY must be one of {POLICIES}, got {value!r}")
    return value


def run_dir(default: str | os.PathLike[str] | None) -> str | os.PathLike[str] | None:
    """``default`` when the code gave one, else NANGUARD_RUN_DIR (None when unset).

    Example:
        >>> os.environ["NANGUARD_RUN_DIR"] = "runs/job7"; run_dir(None)
        'runs/job7'
    """
    if default is not None:
        return default
    return os.environ.get("NANGUARD_RUN_DIR", "").strip() or None


def disabled() -> bool:
    """Is NANGUARD_DISABLE set to a true value (1, true, yes, on)?

    Example:
        >>> os.environ["NANGUARD_DISABLE"] = "1"; disabled()
        True
    """
    return os.environ.get("NANGUARD_DISABLE", "").strip().lower() in ("1", "true", "yes", "on")


def inject(default: T | None) -> T | str | None:
    """``default`` when the code gave faults to plant, else NANGUARD_INJECT (None when unset).

    Example:
        >>> os.environ["NANGUARD_INJECT"] = "nan_grad@step=100,rank=3"; inject(None)
        'nan_grad@step=100,rank=3'
    """
    if default is not None:
        return default
    return os.environ.get("NANGUARD_INJECT", "").strip() or None
