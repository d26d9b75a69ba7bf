"""Is a division a normalization? Read from what it computes, never from a class name.

A normalization divides a tensor by a statistic of that same tensor: ``x * rsqrt(mean(x**2))``
(RMSNorm), ``(x - mu) / sqrt(var)`` (LayerNorm), ``x / x.norm()`` (F.normalize, cosine
similarity, weight norm), ``w / sigma(w)`` (spectral norm). The autograd graph the forward builds
says both halves: below the denominator a reduction (a mean, var, std, norm, sum, dot) of some
tensor, and below the numerator that same tensor, directly or through centering, a cast or a gain.
Read only at a creation, so it costs nothing on healthy ops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["NormalizationWatch", "Statistic", "node_of", "shares_source", "statistic_from", "statistic_of"]

# Autograd nodes of reductions, by the statistic they compute (the name without its number).
_REDUCTIONS = {
    "MeanBackward": "mean",
    "SumBackward": "sum",
    "VarBackward": "variance",
    "StdBackward": "std",
    "VarMeanBackward": "variance",
    "StdMeanBackward": "std",
    "NormBackward": "L2 norm",
    "LinalgVectorNormBackward": "L2 norm",
    "DotBackward": "spectral norm",
    "AmaxBackward": "max",
}
# Nodes a statistic passes through on its way to the division: an eps, a root, a clamp, a broadcast.
_ON_THE_WAY = (
    "AddBackward",
    "SubBackward",
    "MulBackward",
    "DivBackward",
    "SqrtBackward",
    "RsqrtBackward",
    "PowBackward",
    "ClampMinBackward",
    "ClampBackward",
    "MaximumBackward",
    "ExpandBackward",
    "ViewBackward",
    "UnsqueezeBackward",
    "SqueezeBackward",
    "ToCopyBackward",
    "ReshapeAlias",
    "MvBackward",
    "AbsBackward",
)
# Nodes between the tensor normalized and what a statistic or a numerator reads of it: its square,
# centering, a cast, a reshape, a gain.
_SAME_TENSOR = (
    "PowBackward",
    "SubBackward",
    "MulBackward",
    "AbsBackward",
    "ToCopyBackward",
    "ViewBackward",
    "UnsqueezeBackward",
    "ExpandBackward",
    "AddBackward",
    "MvBackward",
    "TBackward",
)
_DEPTH = 6


class Statistic:
    """A reduction below a denominator: its kind and the graph nodes of the tensor it reduces."""

    def __init__(self, kind: str, sources: dict[int, Any]) -> None:
        self.kind = kind
        self.sources = sources


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


# Ops that divide by what they read, or read a statistic to divide by: a creation here may be a normalization.
_DIVIDES = frozenset({"div", "div_", "true_divide", "reciprocal", "rsqrt", "rsqrt_", "sqrt", "sqrt_", "var", "std"})
_NORMALIZED_BY = frozenset({"mul", "mul_", "div", "div_", "true_divide"})
_WATCH = 8  # ops after an rsqrt/var creation within which its use as a normalizer is looked for
# Graph reads that fail on an exotic tensor: nanguard's own failure never stops the replay.
_FAILS = (RuntimeError, AttributeError, TypeError, ValueError)


def _short(op: str | None) -> str:
    return (op or "").removeprefix("aten.").split(".")[0]


class NormalizationWatch:
    """Sets an origin's ``statistic`` and ``normalizes`` facts: at its creation for a division, or
    when its value is used (an rsqrt, sqrt, var or std that goes on to scale the tensor it came from).

    Example:
        >>> watch = NormalizationWatch()
        >>> watch.created(origin, [x_var])                  # rsqrt(mean(x**2)) made Inf: pending
        >>> watch.used("aten.mul.Tensor", [x, r], taint={origin.id}, taint_of=tracer.taint.taint_of)
        >>> origin.extra["normalizes"]
        True
    """

    def __init__(self) -> None:
        self.pending: dict[int, tuple[Any, Statistic, int]] = {}  # origin id -> (origin, statistic, ops left)

    def created(self, origin: Any, flat_args: list[Any]) -> None:
        op = _short(origin.op)
        if op not in _DIVIDES:
            return
        tensors = [t for t in flat_args if isinstance(t, torch.Tensor) and t.is_floating_point()]
        with contextlib.suppress(*_FAILS):
            if tensors:
                self._created(origin, op, tensors)

    def _created(self, origin: Any, op: str, tensors: list[torch.Tensor]) -> None:
        if op in ("var", "std"):
            stat = statistic_from(tensors[0], "variance" if op == "var" else "std")
        else:
            stat = statistic_of(tensors[-1])
        if stat is None:
            if any(node_of(t) is not None for t in tensors):
                origin.extra["normalizes"] = False  # the graph was there, and shows no statistic
            return
        origin.extra["statistic"] = stat.kind
        if op.startswith(("div", "true_divide")) and len(tensors) > 1:
            # A numerator that is itself a reduction (a masked sum over a count) is a mean, not a normalization.
            num = tensors[0]
            origin.extra["normalizes"] = _name(node_of(num)) not in _REDUCTIONS and shares_source(stat, num)
        else:
            # An rsqrt, sqrt, var or std: whether it normalizes shows when its result is used.
            origin.extra["normalizes"] = False
            self.pending[origin.id] = (origin, stat, _WATCH)

    def used(
        self, op: str, flat_in: Sequence[Any], taint: frozenset[int], taint_of: Callable[[torch.Tensor], frozenset[int]]
    ) -> None:
        """An op read a value carrying ``taint``: does it multiply or divide the tensor a pending
        statistic was computed from by it (``x * rsqrt(mean(x**2))``)?"""
        for oid in [o for o in taint if o in self.pending]:
            origin, stat, left = self.pending.pop(oid)
            with contextlib.suppress(*_FAILS):
                if _short(op) in _NORMALIZED_BY and any(
                    isinstance(x, torch.Tensor) and oid not in taint_of(x) and shares_source(stat, x) for x in flat_in
                ):
                    origin.extra["normalizes"] = True
                    continue
            if left > 1:
                self.pending[oid] = (origin, stat, left - 1)
