"""Values without a batch dimension: marked by the user so that micro-batching and stage boundaries leave them whole.

Whether a tensor carries the batch dimension is guessed from its shape: a tensor of a batch is split along dim 0,
and a tensor that crosses a stage boundary is taken for a batched one when its dim 0 equals the micro-batch's size.
A tensor that is not per-sample (an attention bias of shape ``(T, T)``, a rotary cache, a step counter of shape
``(1,)``) can be mistaken for a batched one, or refused where its dim 0 differs from the batch's. So can a list of
plain values in a batch (class names, a shape): one as long as the batch is split as per-sample strings are, one of
another length is refused. Wrapping it in :class:`Unbatched` says so explicitly::

    return hidden, Unbatched(rotary_cache)  # (B, T, D) per sample, (T, D/2) shared by every sample

Every micro-batch gets a marked value whole, stage boundaries pass it on as it is (still wrapped, as the unsplit
module's next layer sees it), and gathering keeps it once when every micro-batch has the same value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_gpipe.engine.tree import LEAF, Spec

__all__ = ["Unbatched", "unbatched_leaves"]


@dataclass(frozen=True)
class Unbatched:
    """Marks ``value`` (a tensor, a list of plain values, or a nest of them) as having no batch dimension: never split.

    A batch or a stage's output may hold it anywhere; every micro-batch sees the same ``Unbatched`` value, and the
    code that consumes it reads ``.value``.
    """

    value: Any


def unbatched_leaves(spec: Spec) -> list[bool]:
    """For each leaf of a flattened value, in :func:`~lightning_gpipe.engine.tree.flatten` order: is it marked?"""
    flags: list[bool] = []
    _walk(spec, False, flags)
    return flags


def _walk(spec: Spec, inside: bool, flags: list[bool]) -> None:
    if spec == LEAF:
        flags.append(inside)
        return
    _kind, cls, _keys, children = spec
    for child in children:
        _walk(child, inside or cls is Unbatched, flags)
