"""Gradient collectives of a pipeline: data-parallel averaging, clipping by the global norm, and a loss scaler whose
overflow checks every rank agrees on.

Each stage owns a disjoint slice of the parameters, so the norm of the whole model's gradient is the square root of the
sum over stages of each stage's squared norm. Clipping by a stage's local norm would scale the stages differently
and change the training (off by 1e-3 after a few steps in our measurements); clipping here matches
``torch.nn.utils.clip_grad_norm_`` on the unpartitioned model. A tied parameter, whose copies on several stages hold
the same summed gradient (:mod:`lightning_gpipe.partition.tied`), counts once: its other copies are scaled, not counted.
A stage sharded over its replicas (``data_parallel="fsdp"``) holds one shard of each gradient: the squares of the local
shards, summed over the whole world, count every element once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from lightning_gpipe.engine.collectives import BUCKET_BYTES, buckets
from lightning_gpipe.engine.errors import collective_errors
from lightning_gpipe.engine.sharding import is_sharded, local_shard
from lightning_gpipe.engine.torch_compat import InfAgreeingScaler, flatten_dense_tensors, unflatten_dense_tensors

__all__ = ["WorldGradScaler", "average_gradients", "clip_grad_norm"]


def average_gradients(
    parameters: Iterable[torch.nn.Parameter], group: dist.ProcessGroup, size: int, bucket_bytes: int = BUCKET_BYTES
) -> None:
    """Average ``.grad`` over the data-parallel ``group`` of ``size`` replicas, as DDP does.

    A parameter that has a gradient on some replicas only (a branch one replica's batch did not take) gets the
    average with zeros standing in for the missing ones, as ``DistributedDataParallel(find_unused_parameters=True)``
    gives; one that has none on any replica keeps ``grad=None``. Every replica must pass the same parameters in the
    same order. Gradients go in flattened buckets of at most ``bucket_bytes`` per dtype and device, all started before
    the first is waited for.
    """
    if size == 1:
        return
    trainable = [p for p in parameters if p.requires_grad]
    if not trainable:
        return
    # Which parameters have a gradient anywhere: the flat buckets must have the same layout on every replica, or the
    # all-reduce mixes unrelated values (NCCL) or fails on differing sizes (gloo).
    device = next((p.grad.device for p in trainable if p.grad is not None), trainable[0].device)
    present = torch.tensor([p.grad is not None for p in trainable], dtype=torch.int32, device=device)
    dist.all_reduce(present, group=group)
    anywhere = present.tolist()  # one small host sync per optimizer step
    grads: list[torch.Tensor] = []
    for parameter, count in zip(trainable, anywhere, strict=True):
        if count == 0:
            continue
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        grads.append(parameter.grad)
    average = _average_op(group)
    pending = []
    for bucket in buckets(grads, bucket_bytes):
        flat = flatten_dense_tensors(bucket)
        pending.append((bucket, flat, dist.all_reduce(flat, op=average, group=group, async_op=True)))
    for bucket, flat, work in pending:
        work.wait()
        if average != dist.ReduceOp.AVG:
            flat /= size
        for grad, reduced in zip(bucket, unflatten_dense_tensors(flat, bucket), strict=True):
            grad.copy_(reduced)


def _average_op(group: dist.ProcessGroup) -> dist.ReduceOp.RedOpType:
    # NCCL averages in the reduction itself; gloo has no AVG, so it sums and the caller divides.
    return dist.ReduceOp.AVG if dist.get_backend(group) == "nccl" else dist.ReduceOp.SUM


def clip_grad_norm(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    group: dist.ProcessGroup | None,
    duplicates: Iterable[torch.nn.Parameter] = (),
    *,
    count_whole: bool = True,
) -> torch.Tensor:
    """Scale gradients so that the norm over every rank in ``group`` is at most ``max_norm``; returns that norm.

    ``duplicates`` are copies of parameters whose gradient another stage counts (tied weights): scaled, not counted. A
    sharded gradient counts its local shard; a whole one counts only where ``count_whole``: with stages sharded over
    the replicas, ``group`` is the world, and a tensor that every replica holds whole counts on one replica only.
    """
    parameters = list(parameters)
    grads = [local_shard(p.grad) for p in parameters if p.grad is not None]
    skipped = {id(p) for p in duplicates}
    device = grads[0].device if grads else torch.device("cpu")
    squared = torch.zeros((), dtype=torch.float32, device=device)
    for parameter in parameters:
        grad = parameter.grad
        if grad is not None and id(parameter) not in skipped and (count_whole or is_sharded(grad)):
            squared += local_shard(grad).detach().float().pow(2).sum()
    if group is not None:
        dist.all_reduce(squared, group=group)
    total = squared.sqrt()
    # The same coefficient and epsilon as torch.nn.utils.clip_grad_norm_, so that K stages clip like one.
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.detach().mul_(coefficient.to(grad.dtype))
    return total


class WorldGradScaler(InfAgreeingScaler):
    """A loss scaler for ``precision="16-mixed"`` with which every stage and replica skips the same steps.

    Each rank sees only its own gradients. ``ShardedGradScaler`` all-reduces the overflow flags in ``unscale_``, but an
    optimizer that unscales inside its own step (``fused=True`` Adam, AdamW and SGD, for which Lightning does not call
    ``unscale_``) has them checked where ``ShardedGradScaler`` leaves them local (:class:`InfAgreeingScaler`): a stage
    with an inf would skip and halve its scale while the others step. This scaler agrees on that path too, over
    ``process_group`` (the world by default). Either agreement fails at once when another rank died; it raises a
    :class:`~lightning_gpipe.engine.errors.PipelineError` naming ``stage`` then.
    """

    stage: int = 0
    """The stage this process runs, named by the error of a failed agreement."""

    @classmethod
    def like(cls, scaler: torch.amp.GradScaler, device: str, stage: int = 0) -> WorldGradScaler:
        """A scaler with ``scaler``'s settings and current scale, for ``device``'s type (``"cuda"``, ``"cpu"``), on
        ``stage``."""
        world_scaler = cls(
            device=device,
            init_scale=scaler.get_scale(),
            growth_factor=scaler.get_growth_factor(),
            backoff_factor=scaler.get_backoff_factor(),
            growth_interval=scaler.get_growth_interval(),
            enabled=scaler.is_enabled(),
        )
        world_scaler.stage = stage
        return world_scaler

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        with collective_errors(self.stage, _AGREEING):  # ShardedGradScaler all-reduces the found infs in here
            super().unscale_(optimizer)

    def agree(self, found: dict[Any, torch.Tensor]) -> None:
        with collective_errors(self.stage, _AGREEING):
            # MAX keeps each flag 0 or 1: fused optimizers skip their step when it equals one.
            works = [
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group, async_op=True)
                for flag in found.values()
            ]
            for work in works:
                work.wait()


_AGREEING = "agreeing with every rank on the loss scaler's found infs (precision='16-mixed')"
