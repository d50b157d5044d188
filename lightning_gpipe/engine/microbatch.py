"""Micro-batches: a mini-batch scattered along dim 0 into M pieces, and outputs gathered back.

A batch is any nest of tuples, lists, dicts (and other mappings, such as Hugging Face's ``BatchEncoding``),
namedtuples and dataclasses. Its size N is the common dim 0 of its tensors of at least one dimension, and each
micro-batch gets its rows of every such tensor. A list or tuple of plain values (strings, ids, or nests of them: no
tensor with a batch dimension inside) whose length is N holds one value per sample, as a text column from
``default_collate`` or a Hugging Face dataset does, and is split with the rows. A list of another length whose items
are all containers is looked into (``default_collate`` gives a per-sample list of L strings as L tuples of N
strings); other lists of plain values are refused rather than handed whole to every micro-batch: one of another
length, and a list of N lists of N, whose level of samples cannot be told. A value that is not per-sample is marked
by wrapping it in :class:`~lightning_gpipe.Unbatched`. Other leaves (numbers, strings, 0-d tensors, None, and
whatever is marked) are handed to every micro-batch.
N samples in M micro-batches give sizes that differ by at most one; N < M gives N micro-batches of one sample.

Each micro-batch carries ``weight = size / N``: summing ``weight * loss`` over micro-batches of a mean-reduced loss
gives exactly the full-batch loss, and therefore the full-batch gradient, even when the sizes are unequal. A loss
that is a mean over something else (the real tokens of padded sequences) reports that count, and
:func:`loss_weights` weighs the micro-batches by it instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from lightning_gpipe.engine.tree import LEAF, Spec, flatten, leaf_paths, unflatten
from lightning_gpipe.engine.unbatched import Unbatched, unbatched_leaves

__all__ = [
    "Microbatch",
    "batch_size",
    "count_weights",
    "gather",
    "loss_weights",
    "microbatch_sizes",
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
        raise TypeError(f"chunks={chunks!r} must be an int (micro-batches per mini-batch), e.g. chunks=8")
    if chunks < 1:
        raise ValueError(f"chunks={chunks} must be at least 1; 4 * pipe_size or more keeps the bubble small")
    return chunks


def microbatch_sizes(total: int, chunks: int) -> list[int]:
    """The sizes of the micro-batches a batch of ``total`` samples is split into with ``chunks``: ``min(chunks,
    total)`` of them, differing by at most one, the larger first (as ``torch.tensor_split`` makes them).

    The one rule of the micro-batch count: the engine's split, the timeline callback and the planner read it.
    """
    count = min(chunks, total)
    return [total // count + (index < total % count) for index in range(count)]


def _splittable(leaf: object) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() > 0


def _sequence(value: object) -> bool:
    return type(value) in (list, tuple)  # exact types, as in structure: a namedtuple is a record, not a sequence


def _plain_items(value: Any) -> tuple[bool, ...] | None:
    """For a non-empty list or tuple with neither a tensor of a batch dimension nor an ``Unbatched`` value inside:
    whether each item is a plain value (not a container). ``None`` for anything else."""
    if not _sequence(value) or not value:
        return None
    leaves, spec = flatten(value)
    if any(_splittable(leaf) for leaf in leaves) or any(unbatched_leaves(spec)):
        return None
    return tuple(child == LEAF for child in spec[3])  # spec: (kind, type, keys, children)


def _rows_leaf(size: int) -> Callable[[Any], bool]:
    """What to keep whole when flattening a value of ``size`` samples: its lists of plain values that are per-sample
    (``size`` long) or that hold a plain value themselves (not per-sample: refused in a batch)."""

    def is_leaf(value: Any) -> bool:
        items = _plain_items(value)
        return items is not None and (len(value) == size or any(items))

    return is_leaf


def _tensor_rows(batch: Any) -> int:
    """The common dim-0 size of the tensors of ``batch`` that have one (:class:`Unbatched` aside)."""
    leaves, spec = flatten(batch)
    sizes = {
        path: leaf.shape[0]
        for path, leaf, marked in zip(leaf_paths(spec, "batch"), leaves, unbatched_leaves(spec), strict=True)
        if _splittable(leaf) and not marked
    }
    if not sizes:
        raise TypeError(
            f"cannot split a batch of type {type(batch).__name__}: it holds no tensor with a batch dimension (lists "
            "are split with one, not alone); give it one"
        )
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{path}: {size}" for path, size in sizes.items())
        raise ValueError(
            f"the tensors of a batch must share their dim-0 size, got {listing}; wrap a tensor without a batch "
            "dimension in Unbatched(tensor)"
        )
    return next(iter(sizes.values()))


def _check_rows(path: str, rows: list[Any] | tuple[Any, ...], total: int) -> None:
    """Refuse a list of plain values in a batch of ``total`` samples unless it is unambiguously one per sample."""
    kind = type(rows).__name__
    if len(rows) != total:
        raise ValueError(
            f"{path} is a {kind} of {len(rows)} values in a batch of {total} samples, not one per sample: wrap it in "
            "Unbatched(...)"
        )
    if total > 1 and all(_sequence(item) and len(item) == total for item in rows):
        raise ValueError(
            f"{path} is a {kind} of {total} {type(rows[0]).__name__}s of {total} values in a batch of {total} samples: "
            "which level is per-sample cannot be told; give tensors, or another batch size"
        )


def _layout(batch: Any) -> tuple[int, list[Any], Spec, list[bool]]:
    """The batch's size N, its leaves with its per-sample lists kept whole, their spec, and which leaves are split."""
    total = _tensor_rows(batch)
    leaves, spec = flatten(batch, _rows_leaf(total))
    split = []
    for path, leaf, marked in zip(leaf_paths(spec, "batch"), leaves, unbatched_leaves(spec), strict=True):
        if _sequence(leaf) and not marked:  # a list kept whole: plain values, per-sample or refused
            _check_rows(path, leaf, total)
        split.append(not marked and (_sequence(leaf) or _splittable(leaf)))
    return total, leaves, spec, split


