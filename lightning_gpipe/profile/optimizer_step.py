"""Seconds of one optimizer step over each layer's parameters, timed on a device: what a stage's step adds after its
last backward (:func:`update_times`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from lightning_gpipe.profile.timing import sync

__all__ = ["OptimizerFactory", "update_times"]

OptimizerFactory = Callable[[list[Tensor]], torch.optim.Optimizer]
"""Builds the optimizer whose step is timed from a list of parameters, e.g. ``torch.optim.Adam`` or
``functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)``."""


def _step_seconds(
    optimizer: OptimizerFactory,
    shapes: Sequence[tuple[torch.Size, torch.dtype]],
    device: torch.device,
    repeats: int,
    warmup: int,
) -> float:
    """The median seconds of one ``optimizer`` step over zero-filled parameters (with gradients) of ``shapes``."""
    params = [torch.zeros(shape, dtype=dtype, device=device, requires_grad=True) for shape, dtype in shapes]
    for param in params:
        param.grad = torch.zeros_like(param)
    stepper = optimizer(params)
    samples = []
    for index in range(warmup + repeats):
        sync(device)
        start = time.perf_counter()
        stepper.step()
        sync(device)
        if index >= warmup:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def update_times(
    layers: list[nn.Module], optimizer: OptimizerFactory | None, device: torch.device, repeats: int, warmup: int
) -> tuple[tuple[float, ...], float]:
    """Per layer, the seconds of one optimizer step over its trainable parameters less the step's fixed cost, and
    that fixed cost (the intercept of one step over one and over two one-element parameters), which a stage pays
    once. A parameter shared by several layers (tied weights) is stepped with the first. ``((), 0.0)`` without an
    optimizer.

    The layers are timed round-robin, one step each per round, as the passes are: a slow moment of a shared machine
    then costs each layer one of its ``repeats`` samples, which the median drops, instead of every sample of the
    layers timed during it. Each sample builds its own zero-filled copies, so that only one layer's exist at a time.
    """
    if optimizer is None:
        return (), 0.0
    one = (torch.Size([1]), torch.get_default_dtype())
    single = _step_seconds(optimizer, [one], device, max(repeats, 5), max(warmup, 1))
    double = _step_seconds(optimizer, [one, one], device, max(repeats, 5), max(warmup, 1))
    call = max(0.0, 2 * single - double)
    seen: set[int] = set()
    shapes: list[list[tuple[torch.Size, torch.dtype]]] = []
    for layer in layers:
        own = [p for p in layer.parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in own)
        shapes.append([(p.shape, p.dtype) for p in own])
    samples: list[list[float]] = [[] for _ in layers]
    for _ in range(repeats):
        for index, layer_shapes in enumerate(shapes):
            if layer_shapes:
                samples[index].append(_step_seconds(optimizer, layer_shapes, device, 1, max(warmup, 1)))
    updates = tuple(max(0.0, statistics.median(taken) - call) if taken else 0.0 for taken in samples)
    return updates, call
