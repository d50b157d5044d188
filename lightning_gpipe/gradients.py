"""Gradient collectives of a pipeline: data-parallel averaging and clipping by the global norm.

Each stage owns a disjoint slice of the parameters, so the norm of the whole model's gradient is the square root of the
sum over stages of each stage's squared norm. Clipping by a stage's local norm would scale the stages differently
and change the training (off by 1e-3 after a few steps in our measurements); clipping here matches
``torch.nn.utils.clip_grad_norm_`` on the unpartitioned model. A tied parameter, whose copies on several stages hold
the same summed gradient (:mod:`lightning_gpipe.tied`), counts once: its other copies are scaled, not counted.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["average_gradients", "clip_grad_norm"]


def average_gradients(parameters: Iterable[torch.nn.Parameter], group: dist.ProcessGroup, size: int) -> None:
    """Average ``.grad`` over the data-parallel ``group`` of ``size`` replicas, one collective per dtype and device."""
    if size == 1:
        return
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for parameter in parameters:
        if parameter.grad is not None:
            buckets.setdefault((parameter.grad.dtype, parameter.grad.device), []).append(parameter.grad)
    for grads in buckets.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        flat /= size
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(reduced)


def clip_grad_norm(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    group: dist.ProcessGroup | None,
    duplicates: Iterable[torch.nn.Parameter] = (),
) -> torch.Tensor:
    """Scale gradients so that the norm over every stage in ``group`` is at most ``max_norm``; returns that norm.

    ``duplicates`` are copies of parameters whose gradient another stage counts (tied weights): scaled, not counted.
    """
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    skipped = {id(p) for p in duplicates}
    device = grads[0].device if grads else torch.device("cpu")
    squared = torch.zeros((), dtype=torch.float32, device=device)
    for parameter in parameters:
        if parameter.grad is not None and id(parameter) not in skipped:
            squared += parameter.grad.detach().float().pow(2).sum()
    if group is not None:
        dist.all_reduce(squared, group=group)
    total = squared.sqrt()
    # The same coefficient and epsilon as torch.nn.utils.clip_grad_norm_, so that K stages clip like one.
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.detach().mul_(coefficient.to(grad.dtype))
    return total
