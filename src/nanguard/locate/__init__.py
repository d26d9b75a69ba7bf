"""Replay a step under op-level tracing and find where its first non-finite value was created."""

from nanguard.locate.api import locate, weight_scale

__all__ = ["locate", "weight_scale"]
