"""Is a division a normalization? Read from what it computes, never from a class name.

A normalization divides a tensor by a statistic of that same tensor: ``x * rsqrt(mean(x**2))``
(RMSNorm), ``(x - mu) / sqrt(var)`` (LayerNorm), ``x / x.norm()`` (F.normalize, cosine
similarity, weight norm), ``w / sigma(w)`` (spectral norm). The autograd graph the forward builds
says both halves: below the denominator a reduction (a mean, var, std, norm, sum, dot) of some
tensor, and below the numerator that same tensor, directly or through centering, a cast or a gain.
Read only at a creation, so it costs nothing on healthy ops.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["Statistic", "node_of", "shares_source", "statistic_from", "statistic_of"]

# Autograd nodes of reductions, by the statistic they compute (the name without its number).
_REDUCTIONS = {
    "MeanBackward": "mean", "SumBackward": "sum", "VarBackward": "variance", "StdBackward": "std",
    "VarMeanBackward": "variance", "StdMeanBackward": "std", "NormBackward": "L2 norm",
    "LinalgVectorNormBackward": "L2 norm", "DotBackward": "spectral norm", "AmaxBackward": "max",
}  # fmt: skip
# Nodes a statistic passes through on its way to the division: an eps, a root, a clamp, a broadcast.
_ON_THE_WAY = ("AddBackward", "SubBackward", "MulBackward", "DivBackward", "SqrtBackward", "RsqrtBackward",
               "PowBackward", "ClampMinBackward", "ClampBackward", "MaximumBackward", "ExpandBackward",
               "ViewBackward", "UnsqueezeBackward", "SqueezeBackward", "ToCopyBackward", "ReshapeAlias",
               "MvBackward", "AbsBackward")  # fmt: skip
# Nodes between the tensor normalized and what a statistic or a numerator reads of it: its square,
# centering, a cast, a reshape, a gain.
_SAME_TENSOR = ("PowBackward", "SubBackward", "MulBackward", "AbsBackward", "ToCopyBackward", "ViewBackward",
                "UnsqueezeBackward", "ExpandBackward", "AddBackward", "MvBackward", "TBackward")  # fmt: skip
_MEAN_OF = {"variance", "std", "mean of squares"}
_DEPTH = 6


class Statistic:
    """A reduction below a denominator: its kind and the graph nodes of the tensor it reduces."""

    def __init__(self, kind: str, sources: dict[int, Any]) -> None:
        self.kind = kind
        self.sources = sources

    @property
    def mean_based(self) -> bool:
        """A variance, std or mean of squares: what LayerNorm, RMSNorm and BatchNorm divide by."""
        return self.kind in _MEAN_OF


def node_of(t: Any) -> Any:
    """The autograd node that made ``t``, or a leaf ``t`` itself; None without a graph."""
    if not isinstance(t, torch.Tensor) or not t.requires_grad:
        return None
    return t.grad_fn if t.grad_fn is not None else t


def _key(node: Any) -> int:
    """One key per tensor: a leaf and the AccumulateGrad node of its gradient are the same."""
    variable = getattr(node, "variable", None)
    return id(variable) if isinstance(variable, torch.Tensor) else id(node)


def _name(node: Any) -> str:
    return type(node).__name__.rstrip("0123456789")


def _inputs(node: Any) -> Iterator[Any]:
    if isinstance(node, torch.Tensor):
        return
    for n, _ in getattr(node, "next_functions", ()):
        if n is not None:
            yield n


def statistic_of(t: torch.Tensor) -> Statistic | None:
    """The statistic ``t`` (a denominator, or what an rsqrt reads) is computed from, if it is one."""
    start = node_of(t)
    if start is None or isinstance(start, torch.Tensor):
        return None
    seen = {id(start)}
    level = [start]
    for _ in range(_DEPTH):
        nxt = []
        for node in level:
            kind = _REDUCTIONS.get(_name(node))
            if kind is not None:
                return _statistic(node, kind)
            if _name(node) in _ON_THE_WAY:
                for n in _inputs(node):
                    if id(n) not in seen:
                        seen.add(id(n))
                        nxt.append(n)
        level = nxt
    return None


def _statistic(reduction: Any, kind: str) -> Statistic:
    sources = _below(reduction, 3, include_self=False)
    if kind in ("mean", "sum") and any(_name(n) == "PowBackward" for n in _inputs(reduction)):
        kind = "mean of squares" if kind == "mean" else "L2 norm"
    return Statistic(kind, sources)


def _below(node: Any, depth: int, *, include_self: bool = True) -> dict[int, Any]:
    """``node`` and what it reads through ``_SAME_TENSOR`` nodes, up to ``depth`` levels, by id.
    Past the first level a binary node's leaf operand is left out: a gain or scale parameter
    shared by both halves of a division does not make them the same tensor."""
    found: dict[int, Any] = {_key(node): node} if include_self else {}
    level = [node]
    for d in range(depth):
        nxt = []
        for n in level:
            if d > 0 and _name(n) not in _SAME_TENSOR:
                continue
            inputs = list(_inputs(n))
            for m in inputs:
                if _key(m) in found or (d > 0 and len(inputs) > 1 and _name(m) == "AccumulateGrad"):
                    continue
                found[_key(m)] = m
                nxt.append(m)
        level = nxt
    return found  # the nodes themselves too: an id is only safe while its node lives


def shares_source(stat: Statistic, t: Any) -> bool:
    """Is ``t`` (a numerator, or what an rsqrt's result multiplies) the tensor ``stat`` was computed from?"""
    node = node_of(t)
    return node is not None and not _below(node, 2).keys().isdisjoint(stat.sources)


def statistic_from(t: torch.Tensor, kind: str) -> Statistic | None:
    """A statistic (a var or std the tracer saw made) computed from ``t`` itself."""
    node = node_of(t)
    return Statistic(kind, _below(node, 2)) if node is not None else None
