"""nanguard: catch the first NaN/Inf in PyTorch training, name its cause, keep training."""

from nanguard.errors import NonFiniteError
from nanguard.findings import CAUSES, Diagnosis, Finding
from nanguard.guard import Guard
from nanguard.locate import locate

__all__ = ["CAUSES", "Diagnosis", "Finding", "Guard", "NonFiniteError", "locate"]
__version__ = "0.1.0"
