"""Micro-batches: a mini-batch scattered along dim 0 into M pieces, and outputs gathered back.

A batch is any nest of tuples, lists, dicts (and other mappings, such as Hugging Face's ``BatchEncoding``),
namedtuples and dataclasses. Every tensor leaf with at least one dimension is split along dim 0; other leaves
(numbers, strings, 0-d tensors, None) are handed to every micro-batch.
N samples in M micro-batches give sizes that differ by at most one; N < M gives N micro-batches of one sample.

Each micro-batch carries ``weight = size / N``: summing ``weight * loss`` over micro-batches of a mean-reduced loss
gives exactly the full-batch loss, and therefore the full-batch gradient, even when the sizes are unequal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_gpipe.structure import flatten, leaf_paths, unflatten

__all__ = ["Microbatch", "batch_size", "gather", "scatter", "validate_chunks"]


@dataclass(frozen=True)
class Microbatch:
    """One slice of a mini-batch: its position, its value (same structure as the batch), size and loss weight."""

    index: int
    value: Any
    size: int
    weight: float


def validate_chunks(chunks: object) -> int:
    """Return ``chunks`` if it is a positive int, else raise with the value and the fix."""
    if isinstance(chunks, bool) or not isinstance(chunks, int):
        raise TypeError(
            f"chunks={chunks!r} must be an int: the number of micro-batches M per mini-batch, e.g. chunks=8"
        )
    if chunks < 1:
        raise ValueError(
            f"chunks={chunks} must be at least 1: it is the number of micro-batches M per mini-batch; "
            "use chunks >= 4 * pipe_size to keep the pipeline bubble small"
        )
    return chunks


def _splittable(leaf: object) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() > 0


def batch_size(batch: Any) -> int:
    """The number of samples in ``batch``: the common dim-0 size of its tensor leaves."""
    leaves, spec = flatten(batch)
    sizes = {
        path: leaf.shape[0] for path, leaf in zip(leaf_paths(spec, "batch"), leaves, strict=True) if _splittable(leaf)
    }
    if not sizes:
        raise TypeError(
            f"cannot split a batch of type {type(batch).__name__} into micro-batches: it holds no tensor with a batch "
            "dimension; return tensors (or tuples, lists, dicts, dataclasses of tensors) from the DataLoader"
        )
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{path}: {size}" for path, size in sizes.items())
        raise ValueError(
            f"the tensors of a batch must share their dim-0 size to be split into micro-batches, got {listing}; "
            "wrap per-batch constants in a 0-d tensor or a plain Python value so that they are not split"
        )
    return next(iter(sizes.values()))


def scatter(batch: Any, chunks: int) -> list[Microbatch]:
    """Split ``batch`` along dim 0 into ``min(chunks, N)`` micro-batches whose sizes differ by at most one."""
    validate_chunks(chunks)
    total = batch_size(batch)
    if total == 0:
        raise ValueError("cannot split an empty batch (0 samples) into micro-batches; drop empty batches upstream")
    count = min(chunks, total)
    leaves, spec = flatten(batch)
    pieces = [torch.tensor_split(leaf, count) if _splittable(leaf) else None for leaf in leaves]
    microbatches = []
    for index in range(count):
        parts = [leaf if piece is None else piece[index] for leaf, piece in zip(leaves, pieces, strict=True)]
        size = next(piece[index].shape[0] for piece in pieces if piece is not None)
        microbatches.append(Microbatch(index, unflatten(parts, spec), size, size / total))
    return microbatches


def gather(values: Sequence[Any]) -> Any:
    """Join per-micro-batch values of one structure: tensors concatenated along dim 0 (0-d tensors stacked),
    other leaves collected into a list in micro-batch order."""
    if not values:
        raise ValueError("nothing to gather: no micro-batch values were given")
    flat = [flatten(value) for value in values]
    spec = flat[0][1]
    if any(other != spec for _leaves, other in flat[1:]):
        raise ValueError("cannot gather micro-batch values of different structures")
    columns = zip(*(leaves for leaves, _spec in flat), strict=True)
    joined: list[Any] = []
    for column in columns:
        if all(isinstance(leaf, torch.Tensor) for leaf in column):
            joined.append(torch.stack(column) if column[0].dim() == 0 else torch.cat(column))
        else:
            joined.append(list(column))
    return unflatten(joined, spec)
