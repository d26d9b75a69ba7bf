"""The user-level torch call running now: ``torch.logdet(w)``, ``F.normalize(x)``, ``h[pad] = nan``.

The dispatch mode sees aten ops only, after torch's own Python and C++ implementations have
decomposed the call the user wrote into them (``torch.logdet`` runs ``_linalg_slogdet``, then
``where(sign == -1, nan, logabsdet)``). A ``TorchFunctionMode`` sees the call itself; inside its
handler the mode is off, so the calls torch makes while implementing it are not seen again: the
call recorded is always the outermost one, the user's (or a library's) own.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from nanguard.stats import tensor_stats
from nanguard.tracer import ops
from nanguard.tree import op_leaves

__all__ = ["UserCalls", "distribution_call"]

# Calls that run the user's own code inside them: what runs within is not torch's implementation.
_RUNS_USER_CODE = frozenset({"backward", "apply", "grad", "checkpoint", "_call_impl", "__call__"})


class UserCalls(TorchFunctionMode):
    """Records the outermost torch function call while it runs.

    Example:
        >>> with UserCalls() as calls:
        ...     torch.logdet(w)      # inside, ``calls.name`` is "logdet" for every aten op it runs
    """

    def __init__(self, on_gradients: Callable[[Any], None] | None = None) -> None:
        super().__init__()
        self.call: tuple[Any, tuple, dict[str, Any]] = (None, (), {})
        """The running call: (function, args, kwargs); (None, (), {}) outside one."""
        self.on_gradients = on_gradients
        """Called with what ``torch.autograd.grad`` returned: gradients that never reach a ``.grad``."""

    @property
    def func(self) -> Any:
        return self.call[0]

    @property
    def args(self) -> tuple:
        return self.call[1]

    @property
    def kwargs(self) -> dict[str, Any]:
        return self.call[2]

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        outer, self.call = self.call, (func, args, kwargs)
        try:
            result = func(*args, **kwargs)
        finally:
            self.call = outer
        if func is torch.autograd.grad and self.on_gradients is not None:
            self.on_gradients(result)
        return result

    @property
    def name(self) -> str | None:
        """The running call's name (``logdet``, ``normalize``, ``__setitem__``), None outside one."""
        if self.func is None:
            return None
        return getattr(self.func, "__name__", None) or str(self.func)

    def implements(self, op_name: str) -> bool:
        """Is the running call torch's own implementation around aten op ``op_name`` (``aten.where.self``),
        rather than the op itself or code of the user's that runs inside a call (a backward, a Function)?"""
        name = self.name
        if name is None or name in _RUNS_USER_CODE:
            return False
        packet = op_name.removeprefix("aten.").split(".")[0]
        return name.strip("_").removesuffix("_") != packet.strip("_").removesuffix("_")

    def passed(self, value: str, tensor: torch.Tensor | None = None) -> bool:
        """Did the user's call get the non-finite ``value`` ("nan", "inf", "-inf") itself, as a
        number or as the very tensor ``tensor``: a write the user asked for?"""
        for x in op_leaves((self.args, self.kwargs)):
            if tensor is not None and x is tensor:
                return True
            if isinstance(x, float) and not math.isfinite(x) and _name(x) == value:
                return True
        return False

    def inside(self, func: Any, value: str, tensor: torch.Tensor | None) -> bool:
        """Was ``value``, written by aten op ``func``, made inside torch's implementation of the
        running call (not given to it by the user)?"""
        return self.implements(ops.op_name(func)) and not self.passed(value, tensor)

    def by_definition(self, internal_op: str | None, value: str) -> tuple[str, dict[str, Any]]:
        """The running call returned ``value`` by its definition: its aten op name and the origin's
        facts (its arguments' statistics, the op inside that made the value, the call's own facts)."""
        user_op = ops.user_op_name(self.name)
        args = op_leaves((self.args, self.kwargs))
        extra = {"internal_op": internal_op, "user_op": self.name, "returned": value}
        extra.update(ops.user_facts(user_op, self.args))
        return user_op, {
            "inputs": [tensor_stats(t) for t in args if isinstance(t, torch.Tensor)],
            "scalars": [x for x in args if isinstance(x, (int, bool)) or (isinstance(x, float) and math.isfinite(x))],
            "extra": extra,
        }


def _name(x: float) -> str:
    return "nan" if math.isnan(x) else "-inf" if x < 0 else "inf"


_DISTRIBUTIONS = os.path.dirname(torch.distributions.__file__) + os.sep


def distribution_call() -> str | None:
    """``Beta.log_prob``: the outermost ``torch.distributions`` method on the stack now (the call the
    user wrote, around the ``xlogy`` its ``Dirichlet`` runs), or None outside one."""
    frame: FrameType | None = sys._getframe(1)
    found = None
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(_DISTRIBUTIONS):
            owner = frame.f_locals.get("self")
            found = f"{type(owner).__name__}.{code.co_name}" if owner is not None else code.co_name
        elif found is not None and not code.co_filename.startswith(_TORCH):
            return found
        frame = frame.f_back
    return found


_TORCH = os.path.dirname(torch.__file__) + os.sep
