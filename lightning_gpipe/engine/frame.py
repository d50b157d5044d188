"""A boundary value as one message, its frame: the value's layout, and its tensors at aligned offsets of one buffer.

A boundary value is a nest of tensors (tuples, lists, dicts, namedtuples, dataclasses; ``None`` leaves allowed). Its
*layout* is its structure and one :class:`TensorLayout` per leaf; the sender describes it (:func:`describe`), the
receiver allocates a buffer of :attr:`Frame.nbytes` from it before the message arrives. Every message costs a send, a
receive and two thread wake-ups whatever its size, so a value's tensors travel as one message however many leaves it
has, for one copy of each into the frame (:meth:`Frame.write`); the receiver views them in place (:meth:`Frame.read`).
A frame may open with a control area of :data:`FRAME_CONTROL_BYTES`, a packed object
(:mod:`~lightning_gpipe.engine.framing`) that tells the receiver how to read the rest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_gpipe.engine.tree import Spec, flatten, leaf_paths, unflatten
from lightning_gpipe.engine.unbatched import unbatched_leaves

__all__ = ["FRAME_CONTROL_BYTES", "Frame", "Layout", "TensorLayout", "describe", "resize"]

FRAME_CONTROL_BYTES = 128
"""Size in bytes of the control area that may open a frame (a packed head, no tail)."""
_ALIGN = 64  # bytes: each tensor of a frame starts at a multiple, so that it can be viewed in any dtype


@dataclass(frozen=True)
class TensorLayout:
    """Shape, dtype and autograd flag of one tensor leaf; ``batched`` if dim 0 is the micro-batch dimension."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    batched: bool

    def resized(self, size: int) -> TensorLayout:
        """This layout for a micro-batch of ``size`` samples."""
        if not self.batched:
            return self
        return TensorLayout((size, *self.shape[1:]), self.dtype, self.requires_grad, True)

    @property
    def nbytes(self) -> int:
        """The tensor's size in bytes."""
        return math.prod(self.shape) * self.dtype.itemsize


Layout = tuple[Spec, tuple[TensorLayout | None, ...]]
"""A value's structure, and one entry per leaf (``None`` for a ``None`` leaf)."""


def describe(stage: int, value: Any, batch_size: int) -> tuple[Layout, list[torch.Tensor | None]]:
    """The layout of ``value``, stage ``stage``'s output for a micro-batch of ``batch_size`` samples, and its leaves.

    Raises:
        TypeError: a leaf that is neither a tensor nor ``None``, named by its path.
    """
    leaves, spec = flatten(value)
    layouts: list[TensorLayout | None] = []
    marked = unbatched_leaves(spec)
    for position, (leaf, unbatched) in enumerate(zip(leaves, marked, strict=True)):
        if leaf is None:
            layouts.append(None)
        elif isinstance(leaf, torch.Tensor):
            # A guess for unmarked tensors; a wrong one costs a described step (see boundary.py), not a wrong value.
            batched = not unbatched and leaf.dim() > 0 and leaf.shape[0] == batch_size
            layouts.append(TensorLayout(tuple(leaf.shape), leaf.dtype, leaf.requires_grad, batched))
        else:
            raise TypeError(
                f"stage {stage} produced {leaf_paths(spec, 'output')[position]} of type {type(leaf).__name__}; only "
                "tensors (or None) can cross a stage boundary: make it a tensor"
            )
    return (spec, tuple(layouts)), leaves


def resize(layout: Layout, size: int) -> Layout:
    """``layout`` for a micro-batch of ``size`` samples: its batched tensors resized along dim 0."""
    spec, tensors = layout
    return spec, tuple(None if entry is None else entry.resized(size) for entry in tensors)


@dataclass(frozen=True)
class Frame:
    """Where a value's tensors lie in its frame: a control area of ``control`` bytes, then each tensor leaf at its byte
    offset (``None`` for a ``None`` leaf); ``nbytes`` in all."""

    control: int
    offsets: tuple[int | None, ...]
    nbytes: int

    @staticmethod
    def of(entries: Sequence[TensorLayout | None], control: bool) -> Frame:
        """The frame of a value whose leaves are ``entries``, opening with a control area when ``control``."""
        offset = FRAME_CONTROL_BYTES if control else 0
        offsets: list[int | None] = []
        for entry in entries:
            if entry is None:
                offsets.append(None)
                continue
            offsets.append(offset)
            offset += -(-entry.nbytes // _ALIGN) * _ALIGN
        return Frame(FRAME_CONTROL_BYTES if control else 0, tuple(offsets), offset)

    def write(
        self,
        entries: Sequence[TensorLayout | None],
        leaves: Sequence[torch.Tensor | None],
        device: torch.device,
        control: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A buffer on ``device`` holding ``control`` (a packed control area) and each leaf at its offset.

        A leaf that is ``None`` where ``entries`` has room leaves its bytes as they are: the receiver discards them. A
        leaf left on another device (a CPU mask from a stage on a GPU) is moved by the copy.
        """
        buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        if control is not None:
            buffer[: self.control] = control
        for leaf, entry, offset in zip(leaves, entries, self.offsets, strict=True):
            if leaf is not None:
                assert entry is not None
                assert offset is not None
                _view(buffer, entry, offset).copy_(leaf)
        return buffer

    def read(self, buffer: torch.Tensor, layout: Layout, missing: Sequence[int] = ()) -> Any:
        """The value of ``layout`` in the received ``buffer``, its tensors views of it (``None`` at ``missing``
        leaves); float tensors that required grad upstream are leaves that do too."""
        spec, entries = layout
        leaves: list[torch.Tensor | None] = []
        for position, (entry, offset) in enumerate(zip(entries, self.offsets, strict=True)):
            if entry is None or offset is None or position in missing:
                leaves.append(None)
            else:
                leaves.append(_view(buffer, entry, offset).requires_grad_(entry.requires_grad))
        return unflatten(leaves, spec)


def _view(frame: torch.Tensor, entry: TensorLayout, offset: int) -> torch.Tensor:
    """The tensor of ``entry`` in ``frame``, at ``offset``: a view, written by the sender, read by the receiver."""
    return frame[offset : offset + entry.nbytes].view(entry.dtype).view(entry.shape)
