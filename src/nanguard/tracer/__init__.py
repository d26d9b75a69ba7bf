"""Replay a step under op-level tracing and find where its first non-finite value was created."""

from nanguard.tracer.api import locate, trace, weight_scale

__all__ = ["locate", "trace", "weight_scale"]
