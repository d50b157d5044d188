"""Running layers to measure them without a trace: fresh gradient leaves for their input, state restored after.

The cost sources (:mod:`lightning_gpipe.build.cost`) and the planner's profiler (:mod:`lightning_gpipe.plan.profile`)
run training-mode forwards and backwards of a model's layers outside training. :func:`leaf_input` gives a layer an input
that gradients flow back to, as a stage boundary does, without touching the recorded value; :func:`preserved_state`
puts back what those runs move: BatchNorm running statistics and the random number generators.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gpipe.engine.tree import flatten, map_tensors

__all__ = ["leaf_input", "preserved_state"]


def leaf_input(value: Any) -> tuple[list[Tensor], Any]:
    """Fresh leaves (floating tensors that require grad) and a copy of ``value`` computed from them.

    The layer gets the copy, not the leaves: an in-place first operation (``ReLU(inplace=True)``) is an error on a
    leaf that requires grad, and must not corrupt the recorded input for the next run either. Integer tensors (token
    ids, masks) are copied and get no gradient.
    """
    leaves: list[Tensor] = []

    def prepare(t: Tensor) -> Tensor:
        if t.is_floating_point() or t.is_complex():
            leaf = t.detach().requires_grad_()
            leaves.append(leaf)
            return leaf.clone()
        return t.clone()

    return leaves, map_tensors(prepare, value)


@contextmanager
def preserved_state(layers: Iterable[nn.Module], sample: Any = None) -> Iterator[None]:
    """Restore every buffer of ``layers`` and the torch random number generators when the block ends.

    Profiling runs training-mode forwards, which move BatchNorm running statistics and draw dropout masks; a
    measurement must not change the model it measures, nor the random stream the training run will see. Buffers are
    restored in place and re-registered, so a layer that replaced one (``self.buf = new``) gets the original back.
    The CUDA generators forked are those of the devices that ``layers`` and ``sample`` live on.
    """
    layers = list(layers)
    snapshot: list[tuple[nn.Module, str, Tensor, Tensor]] = []
    for layer in layers:
        for module in layer.modules():
            for name, buffer in module.named_buffers(recurse=False):
                snapshot.append((module, name, buffer, buffer.detach().clone()))
    tensors = [t for layer in layers for t in (*layer.parameters(), *layer.buffers())]
    tensors += [t for t in flatten(sample)[0] if isinstance(t, Tensor)]
    cuda_indices = sorted({t.get_device() for t in tensors if t.is_cuda})
    with torch.random.fork_rng(devices=cuda_indices, device_type="cuda"):
        try:
            yield
        finally:
            with torch.no_grad():
                for module, name, buffer, saved in snapshot:
                    buffer.copy_(saved)
                    setattr(module, name, buffer)
