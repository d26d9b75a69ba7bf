"""Which module is running: a forward stack from global hooks, names from ``named_modules``."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from types import CodeType, FrameType
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _module_mod

from nanguard import compat

__all__ = ["ModuleStack", "count_as_user_code", "is_user_code", "user_modules", "user_source"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_NANGUARD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_user_dirs: list[str] = []
_LIBRARY_DIRS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
# What a code object is, by the file it comes from: looked up for every frame of every walk. Keyed
# by the file name, whose hash a str keeps (a code object hashes its bytecode and constants each time).
_USER, _INTERNAL, _LIBRARY = 0, 1, 2
_kinds: dict[str, int] = {}


def count_as_user_code(directory: str) -> None:
    """Count the lines of files under ``directory`` as the user's own source, though they ship
    inside nanguard: example models written the way a user writes them (the fault zoo).

    Example:
        >>> count_as_user_code(os.path.dirname(__file__))
    """
    _user_dirs.append(os.path.join(os.path.abspath(directory), ""))
    _kinds.clear()


def _kind(code: CodeType) -> int:
    """Is this code torch's or nanguard's own machinery (never the line a user wants to see),
    an installed library's (site-packages), or the user's own?"""
    name = os.path.abspath(code.co_filename)
    user = name.startswith(tuple(_user_dirs))
    if name.startswith(_TORCH_DIR) or (name.startswith(_NANGUARD_DIR) and not user) or name.startswith("<"):
        kind = _INTERNAL
    elif any(d in name for d in _LIBRARY_DIRS) and not user:
        kind = _LIBRARY
    else:
        kind = _USER
    _kinds[code.co_filename] = kind
    return kind


def is_user_code(code: CodeType) -> bool:
    """Is ``code`` the user's own (not torch's, nanguard's or an installed library's)?"""
    kind = _kinds.get(code.co_filename)
    return (kind if kind is not None else _kind(code)) == _USER


def user_source(skip: int = 1) -> tuple[str | None, str | None]:
    """``(your code, library)``: ``file:line`` of the innermost frame outside torch, nanguard
    and installed libraries, and of the innermost library frame inside it (None when none).

    Example:
        >>> user_source()
        ('train.py:42', '.../site-packages/transformers/loss/loss_utils.py:36')
    """
    frame: FrameType | None = sys._getframe(skip)
    library = None
    kinds = _kinds
    while frame is not None:
        code = frame.f_code
        kind = kinds.get(code.co_filename)
        if kind is None:
            kind = _kind(code)
        if kind == _USER:
            return f"{code.co_filename}:{frame.f_lineno}", library
        if kind == _LIBRARY and library is None:
            library = f"{code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None, library


class ModuleStack:
    """Tracks the innermost running module while installed, by global forward hooks.

    Names are the qualified names of ``root.named_modules()`` as the user wrote the model: the
    levels that wrappers add (DDP's ``module``, ``torch.compile``'s ``_orig_mod``, Fabric's
    ``_forward_module``/``_original_module``, FSDP's and activation checkpointing's wrapped
    module) are left out. With no root, the first outermost module entered becomes the root.
    Modules outside the root are named None. A forward hook registered on a module runs as
    part of that module: it leaves the stack only after its own hooks.
    """

    def __init__(self, root: nn.Module | None = None) -> None:
        self.root = root
        self._names: dict[int, str] | None = None
        self._stack: list[nn.Module] = []
        self._named: list[str | None] = []  # innermost name within the root, per stack level
        self._handles: list[Any] = []
        self._late: dict[int, Any] = {}  # modules with forward hooks of their own: popped after them
        self._eps: dict[int, float | None] = {}
        # The innermost module and its name, kept as attributes: the tracer reads them on every op.
        self.top: nn.Module | None = None
        self.top_name: str | None = None

    def __enter__(self) -> ModuleStack:
        self._handles = [
            _module_mod.register_module_forward_pre_hook(self._push),
            _module_mod.register_module_forward_hook(self._pop, always_call=True),
        ]
        return self

    def enter_within(self, module: nn.Module) -> ModuleStack:
        """Install from inside ``module``'s own forward pre-hook: the global hooks have run for
        this call of it already, so it goes on the stack here."""
        self.__enter__()
        self._push(module, ())
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in [*self._handles, *self._late.values()]:
            handle.remove()
        self._handles, self._late = [], {}
        self._stack.clear()
        self._named.clear()
        self.top = self.top_name = None

    def _push(self, module: nn.Module, args: Any) -> None:
        if self.root is None and not self._stack:
            self.root = module
        self._stack.append(module)
        name = self.name_of(module)
        self._named.append(name if name is not None else self.top_name)
        self.top, self.top_name = module, self._named[-1]
        if id(module) not in self._late and compat.has_forward_hooks(module):
            # Global forward hooks run before the module's own: pop after the last of those instead.
            self._late[id(module)] = module.register_forward_hook(self._pop_late, always_call=True)

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if id(module) not in self._late:
            self._pop_late(module, args, output)

    def _pop_late(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack and self._stack[-1] is module:
            self._stack.pop()
            self._named.pop()
            self.top = self._stack[-1] if self._stack else None
            self.top_name = self._named[-1] if self._named else None

    @property
    def current(self) -> nn.Module | None:
        return self.top

    def name_of(self, module: nn.Module | None) -> str | None:
        if module is None:
            return None
        if self._names is None:
            if self.root is None:
                return None
            self._names = {id(m): n for n, m in user_modules(self.root)}
        return self._names.get(id(module))

    def current_name(self) -> str | None:
        """The innermost running module that belongs to the root's tree."""
        return self.top_name

    def eps(self, module: nn.Module | None) -> float | None:
        """A normalization module's eps, cached for this trace (nn.Module's failing getattr is slow)."""
        if module is None:
            return None
        key = id(module)
        if key not in self._eps:
            self._eps[key] = next((float(v) for v in _eps_values(module) if _is_number(v)), None)
        return self._eps[key]

    def state_name(self, tensor: torch.Tensor) -> str | None:
        """Qualified name of ``tensor`` as a parameter or buffer of the root (``blocks.0.fc.weight``)."""
        if self.root is None:
            return None
        return next((name for name, t in _named_state(self.root) if t is tensor), None)

    def owner_of(self, tensor: torch.Tensor) -> str | None:
        """Qualified name of the module that owns ``tensor`` as a parameter or buffer."""
        name = self.state_name(tensor)
        return name.rpartition(".")[0] if name is not None else None


