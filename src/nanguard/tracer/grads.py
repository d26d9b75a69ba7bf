"""Gradient surgery: ops that read ``.grad`` tensors after ``backward()`` and before ``optimizer.step()``.

PCGrad's projections, a hand-written clip, gradient noise: they run outside the autograd engine,
so no backward node is current, yet they compute the gradients the optimizer gets. ``GradWatch``
knows the gradients once a backward has run (their storages, read again whenever a backward
ends) and follows the tensors computed from them, so such an op gets phase ``backward``
(``optimizer`` when it writes into a parameter: an update written by hand). Before the first
backward it costs one flag test per op.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from nanguard.tracer.taint import storage_key

__all__ = ["GradWatch"]


class GradWatch:
    """Which tensors hold gradients or were computed from them, after a backward.

    ``grads()`` returns the gradients to know, with their names: ``("fc.weight", p.grad)``.

    Example:
        >>> watch = GradWatch(lambda: [(n, p.grad) for n, p in model.named_parameters()])
        >>> watch.before(backward=False, inputs=[model.fc.weight.grad], writes_param=lambda: False)
        >>> watch.phase
        'backward'
    """

    def __init__(self, grads: Callable[[], Iterable[tuple[str, torch.Tensor | None]]]) -> None:
        self._grads = grads
        self.seen_backward = False
        self._in_backward = False
        self._storages: dict[int, str] = {}
        self._derived: dict[int, weakref.ref[torch.Tensor]] = {}
        self.phase: str | None = None
        """The phase of the op being run: "backward" or "optimizer" when it reads gradients, else None."""

    def before(self, backward: bool, inputs: list[Any], writes_param: Callable[[], bool]) -> None:
        """Called for every op before its outputs are checked: is it gradient surgery?"""
        if backward:
            self.seen_backward = self._in_backward = True
            self.phase = None
            return
        if not self.seen_backward:
            return
        if self._in_backward:
            self._in_backward = False
            self._refresh()
        self.phase = None
        for x in inputs:
            if isinstance(x, torch.Tensor) and self._is_grad(x):
                self.phase = "optimizer" if writes_param() else "backward"
                return

    def after(self, outputs: list[torch.Tensor]) -> None:
        """Outputs of a gradient-surgery op hold gradients too (a flattened, projected, clipped copy)."""
        if self.phase is None:
            return
        for o in outputs:
            self._derived[id(o)] = weakref.ref(o)

    def direct(self, inputs: list[Any]) -> list[str]:
        """Names of the parameters whose ``.grad`` is among ``inputs`` (read at a creation only)."""
        found = []
        for x in inputs:
            if isinstance(x, torch.Tensor):
                name = self._storages.get(storage_key(x))
                if name is not None and name not in found:
                    found.append(name)
        return found

    def _is_grad(self, t: torch.Tensor) -> bool:
        ref = self._derived.get(id(t))
        if ref is not None and ref() is t:
            return True
        return bool(self._storages) and storage_key(t) in self._storages

    def _refresh(self) -> None:
        self._storages = {}
        for name, g in self._grads():
            if isinstance(g, torch.Tensor):
                key = storage_key(g)
                if key > 0:
                    self._storages.setdefault(key, name)
