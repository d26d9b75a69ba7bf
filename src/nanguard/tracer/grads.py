"""Gradient surgery: ops that read ``.grad`` tensors after ``backward()`` and before ``optimizer.step()``.

PCGrad's projections, a hand-written clip, gradient noise: they run outside the autograd engine,
so no backward node is current, yet they compute the gradients the optimizer gets. ``GradWatch``
knows the gradients once a backward has run (their storages, read again whenever a backward
ends, and what ``torch.autograd.grad`` returned) and follows the tensors computed from them,
so such an op gets phase ``backward`` (``optimizer`` when it writes into a parameter: an update
written by hand). Before the first
backward it costs one flag test per op, and inside a module's forward (the next micro-batch) one more.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from nanguard.tracer import ops
from nanguard.tracer.compiled import user_name
from nanguard.tracer.modules import ModuleStack
from nanguard.tracer.protect import Backup
from nanguard.tracer.taint import storage_key

__all__ = ["GradWatch"]


class GradWatch:
    """Which tensors hold gradients or were computed from them, after a backward.

    The gradients are those of the root module's parameters and of ``leaves`` (the leaf tensors
    the tracer saw, without a model); an op that writes into a tensor ``protected`` keeps is an update.

    Example:
        >>> watch = GradWatch(modules, leaves={}, protected=backup)
        >>> watch.before(True, [], info, (), {})                      # a backward op ran
        >>> watch.before(False, [model.fc.weight.grad], info, (), {})  # then one reads a gradient
        >>> watch.phase
        'backward'
    """

    def __init__(self, modules: ModuleStack, leaves: dict[int, torch.Tensor], protected: Backup) -> None:
        self._modules, self._leaves, self._protected = modules, leaves, protected
        self.seen_backward = False
        self.in_backward = False
        """Inside a backward (its ops ran last): no gradient surgery runs there."""
        self._storages: dict[int, str] = {}
        self._derived: dict[int, weakref.ref[torch.Tensor]] = {}
        self.phase: str | None = None
        """The phase of the op being run: "backward" or "optimizer" when it reads gradients, else None."""

    def before(self, backward: bool, inputs: Sequence[Any], facts: ops.OpInfo, args: tuple, kwargs: dict) -> None:
        """Called for every op (once a backward ran) before its outputs are checked: is it gradient surgery?"""
        if backward:
            self.seen_backward = self.in_backward = True
            self.phase = None
            return
        if not self.seen_backward:
            return
        if self.in_backward:
            self.in_backward = False
            self._refresh()
        self.phase = None
        if self._modules.current is not None:
            return  # a forward (the next micro-batch): gradient surgery runs outside the model
        for x in inputs:
            if isinstance(x, torch.Tensor) and self._is_grad(x):
                self.phase = "optimizer" if self._writes_parameter(facts, args, kwargs) else "backward"
                return

    def produced(self, gradients: Any) -> None:
        """``torch.autograd.grad`` returned ``gradients``: arithmetic on them is gradient surgery too,
        though no ``.grad`` holds them (PCGrad's per-task gradients)."""
        for g in gradients if isinstance(gradients, (list, tuple)) else (gradients,):
            if isinstance(g, torch.Tensor):
                self._derived[id(g)] = weakref.ref(g)
        self.seen_backward = True

    def recheck(self, inputs: Sequence[Any], facts: ops.OpInfo, args: tuple, kwargs: dict) -> None:
        """At a creation, read the gradients afresh: a ``.grad`` assigned after the backward (``p.grad =
        g / g.norm()``) runs no op, so the storages read when the backward ended do not hold it."""
        if not self.seen_backward or self.phase is not None or self.in_backward or self._modules.current is not None:
            return
        self._refresh()
        self.before(False, inputs, facts, args, kwargs)

    def after(self, outputs: list[torch.Tensor]) -> None:
        """Outputs of a gradient-surgery op hold gradients too (a flattened, projected, clipped copy)."""
        if self.phase is None:
            return
        for o in outputs:
            self._derived[id(o)] = weakref.ref(o)

    def facts(self, inputs: list[Any]) -> dict[str, Any]:
        """At a creation by a gradient-surgery op: that it is one, and the parameters whose ``.grad`` it read."""
        if self.phase is None:
            return {}
        found: list[str] = []
        for x in inputs:
            if isinstance(x, torch.Tensor):
                name = self._storages.get(storage_key(x))
                if name is not None and name not in found:
                    found.append(name)
        return {"gradient_surgery": True, "gradients_of": found[:8]} if found else {"gradient_surgery": True}

    def _writes_parameter(self, facts: ops.OpInfo, args: tuple, kwargs: dict) -> bool:
        """Does the op write into a parameter or buffer (an update written by hand)?"""
        for i, name in facts.writes:
            target = args[i] if i < len(args) else kwargs.get(name)
            for t in target if isinstance(target, (list, tuple)) else (target,):
                if isinstance(t, torch.Tensor) and self._protected.protects(t):
                    return True
        return False

    def _grads(self) -> Iterable[tuple[str, torch.Tensor | None]]:
        root = self._modules.root
        if root is not None:
            yield from ((user_name(n), p.grad) for n, p in root.named_parameters())
        yield from ((f"leaf[{i}]", t.grad) for i, t in enumerate(self._leaves.values()))

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
