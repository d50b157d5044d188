"""Micro-batches: a mini-batch scattered along dim 0 into M pieces, and outputs gathered back.

A batch is any nest of tuples, lists, dicts (and other mappings, such as Hugging Face's ``BatchEncoding``),
namedtuples and dataclasses. Every tensor leaf with at least one dimension is split along dim 0; other leaves
(numbers, strings, 0-d tensors, None, and whatever is wrapped in :class:`~lightning_gpipe.Unbatched`) are handed to
every micro-batch.
N samples in M micro-batches give sizes that differ by at most one; N < M gives N micro-batches of one sample.

Each micro-batch carries ``weight = size / N``: summing ``weight * loss`` over micro-batches of a mean-reduced loss
gives exactly the full-batch loss, and therefore the full-batch gradient, even when the sizes are unequal. A loss
that is a mean over something else (the real tokens of padded sequences) reports that count, and
:func:`loss_weights` weighs the micro-batches by it instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_gpipe.structure import flatten, leaf_paths, unflatten
from lightning_gpipe.unbatched import unbatched_leaves

__all__ = [
    "Microbatch",
    "batch_size",
    "count_weights",
    "gather",
    "loss_weights",
    "scatter",
    "split_batch",
    "step_extras",
    "validate_chunks",
]


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


def _split_flags(leaves: Sequence[Any], spec: Any) -> list[bool]:
    """Which leaves carry the batch dimension: tensors of at least one dimension not marked :class:`Unbatched`."""
    return [_splittable(leaf) and not marked for leaf, marked in zip(leaves, unbatched_leaves(spec), strict=True)]


def batch_size(batch: Any) -> int:
    """The number of samples in ``batch``: the common dim-0 size of its tensor leaves (:class:`Unbatched` aside)."""
    leaves, spec = flatten(batch)
    paths = leaf_paths(spec, "batch")
    split = _split_flags(leaves, spec)
    sizes = {path: leaf.shape[0] for path, leaf, flag in zip(paths, leaves, split, strict=True) if flag}
    if not sizes:
        raise TypeError(
            f"cannot split a batch of type {type(batch).__name__} into micro-batches: it holds no tensor with a batch "
            "dimension; return tensors (or tuples, lists, dicts, dataclasses of tensors) from the DataLoader"
        )
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{path}: {size}" for path, size in sizes.items())
        raise ValueError(
            f"the tensors of a batch must share their dim-0 size to be split into micro-batches, got {listing}; "
            "a tensor without a batch dimension (an attention bias, a rotary cache, a step counter) must be marked: "
            "wrap it in lightning_gpipe.Unbatched(tensor) and every micro-batch gets it whole"
        )
    return next(iter(sizes.values()))


def scatter(batch: Any, chunks: int) -> list[Microbatch]:
    """Split ``batch`` along dim 0 into ``min(chunks, N)`` micro-batches whose sizes differ by at most one."""
    return split_batch(batch, validate_chunks(chunks))


def split_batch(batch: Any, chunks: int) -> list[Microbatch]:
    """:func:`scatter` for a ``chunks`` validated once already (a :class:`~lightning_gpipe.config.PipelineConfig`'s),
    as the engine splits every step's batch."""
    total = batch_size(batch)
    if total == 0:
        raise ValueError("cannot split an empty batch (0 samples) into micro-batches; drop empty batches upstream")
    count = min(chunks, total)
    leaves, spec = flatten(batch)
    split = _split_flags(leaves, spec)
    pieces = [torch.tensor_split(leaf, count) if flag else None for leaf, flag in zip(leaves, split, strict=True)]
    microbatches = []
    for index in range(count):
        parts = [leaf if piece is None else piece[index] for leaf, piece in zip(leaves, pieces, strict=True)]
        size = next(piece[index].shape[0] for piece in pieces if piece is not None)
        microbatches.append(Microbatch(index, unflatten(parts, spec), size, size / total))
    return microbatches


def gather(values: Sequence[Any]) -> Any:
    """Join per-micro-batch values of one structure back into the batch's value.

    Tensors with a batch dimension are concatenated along dim 0. A value that is not per-sample (a Python scalar,
    a string, a 0-d tensor, None, a tensor wrapped in :class:`~lightning_gpipe.Unbatched`) and equal in every
    micro-batch is kept as it is, once; one that differs between micro-batches becomes the list of the micro-batches'
    values (tensors: stacked along a new dim 0 of M entries), in order.
    """
    if not values:
        raise ValueError("nothing to gather: no micro-batch values were given")
    flat = [flatten(value) for value in values]
    spec = flat[0][1]
    if any(other != spec for _leaves, other in flat[1:]):
        raise ValueError("cannot gather micro-batch values of different structures")
    columns = zip(*(leaves for leaves, _spec in flat), strict=True)
    joined: list[Any] = []
    for column, marked in zip(columns, unbatched_leaves(spec), strict=True):
        if not marked and all(_splittable(leaf) for leaf in column):
            joined.append(torch.cat(column))
        elif all(_same(leaf, column[0]) for leaf in column[1:]):
            joined.append(column[0])
        elif all(isinstance(leaf, torch.Tensor) for leaf in column):
            joined.append(torch.stack(column))
        else:
            joined.append(list(column))
    return unflatten(joined, spec)


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a, b))
        )
    try:
        return bool(a == b)
    except Exception:  # a value whose == is not a truth value (e.g. an array): not collapsible
        return False


