"""Sharded cells: a stage's layers sharded over its replicas (FSDP2), gathered once per step, reduced once at its end.

A layer sharded with ``torch.distributed.fsdp.fully_shard`` (a *unit*) holds one shard of each of its parameters, a
``DTensor``; its forward gathers them whole first. A pipeline stage runs M forwards and M backwards per step, so its
units run as torchtitan runs a pipelined FSDP stage: the whole parameters stay gathered after a forward and after a
backward (``reshard_after_forward=False``, ``set_reshard_after_backward(False)``), so that they are gathered once per
step and reused by every pass (:class:`ShardedCell` starts every unit's gather when the step begins, and each unit's
first forward waits for its own), and gradients accumulate whole, with no reduction inside the step
(``set_requires_gradient_sync(False)``): the split backward's weight passes and the replays of re-materialization run
outside FSDP's hooks, and only the end of the step knows that no backward is left. :class:`ShardedCell` ends each
step: a training step's gradients are reduce-scattered once (averaged over the replicas and added to the shards'
``.grad``, so Lightning's gradient accumulation adds batches as with whole parameters), then the units reshard.

Between steps a sharded tensor is a ``DTensor`` holding this rank's rows: :func:`whole` gathers it (a collective over
the replicas), :func:`held_part` and :func:`shard_like` take this rank's part of a whole one (no communication), which
is how a checkpoint of whole tensors is read into shards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_gpipe.engine.torch_compat import drop_unsharded_gradients, reduce_unsharded_gradients

__all__ = ["ShardedCell", "held_part", "is_sharded", "local_shard", "shard_like", "sharded_target", "whole"]


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a shard of a larger tensor (a ``DTensor``: a sharded parameter or its gradient)."""
    return isinstance(tensor, DTensor)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: a sharded tensor's local shard (sharing its memory), else ``tensor``."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole: a sharded tensor gathered from every shard (a collective over its replicas), else itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def held_part(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` (whole, of ``like``'s shape) that this rank holds of ``like`` when ``like`` is sharded:
    a view of the rows of its shard (contiguous where ``tensor`` is: FSDP shards dim 0); else ``tensor`` itself."""
    if not isinstance(like, DTensor):
        return tensor
    (chunk,) = like.__create_chunk_list__()  # the shard's place in the whole tensor, as DCP reads it
    for dim, (start, size) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
        if size != tensor.shape[dim]:
            tensor = tensor.narrow(dim, start, size)
    return tensor


def sharded_target(shape: Sequence[int], dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor | None:
    """An empty tensor of ``shape`` sharded as ``like`` is, this rank's part allocated, in ``dtype``: what a tensor
    that belongs with ``like`` (Adam's moments of a sharded parameter) is read into; ``None`` when ``like`` is not
    sharded or has another shape."""
    if not isinstance(like, DTensor) or tuple(shape) != tuple(like.shape):
        return None
    return torch.empty_like(like, dtype=dtype)


def shard_like(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``tensor`` (whole) sharded as ``like`` is: a new sharded tensor holding this rank's part of it (no
    communication), in ``tensor``'s dtype; ``tensor`` itself when it is sharded already, or ``like`` is not sharded or
    of another shape."""
    shard = None if isinstance(tensor, DTensor) else sharded_target(tensor.shape, tensor.dtype, like)
    if shard is None:
        return tensor
    local_shard(shard).copy_(held_part(tensor, like))
    return shard


class ShardedCell:
    """The FSDP2 units of one stage's cell, through the steps of its pipeline.

    Creating it sets the units up for a pipeline step: parameters gathered until :meth:`end_step`, gradients
    accumulated whole until then.
    """

    def __init__(self, units: Sequence[FSDPModule]) -> None:
        self.units = list(units)
        for unit in self.units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.set_reshard_after_backward(False, recurse=False)
            unit.set_requires_gradient_sync(False, recurse=False)

    @classmethod
    def of(cls, cell: nn.Module) -> ShardedCell | None:
        """The units of ``cell``, or ``None`` when none of its layers is sharded."""
        units = [module for module in cell.modules() if isinstance(module, FSDPModule)]
        return cls(units) if units else None

    def begin_step(self) -> None:
        """Start gathering every unit's parameters at once; each unit's first forward waits for its own."""
        for unit in self.units:
            unit.unshard(async_op=True)

    def end_step(self, reduce: bool) -> None:
        """End a step: with ``reduce`` (a step that ran backward passes), reduce-scatter the gradients accumulated
        whole into the shards' ``.grad``; then free the whole parameters (the next step gathers them again)."""
        if reduce:
            reduce_unsharded_gradients(self.units)
        for unit in self.units:
            unit.reshard()

    def abort(self) -> None:
        """Drop a failed step's whole gradients and parameters, without communicating (the peers may be gone)."""
        drop_unsharded_gradients(self.units)
        for unit in self.units:
            unit.reshard()