def batch_size(batch: Any) -> int:
    """The number of samples in ``batch``: the common dim-0 size of its tensor leaves (:class:`Unbatched` aside).

    Its lists of plain values are checked against it: one that cannot be split with the rows is refused here.
    """
    return _layout(batch)[0]


def scatter(batch: Any, chunks: int) -> list[Microbatch]:
    """Split ``batch`` along dim 0 into ``min(chunks, N)`` micro-batches whose sizes differ by at most one."""
    return split_batch(batch, validate_chunks(chunks))


def split_batch(batch: Any, chunks: int) -> list[Microbatch]:
    """:func:`scatter` for a ``chunks`` validated once already (a
    :class:`~lightning_gpipe.engine.config.PipelineConfig`'s), as the engine splits every step's batch."""
    total, leaves, spec, split = _layout(batch)
    if total == 0:
        raise ValueError("cannot split an empty batch (0 samples); drop empty batches")
    sizes = microbatch_sizes(total, chunks)
    starts = list(accumulate(sizes, initial=0))
    microbatches = []
    for index, size in enumerate(sizes):
        rows = slice(starts[index], starts[index + 1])
        parts = [leaf[rows] if flag else leaf for leaf, flag in zip(leaves, split, strict=True)]
        microbatches.append(Microbatch(index, unflatten(parts, spec), size, size / total))
    return microbatches


def gather(values: Sequence[Any], sizes: Sequence[int] | None = None) -> Any:
    """Join per-micro-batch values of one structure back into the batch's value.

    Tensors with a batch dimension are concatenated along dim 0, and so, given the micro-batches' ``sizes``, are the
    lists and tuples holding no such tensor that are as long as their micro-batch in every one (a step's per-sample
    strings). A value that is not per-sample (a Python scalar, a string, a 0-d tensor, None, a value wrapped in
    :class:`~lightning_gpipe.Unbatched`) and equal in every micro-batch is kept as it is, once; one that differs
    between micro-batches becomes the list of the micro-batches' values (tensors: stacked along a new dim 0 of M
    entries), in order.
    """
    if not values:
        raise ValueError("nothing to gather: no micro-batch values were given")
    if sizes is not None and len(sizes) != len(values):
        raise ValueError(f"gather was given {len(values)} micro-batch values but {len(sizes)} sizes; give one each")
    return _join(list(values), sizes, marked=False)


