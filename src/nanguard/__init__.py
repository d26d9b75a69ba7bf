"""nanguard: catch the first NaN/Inf in PyTorch training, name its cause, keep training.

The public names load on first use, so ``nanguard --help`` answers without importing torch.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanguard.audit import audit_model, check_batch
    from nanguard.bisection import bisect
    from nanguard.bundle import load_bundle, replay
    from nanguard.errors import NonFiniteError
    from nanguard.findings import CAUSES, Diagnosis, Finding
    from nanguard.guard import Guard
    from nanguard.sampler import QuarantineSampler
    from nanguard.tracer import locate

__all__ = [
    "CAUSES",
    "Diagnosis",
    "Finding",
    "Guard",
    "NonFiniteError",
    "QuarantineSampler",
    "audit_model",
    "bisect",
    "check_batch",
    "load_bundle",
    "locate",
    "replay",
]


def _version() -> str:
    try:
        return importlib.metadata.version("nanguard")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


__version__ = _version()
"""The installed distribution's version: pyproject.toml is its one source."""

_HOME = {
    "CAUSES": "nanguard.findings",
    "Diagnosis": "nanguard.findings",
    "Finding": "nanguard.findings",
    "Guard": "nanguard.guard",
    "QuarantineSampler": "nanguard.sampler",
    "NonFiniteError": "nanguard.errors",
    "audit_model": "nanguard.audit",
    "bisect": "nanguard.bisection",
    "check_batch": "nanguard.audit",
    "load_bundle": "nanguard.bundle",
    "locate": "nanguard.tracer",
    "replay": "nanguard.bundle",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'nanguard' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public API and the version: not the names this module imports for itself (``importlib``,
    ``Any``, ``TYPE_CHECKING``, ``annotations``) nor the submodules loaded so far."""
    return sorted([*__all__, "__version__"])
