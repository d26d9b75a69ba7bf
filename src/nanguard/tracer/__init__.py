"""Replay a step under op-level tracing and find where its first non-finite value was created."""

from nanguard.tracer.api import error_origin, locate, trace, weight_scale

__all__ = ["error_origin", "locate", "trace", "weight_scale"]