_EPS_NAMES = ("eps", "variance_epsilon", "epsilon")


def _eps_values(module: nn.Module) -> Iterator[Any]:
    # A number is an instance or class attribute: nn.Module's __getattr__ only finds
    # parameters, buffers and submodules, and raising from it for each miss is slow.
    own, cls = vars(module), type(module)
    for attr in _EPS_NAMES:
        if attr in own:
            yield own[attr]
        elif hasattr(cls, attr):
            yield getattr(module, attr, None)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _named_state(root: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    modules = list(user_modules(root))
    for prefix, module in modules:
        for key, t in module.named_parameters(recurse=False, remove_duplicate=False):
            yield _join(prefix, key), t
    for prefix, module in modules:
        for key, buffer in module.named_buffers(recurse=False, remove_duplicate=False):
            yield _join(prefix, key), buffer


# The attribute under which a wrapper holds the module it wraps: a level of the tree the user
# never wrote. DDP's and DataParallel's ``module`` counts only under those wrappers.
_WRAPPER_ATTRS = frozenset(
    {"_orig_mod", "_forward_module", "_original_module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}
)


def user_modules(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``root.named_modules(remove_duplicate=False)`` with the wrappers' levels left out of the
    names (a wrapper shares the name of the module it wraps).

    Example:
        >>> [n for n, _ in user_modules(DistributedDataParallel(torch.compile(model)))][:3]
        ['', '', '']
    """
    todo: list[tuple[str, nn.Module]] = [("", root)]
    while todo:
        prefix, module = todo.pop()
        yield prefix, module
        wrapper = isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel))
        children = [
            (prefix if attr in _WRAPPER_ATTRS or (wrapper and attr == "module") else _join(prefix, attr), child)
            for attr, child in module.named_children()
        ]
        todo.extend(reversed(children))  # depth first, in registration order, as named_modules


def _join(prefix: str, attr: str) -> str:
    return f"{prefix}.{attr}" if prefix else attr
