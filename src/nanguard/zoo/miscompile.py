"""A planted miscompile: a ``torch.compile`` backend that compiles each graph with a real backend and,
when asked, turns the outputs of the graphs that hold a given module into NaN.

It stands in for the compiler bugs users report (loss NaN from the first steps under inductor while
eager is fine: pytorch/pytorch #114109, #169082), deterministically, so ``compile.numerics`` can be
tested and timed: the eager replay of such a step is finite, its compiled replay is not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["miscompiling"]


def miscompiling(module: str, when: Callable[[], bool], inner: Any = None) -> Callable[..., Any]:
    """A backend: graphs whose nodes come from ``module`` (as in ``named_modules()``) output NaN while
    ``when()`` is true; ``inner`` compiles every graph (a backend name or compiler function; None runs
    the graph as captured).

    Example:
        >>> state = {"bad": False}
        >>> compiled = torch.compile(model, backend=miscompiling("blocks.1", lambda: state["bad"], "inductor"))
    """
    dotted = module.replace("[", ".").replace("]", "")

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        stacks = [str(v[0]) for n in gm.graph.nodes for v in (n.meta.get("nn_module_stack") or {}).values()]
        hit = any(dotted in s.replace("[", ".").replace("]", "").replace("..", ".") for s in stacks)
        compiled = gm
        if inner is not None:
            from nanguard import compat

            compiled = compat.lookup_backend(inner)(gm, example_inputs)

        def run(*args: Any) -> Any:
            out = compiled(*args)
            if hit and when():
                out = [o * math.nan if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in out]
            return out

        return run

    return backend
