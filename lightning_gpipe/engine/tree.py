"""Nested values (tuples, lists, dicts and other mappings, namedtuples, dataclasses) flattened to leaves and rebuilt.

Batches and the values that cross a stage boundary are arbitrary nests of containers. Micro-batching and transport
only care about the leaves, so they flatten a value into its leaves plus a :data:`Spec` that rebuilds it. A spec is
made of tuples, strings and classes only, so it pickles and compares by value: two values with equal specs have the
same container structure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

__all__ = ["LEAF", "Spec", "flatten", "leaf_paths", "map_tensors", "unflatten"]

Spec = Any  # LEAF, or (kind, type, keys, children): see _flatten
LEAF = "*"
"""The placeholder that stands for one tensor in a structure's skeleton."""


def _is_namedtuple(value: object) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _flatten(value: Any, leaves: list[Any], is_leaf: Callable[[Any], bool] | None) -> Spec:
    if is_leaf is not None and is_leaf(value):
        leaves.append(value)
        return LEAF
    if _is_namedtuple(value):
        return ("namedtuple", type(value), (), tuple(_flatten(item, leaves, is_leaf) for item in value))
    if type(value) in (tuple, list):  # exact types: subclasses such as torch.Size stay leaves
        return (type(value).__name__, None, (), tuple(_flatten(item, leaves, is_leaf) for item in value))
    if isinstance(value, dict):
        keys = tuple(value)
        return ("dict", type(value), keys, tuple(_flatten(value[key], leaves, is_leaf) for key in keys))
    if isinstance(value, Mapping):  # collections.UserDict, and Hugging Face's BatchEncoding, which is one
        keys = tuple(value)
        return ("mapping", type(value), keys, tuple(_flatten(value[key], leaves, is_leaf) for key in keys))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = tuple(field.name for field in dataclasses.fields(value) if field.init)
        children = tuple(_flatten(getattr(value, name), leaves, is_leaf) for name in names)
        return ("dataclass", type(value), names, children)
    leaves.append(value)
    return LEAF


def flatten(value: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], Spec]:
    """Split ``value`` into its leaves (depth first, in container order) and the spec that rebuilds it.

    A container for which ``is_leaf`` returns true is kept whole, as one leaf (micro-batching splits a list of
    per-sample strings as one value).
    """
    leaves: list[Any] = []
    spec = _flatten(value, leaves, is_leaf)
    return leaves, spec


def unflatten(leaves: Sequence[Any], spec: Spec) -> Any:
    """Rebuild the value that :func:`flatten` split into ``spec``, with ``leaves`` in place of the original leaves."""
    iterator = iter(leaves)
    value = _unflatten(iterator, spec)
    if next(iterator, _END) is not _END:
        raise ValueError(f"{len(leaves)} leaves given, but the structure has fewer")
    return value


_END = object()


def _unflatten(leaves: Iterator[Any], spec: Spec) -> Any:
    if spec == LEAF:
        leaf = next(leaves, _END)
        if leaf is _END:
            raise ValueError("too few leaves for the structure")
        return leaf
    kind, cls, keys, children = spec
    items = [_unflatten(leaves, child) for child in children]
    if kind == "tuple":
        return tuple(items)
    if kind == "list":
        return items
    if kind == "namedtuple":
        return cls(*items)
    if kind == "dict":
        return cls(zip(keys, items, strict=True))
    if kind == "mapping":
        return _mapping(cls, dict(zip(keys, items, strict=True)))
    return cls(**dict(zip(keys, items, strict=True)))


def _mapping(cls: type, items: dict[Any, Any]) -> Any:
    # A mapping class built from a dict of its items, as UserDict and BatchEncoding are; a plain dict for one whose
    # constructor takes something else (a read-only view has none).
    try:
        return cls(items)
    except TypeError:
        return items


def map_tensors(function: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """Apply ``function`` to every tensor leaf of ``value``; other leaves are kept as they are."""
    leaves, spec = flatten(value)
    return unflatten([function(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)


def leaf_paths(spec: Spec, root: str = "value") -> list[str]:
    """Readable paths of the leaves in flatten order (``value[1]['mask']``), for error messages."""
    if spec == LEAF:
        return [root]
    kind, _cls, keys, children = spec
    paths: list[str] = []
    for position, child in enumerate(children):
        if kind in ("dict", "mapping"):
            paths += leaf_paths(child, f"{root}[{keys[position]!r}]")
        elif kind == "dataclass":
            paths += leaf_paths(child, f"{root}.{keys[position]}")
        else:
            paths += leaf_paths(child, f"{root}[{position}]")
    return paths
