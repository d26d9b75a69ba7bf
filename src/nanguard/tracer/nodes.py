"""Where each autograd node's forward ran, so the backward ops it runs can be attributed.

Keyed by the node's sequence number: the module, its type, the forward op, the user's line
(and the library line inside it) and the module's eps, recorded when the forward op made the
node. Without a model, the leaf tensors seen are kept too: their gradients are the results.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nanguard import compat
from nanguard.tracer import ops
from nanguard.tracer.modules import ModuleStack, user_source

__all__ = ["ForwardSites", "Site"]

Site = tuple[str | None, str | None, str | None, str | None, str | None, float | None]
"""(module, module type, forward op, your line, library line, module eps)."""


# The frames of nanguard's own a walk for the user's line starts above: ``user_source`` <- ``note`` <-
# ``Tracer.after_op`` <- ``_TracerMode.__torch_dispatch__`` (the only caller); a frame not skipped is read.
_OWN_FRAMES = 4


class ForwardSites:
    """The forward site of every autograd node made while tracing.

    Example:
        >>> sites = ForwardSites(modules)
        >>> sites.start()                          # when the tracer is entered
        >>> sites.note(info, inputs, backward=False)   # after each op
        >>> sites.of(node)[0]                      # the module its forward ran in
        'blocks.0.attn'
    """

    def __init__(self, modules: ModuleStack) -> None:
        self.modules = modules
        self.nodes: dict[int, Site] = {}
        self.first = 0
        self.leaves: dict[int, torch.Tensor] = {}
        # With a model its parameters' gradients are the results; without one, leaf tensors seen.
        self.track_leaves = modules.root is None

    def start(self) -> None:
        self.first = torch._C._autograd._get_sequence_nr()

    def note(self, facts: ops.OpInfo, ins: Sequence[Any], backward: bool) -> None:
        """Remember which module and line each forward op ran in, keyed by the sequence
        number of the autograd node it creates, so its backward can be attributed.

        Two kinds of node are made where no grad-recording forward op runs: a custom
        ``autograd.Function``'s, made by ``apply`` just before its forward runs with grad
        off, and the nodes of a reentrant checkpoint's forward, re-run inside backward."""
        modules = self.modules
        module = modules.top
        if backward and module is None:
            return  # a backward op; a forward re-run during backward has a module running
        grad = torch.is_grad_enabled()
        # Inside dispatch, autograd has already built this op's node: its number is one less.
        # With grad off no node was built, and one less is the newest node: a Function's.
        seq = compat.autograd_sequence_nr() - 1
        if seq >= self.first and seq not in self.nodes:
            self.nodes[seq] = (
                modules.top_name,
                type(module).__name__ if module is not None else None,
                facts.name if grad else None,
                *user_source(_OWN_FRAMES),
                modules.eps(module),
            )
        if grad and self.track_leaves:
            for x in ins:
                if isinstance(x, torch.Tensor) and x.requires_grad and x.is_leaf:
                    self.leaves[id(x)] = x

    def of(self, node: Any) -> Site:
        """The forward site of ``node``; an AccumulateGrad's is the module owning its parameter."""
        site = self.nodes.get(node._sequence_nr())
        if site is not None:
            return site
        variable = getattr(node, "variable", None)
        owner = self.modules.owner_of(variable) if isinstance(variable, torch.Tensor) else None
        return (owner, None, None, None, None, None)