def _one_level(value: Any) -> tuple[list[Any], Spec]:
    """The items of the container ``value`` and its spec, one level deep; ``[value]`` and ``LEAF`` for a leaf."""
    return flatten(value, lambda node: node is not value)


def _per_sample(value: Any, size: int) -> bool:
    return _plain_items(value) is not None and len(value) == size


def _join(column: list[Any], sizes: Sequence[int] | None, marked: bool) -> Any:
    """One value as every micro-batch holds it, joined (see :func:`gather`); ``marked`` inside an ``Unbatched``."""
    if not marked and all(_splittable(value) for value in column):
        return torch.cat(column)
    if not marked and sizes is not None and all(map(_per_sample, column, sizes)):
        return type(column[0])(item for value in column for item in value)
    # One level down, top-down: the outermost per-sample list is the one concatenated.
    levels = [_one_level(value) for value in column]
    spec = levels[0][1]
    if any(other != spec for _children, other in levels[1:]):
        raise ValueError("cannot gather micro-batch values of different structures")
    if spec != LEAF:
        inside = marked or spec[1] is Unbatched
        children = zip(*(children for children, _spec in levels), strict=True)
        return unflatten([_join(list(child), sizes, inside) for child in children], spec)
    if all(_same(value, column[0]) for value in column[1:]):
        return column[0]
    if all(isinstance(value, torch.Tensor) for value in column):
        return torch.stack(column)
    return list(column)


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
            f"the step returned 'loss_weight' for {sum(given)} of {len(given)} micro-batches; return it for all"
        )
    return count_weights([output["loss_weight"] for output in outputs], microbatches, device)


def count_weights(counts: Sequence[Any], microbatches: Sequence[Microbatch], device: torch.device) -> torch.Tensor:
    """Micro-batch ``i``'s share ``n_i / sum(n)`` of a mean over ``sum(n)`` elements, given each one's count ``n_i``.

    A count is a number or a one-element tensor (``loss_weight``); the result is a float64 tensor on ``device``,
    computed without reading a value on the host. Counts that sum to zero (nothing to average over: every label of the
    batch ignored) give each micro-batch its share of the samples instead of ``0 / 0``: a loss the module keeps finite
    for such a batch (``sum / max(n, 1)``, which is 0) then stays 0 in the step and its logs, as on one device.
    """
    tensors = [torch.as_tensor(count, device=device) for count in counts]
    if any(count.numel() != 1 or count.is_complex() for count in tensors):
        shapes = sorted({tuple(count.shape) for count in tensors if count.numel() != 1})
        raise ValueError(
            f"'loss_weight' must be one real number per batch, not of shape {shapes[0] if shapes else 'complex'}; "
            "e.g. (target != ignore_index).sum()"
        )
    weights = torch.stack([count.reshape(()) for count in tensors]).to(torch.float64)
    total = weights.sum()
    by_samples = torch.tensor([mb.weight for mb in microbatches], dtype=torch.float64, device=device)
    return torch.where(total == 0, by_samples, weights / total)  # the 0 / 0 of an empty batch is never chosen


def step_extras(outputs: Sequence[Any], sizes: Sequence[int] | None = None) -> dict[str, Any] | None:
    """The keys other than ``"loss"`` of the dicts a training step returned per micro-batch, gathered, detached.

    What the strategy hands ``on_train_batch_end`` next to the loss, joined as :func:`gather` joins values of
    micro-batches of ``sizes``: per-sample tensors and lists concatenated (the batch's, as a plain step would return
    them), a value equal in every micro-batch once, others one per micro-batch. ``None`` when the step returned no
    other key.
    """
    extras = [{k: v for k, v in output.items() if k != "loss"} for output in outputs if isinstance(output, Mapping)]
    if len(extras) != len(outputs) or not any(extras):
        return None
    keys = [sorted(extra) for extra in extras]
    if any(other != keys[0] for other in keys[1:]):
        raise ValueError(
            f"the step returned different keys for the micro-batches of one batch ({keys[0]} and "
            f"{next(other for other in keys if other != keys[0])}); return the same ones"
        )
    joined = gather(extras, sizes)
    return {key: value.detach() if isinstance(value, torch.Tensor) else value for key, value in joined.items()}