def loss_weights(outputs: Sequence[Any], microbatches: Sequence[Microbatch], device: torch.device) -> torch.Tensor:
    """Each micro-batch's share of the batch's loss: the ``loss_weight`` its step returned, or its share of samples.

    A loss that is a mean over something other than samples (the non-padding tokens of an ``ignore_index`` loss)
    reports its normalizer as ``{"loss": ..., "loss_weight": n}``; weighting micro-batch ``i`` by ``n_i / sum(n)``
    then gives exactly the whole batch's mean. Without ``loss_weight`` the weights are ``size / N``. The result is a
    float64 tensor of one weight per micro-batch on ``device``, computed without reading a value on the host.
    """
    given = [isinstance(output, Mapping) and "loss_weight" in output for output in outputs]
    if not any(given):
        return torch.tensor([mb.weight for mb in microbatches], dtype=torch.float64, device=device)
    if not all(given):
        raise ValueError(
            f"the step returned 'loss_weight' for {sum(given)} of {len(given)} micro-batches; return it for every "
            "batch (the number of elements the loss averages over, e.g. the batch's non-padding tokens)"
        )
    return count_weights([output["loss_weight"] for output in outputs], device)


def count_weights(counts: Sequence[Any], device: torch.device) -> torch.Tensor:
    """Micro-batch ``i``'s share ``n_i / sum(n)`` of a mean over ``sum(n)`` elements, given each one's count ``n_i``.

    A count is a number or a one-element tensor (``loss_weight``); the result is a float64 tensor on ``device``,
    computed without reading a value on the host.
    """
    tensors = [torch.as_tensor(count, device=device) for count in counts]
    if any(count.numel() != 1 or count.is_complex() for count in tensors):
        shapes = sorted({tuple(count.shape) for count in tensors if count.numel() != 1})
        raise ValueError(
            "'loss_weight' must be one real number per batch (the number of elements the loss averages over), got "
            f"values of shape {shapes[0] if shapes else 'complex'}; return e.g. (target != ignore_index).sum()"
        )
    weights = torch.stack([count.reshape(()) for count in tensors]).to(torch.float64)
    return weights / weights.sum()


def step_extras(outputs: Sequence[Any]) -> dict[str, Any] | None:
    """The keys other than ``"loss"`` of the dicts a ``training_step`` returned per micro-batch, gathered, detached.

    What Lightning hands ``on_train_batch_end`` next to the loss, joined as :func:`gather` joins values: per-sample
    tensors concatenated (the batch's, as a plain step would return them), a value equal in every micro-batch once,
    others one per micro-batch. ``None`` when the step returned no other key.
    """
    extras = [{k: v for k, v in output.items() if k != "loss"} for output in outputs if isinstance(output, Mapping)]
    if len(extras) != len(outputs) or not any(extras):
        return None
    keys = [sorted(extra) for extra in extras]
    if any(other != keys[0] for other in keys[1:]):
        raise ValueError(
            f"training_step returned dicts with different keys for the micro-batches of one batch ({keys[0]} and "
            f"{next(other for other in keys if other != keys[0])}); return the same keys for every batch"
        )
    joined = gather(extras)
    return {key: value.detach() if isinstance(value, torch.Tensor) else value for key, value in joined.items()}
