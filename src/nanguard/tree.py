"""Nested inputs walked one way, with the key paths of ``torch.utils._pytree``.

A batch, a model output or a step's result nests mappings (``dict``, ``BatchEncoding``,
``ModelOutput``), lists, tuples, namedtuples and dataclasses. Every part of nanguard that
looks inside one uses this module, so a tensor has one path everywhere:
``batch['input_ids']``, ``batch[0]``, ``batch.pixel_values``.

Paths are pytree key paths printed by ``keystr``: ``MappingKey`` for mapping keys,
``SequenceKey`` for positions, ``GetAttrKey`` for namedtuple and dataclass fields. The walk
goes beyond pytree's registry, which leaves any mapping subclass or dataclass it was not
told about as a single leaf; types registered with pytree are walked as registered. Cycles
and nesting deeper than ``MAX_DEPTH`` stop the walk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._pytree import GetAttrKey, MappingKey, SequenceKey

__all__ = [
    "MAX_DEPTH",
    "GetAttrKey",
    "KeyPath",
    "MappingKey",
    "SequenceKey",
    "children",
    "is_container",
    "leaves_with_path",
    "map_leaves",
    "nearest_name",
    "op_leaves",
    "path_str",
    "tensors",
    "tensors_with_path",
]

KeyPath = tuple[Any, ...]  # of pytree key entries
MAX_DEPTH = 32


def children(obj: Any) -> list[tuple[Any, Any]] | None:
    """The ``(key entry, value)`` pairs one level inside ``obj``; ``None`` when it is a leaf.

    Example:
        >>> children({"x": 1})
        [(MappingKey(key='x'), 1)]
    """
    if isinstance(obj, torch.Tensor):
        return None
    if isinstance(obj, Mapping):
        return [(MappingKey(k), v) for k, v in obj.items()]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return [(GetAttrKey(name), v) for name, v in zip(obj._fields, obj, strict=True)]
    if isinstance(obj, (list, tuple)):
        return [(SequenceKey(i), v) for i, v in enumerate(obj)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(GetAttrKey(f.name), getattr(obj, f.name, None)) for f in dataclasses.fields(obj)]
    node = pytree.SUPPORTED_NODES.get(type(obj))
    if node is not None and node.flatten_with_keys_fn is not None:
        return list(node.flatten_with_keys_fn(obj)[0])
    return None


def is_container(obj: Any) -> bool:
    """Does ``obj`` hold other values that the walk looks into?"""
    return children(obj) is not None


def leaves_with_path(obj: Any) -> Iterator[tuple[KeyPath, Any]]:
    """Every leaf of ``obj`` with its key path, depth first in the containers' own order.

    Example:
        >>> [(path_str("batch", kp), leaf) for kp, leaf in leaves_with_path({"a": [1, 2]})]
        [("batch['a'][0]", 1), ("batch['a'][1]", 2)]
    """
    yield from _walk(obj, (), frozenset())


def _walk(obj: Any, path: KeyPath, seen: frozenset[int]) -> Iterator[tuple[KeyPath, Any]]:
    items = children(obj)
    if items is None:
        yield path, obj
        return
    if len(path) >= MAX_DEPTH or id(obj) in seen:
        return
    seen = seen | {id(obj)}
    for key, value in items:
        yield from _walk(value, (*path, key), seen)


def path_str(prefix: str, path: KeyPath) -> str:
    """``prefix`` followed by the key path as pytree prints it: ``batch['x'][0].mask``."""
    return prefix + pytree.keystr(path)


def nearest_name(path: KeyPath) -> str | None:
    """The innermost string key or field name on ``path``: what the value is called."""
    for key in reversed(path):
        if isinstance(key, MappingKey) and isinstance(key.key, str):
            return key.key
        if isinstance(key, GetAttrKey):
            return key.name
    return None


def tensors_with_path(obj: Any, prefix: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor in ``obj`` with its path under ``prefix``.

    Example:
        >>> tensors_with_path({"x": t, "y": [t]}, "batch")
        [("batch['x']", t), ("batch['y'][0]", t)]
    """
    return [(path_str(prefix, kp), x) for kp, x in leaves_with_path(obj) if isinstance(x, torch.Tensor)]


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj``."""
    return [x for _, x in leaves_with_path(obj) if isinstance(x, torch.Tensor)]


def map_leaves(fn: Callable[[Any], Any], obj: Any) -> Any:
    """``obj`` rebuilt with ``fn`` applied to each leaf (pytree's ``tree_map``)."""
    return pytree.tree_map(fn, obj)


def op_leaves(obj: Any, out: list[Any] | None = None) -> list[Any]:
    """Flat leaves of an aten op's arguments or results.

    The tracer calls this several times on every op, where ``pytree.tree_leaves`` costs
    about three times as much; op arguments only nest lists, tuples and dicts, so flat
    arguments take no recursion here.
    """
    out = [] if out is None else out
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else (obj,)
    for x in items:
        if isinstance(x, (list, tuple, dict)):
            op_leaves(x, out)
        else:
            out.append(x)
    return out
