"""Batch fingerprints: a cheap summary by which the stages of one pipeline check that they read the same batch.

Every stage of a pipeline reads its own copy of each batch: the first stage feeds the inputs into the layers, the
last one computes the loss from the targets. If the copies differ (a sampler per stage, a shuffle seeded by rank),
the pipeline trains on inputs paired with the wrong targets and nothing else notices. Each stage therefore computes
a fingerprint of its batch and sends it in the step header (:mod:`lightning_gpipe.engine.boundary`); the next stage
compares it with its own. No extra message is sent.

A fingerprint holds, for every tensor leaf of the batch, its shape, its dtype and a checksum. The checksum weighs each
sample by its position, so a batch with its samples reordered differs too, and reads at most ``_COLUMNS`` evenly
spaced values of each sample, so its cost does not grow with the sample size: (N, 3, 224, 224) images cost as much as
(N, 16) features.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from lightning_gpipe.engine.tree import flatten

__all__ = ["Fingerprint", "batch_fingerprint", "same_fingerprint"]

Fingerprint = tuple[tuple[tuple[int, ...], str, float], ...]
"""A batch's identity: (shape, dtype, checksum) of each tensor leaf, in pytree order."""

_COLUMNS = 16
_RELATIVE_TOLERANCE = 1e-6  # a reordered reduction on another CPU or GPU may differ in the last bits, no more


@functools.lru_cache(maxsize=64)
def _weights(samples: int, columns: int, device: torch.device) -> torch.Tensor:
    """(samples, columns) weights: sample i, column j weighs i + 1 + (j + 1) / (columns + 1), all distinct."""
    position = torch.arange(1, samples + 1, dtype=torch.float64, device=device).unsqueeze(1)
    column = torch.arange(1, columns + 1, dtype=torch.float64, device=device) / (columns + 1)
    return position + column


def _checksum(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() == 0:
        return tensor.detach().to(torch.float64)
    rows = tensor.detach().reshape(tensor.shape[0], -1)  # N samples x F values
    step = max(1, rows.shape[1] // _COLUMNS)
    sampled = rows[:, ::step][:, :_COLUMNS].to(torch.float64)
    return (sampled * _weights(sampled.shape[0], sampled.shape[1], sampled.device)).sum()


def batch_fingerprint(batch: Any) -> Fingerprint:
    """Shapes, dtypes and position-weighted checksums of the tensors in ``batch`` (other leaves are ignored)."""
    leaves, _spec = flatten(batch)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and not leaf.is_complex()]
    if not tensors:
        return ()
    # One transfer to the host for the whole batch, not one per tensor.
    sums = torch.stack([_checksum(t).to(tensors[0].device) for t in tensors]).tolist()
    return tuple((tuple(t.shape), str(t.dtype), float(s)) for t, s in zip(tensors, sums, strict=True))


def same_fingerprint(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether two fingerprints describe the same batch: equal shapes and dtypes, checksums equal to round-off."""
    if len(a) != len(b):
        return False
    for (shape_a, dtype_a, sum_a), (shape_b, dtype_b, sum_b) in zip(a, b, strict=True):
        if tuple(shape_a) != tuple(shape_b) or dtype_a != dtype_b:
            return False
        if math.isnan(sum_a) and math.isnan(sum_b):
            continue
        if not math.isclose(sum_a, sum_b, rel_tol=_RELATIVE_TOLERANCE, abs_tol=_RELATIVE_TOLERANCE):
            return False
    return True
