"""Facts about floating-point dtypes that audits and rules look up.

``finfo`` numbers come from ``torch.finfo`` so they cannot drift; the thresholds below are
judgement calls, each with the reason next to it.

Example:
    >>> facts = dtype_facts(torch.float16)
    >>> facts.max, facts.min_norm_eps
    (65504.0, 1e-05)
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch

__all__ = ["DTYPES", "OVERFLOW_FRACTION", "DtypeFacts", "dtype_facts"]

# A low-precision value above max/8 is three doublings from inf: a residual add, a
# square in a norm, or a short matmul sum crosses finfo.max from there.
OVERFLOW_FRACTION = 1 / 8


@dataclass(frozen=True)
class DtypeFacts:
    """What one floating dtype can hold, and the smallest sensible normalization eps."""

    name: str
    max: float  # largest finite value
    tiny: float  # smallest normal value
    resolution: float  # machine epsilon: spacing just above 1.0
    min_norm_eps: float  # smallest eps a norm layer in this dtype should use
    eps_reason: str  # why min_norm_eps, short enough for a finding's message
    low_precision: bool  # 16-bit: overflow headroom is worth auditing

    @property
    def overflow_threshold(self) -> float:
        """Absolute values above this are too close to ``max`` (see OVERFLOW_FRACTION)."""
        return self.max * OVERFLOW_FRACTION


def _facts(dtype: torch.dtype, min_norm_eps: float, eps_reason: str, low_precision: bool) -> DtypeFacts:
    info = torch.finfo(dtype)
    return DtypeFacts(
        name=str(dtype).removeprefix("torch."),
        max=float(info.max),
        tiny=float(info.tiny),
        resolution=float(info.eps),
        min_norm_eps=min_norm_eps,
        eps_reason=eps_reason,
        low_precision=low_precision,
    )


DTYPES = MappingProxyType(
    {
        # float16: squared deviations under ~2.4e-4 underflow (smallest subnormal 6e-8),
        # so a near-constant row has variance 0 and only eps keeps rsqrt finite; eps under
        # 6e-8 rounds to 0 itself, and 1e-5 (PyTorch's default) is the smallest eps that
        # still holds several significant bits as a subnormal.
        torch.float16: _facts(torch.float16, 1e-5, "float16 resolves no smaller", True),
        # bfloat16 has float32's exponent range, so eps never flushes to zero; the limit is
        # its 8-bit mantissa. 1e-6 is the smallest eps that bf16-trained models (LLaMA, T5,
        # Qwen, Gemma) use without trouble; smaller values only amplify rounding noise.
        torch.bfloat16: _facts(torch.bfloat16, 1e-6, "bfloat16's 8-bit mantissa gains nothing below", True),
        # float32/float64: 1e-12 (BERT's LayerNorm) is the smallest eps in wide use; below
        # that a zero-variance row is scaled by more than 1e6.
        torch.float32: _facts(torch.float32, 1e-12, "smaller is only amplified noise", False),
        torch.float64: _facts(torch.float64, 1e-12, "smaller is only amplified noise", False),
    }
)


def dtype_facts(dtype: torch.dtype) -> DtypeFacts | None:
    """Facts for ``dtype``, or None for dtypes the table does not cover (ints, float8).

    Example:
        >>> dtype_facts(torch.bfloat16).low_precision
        True
    """
    return DTYPES.get(dtype)
