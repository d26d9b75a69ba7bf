"""``torch.compile``d models: replayed eagerly, named as the user wrote them.

A replay under the tracer must not go through dynamo: dynamo would trace the tracer itself
(slow, or a crash), and the aten ops the tracer must see would be hidden in a compiled graph.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator

import torch

__all__ = ["eager", "user_name"]


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Run every ``torch.compile``d function and module inside eagerly, without compiling.

    Example:
        >>> with eager():
        ...     loss = compiled_model(x).sum()   # plain eager ops, module hooks fire
    """
    # Nothing was compiled unless dynamo is loaded; importing it would cost seconds.
    set_stance = getattr(torch.compiler, "set_stance", None) if "torch._dynamo" in sys.modules else None
    if set_stance is None:  # or torch < 2.6, which has no stance: compiled code is traced as before
        yield
        return
    with set_stance("force_eager"), warnings.catch_warnings():
        # The tracer's global module hooks fire on the OptimizedModule too: expected, and harmless.
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        yield


def user_name(name: str) -> str:
    """A qualified module or parameter name as the user wrote the model: the ``_orig_mod``
    level that ``torch.compile`` wraps a module in is left out.

    Example:
        >>> user_name("_orig_mod.head.weight")
        'head.weight'
    """
    if "_orig_mod" not in name:
        return name
    return ".".join(part for part in name.split(".") if part != "_orig_mod")
