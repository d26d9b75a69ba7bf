"""nanguard: catch the first NaN/Inf in PyTorch training, name its cause, keep training."""

from nanguard.audit import audit_model, check_batch
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
    "check_batch",
    "load_bundle",
    "locate",
    "replay",
]
__version__ = "0.1.0"
