"""One layer run alone on its input, as a stage would run it: its input from the previous layer's output, copied to
the device (a meta layer materialized with small random values), given a gradient where a stage boundary's gets one,
run plain or under the engine's checkpoint wrapper, and the model's buffers and random generators restored after
(:func:`preserved_state`). The profiler's timing and byte counts both run layers this way."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gpipe.engine.rematerialization import checkpointed
from lightning_gpipe.engine.tree import flatten, map_tensors

__all__ = [
    "LossFn",
    "layer_inputs",
    "layer_output",
    "leaf_input",
    "on_device",
    "preserved_state",
    "resized",
    "runner",
    "tensor_leaves",
    "training_input",
]

LossFn = Callable[[Any], Tensor]
"""``loss_fn(last_output) -> scalar``: the loss run after the last layer."""


def tensor_leaves(value: Any) -> list[Tensor]:
    """The tensors among the leaves of ``value``, nested as :func:`~lightning_gpipe.engine.tree.flatten` walks it."""
    return [leaf for leaf in flatten(value)[0] if isinstance(leaf, Tensor)]


def leaf_input(value: Any) -> tuple[list[Tensor], Any]:
    """Fresh leaves (floating tensors that require grad) and a copy of ``value`` computed from them.

    A layer is run on the copy, as on a stage boundary's input, which gradients flow back to: an in-place first
    operation (``ReLU(inplace=True)``) is an error on a leaf that requires grad, and must not corrupt the recorded input
    for the next run either. Integer tensors (token ids, masks) are copied and get no gradient.
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
    tensors = [t for layer in layers for t in (*layer.parameters(), *layer.buffers())] + tensor_leaves(sample)
    cuda_indices = sorted({t.get_device() for t in tensors if t.is_cuda})
    with torch.random.fork_rng(devices=cuda_indices, device_type="cuda"):
        try:
            yield
        finally:
            with torch.no_grad():
                for module, name, buffer, saved in snapshot:
                    buffer.copy_(saved)
                    setattr(module, name, buffer)


def resized(sample: Any, samples: int) -> Any:
    """``sample`` with ``samples`` rows along dim 0 (rows repeated or dropped)."""

    def resize(t: Tensor) -> Tensor:
        if t.dim() == 0:
            return t
        repeats = math.ceil(samples / t.shape[0])
        return t.repeat(repeats, *([1] * (t.dim() - 1)))[:samples].clone() if repeats > 1 else t[:samples].clone()

    return map_tensors(resize, sample)


def on_device(layer: nn.Module, device: torch.device) -> bool:
    """Whether every parameter and buffer of ``layer`` holds data on ``device`` (a model still on the CPU when the
    target is a GPU does not)."""
    # "cuda" names the current device: an index on one side only is taken to match.
    return all(
        t.device.type == device.type and None in (t.device.index, device.index) or t.device == device
        for t in (*layer.parameters(), *layer.buffers())
    )


def _materialized(layer: nn.Module, device: torch.device) -> nn.Module:
    """``layer`` itself when it holds data on ``device`` (or ``device`` is meta: nothing runs there but counting); a
    copy there when it holds data elsewhere; else (meta) a copy on ``device`` filled with small random values."""
    tensors = [*layer.parameters(), *layer.buffers()]
    if device.type == "meta" or on_device(layer, device):
        return layer
    if not any(t.is_meta for t in tensors):
        return copy.deepcopy(layer).to(device)
    real = copy.deepcopy(layer).to_empty(device=device)
    with torch.no_grad():
        for t in (*real.parameters(), *real.buffers()):
            if t.is_floating_point():
                t.normal_(0.0, 0.02)
            else:
                t.zero_()
    return real


def layer_inputs(layers: Sequence[nn.Module], sample: Any, device: torch.device) -> Iterator[tuple[nn.Module, Any]]:
    """Each layer on ``device`` (itself, or a copy there) with its input: ``sample`` for the first, then the previous
    layer's output, detached, as ``nn.Sequential`` chains them. The next input is computed when the caller asks for
    the next layer, after it has measured this one, so only one copy exists at a time."""
    x = map_tensors(lambda t: t.detach(), sample)
    for layer in layers:
        real = _materialized(layer, device)
        yield real, x
        x = layer_output(real, x)
        del real


def layer_output(layer: nn.Module, x: Any) -> Any:
    """``layer``'s output on ``x``, detached; run on a copy, which an in-place layer may overwrite."""
    with torch.no_grad():
        return map_tensors(lambda t: t.detach(), layer(map_tensors(lambda t: t.clone(), x)))


def training_input(value: Any, grad: bool) -> tuple[list[Tensor], Any]:
    """The layer's input as training sees it: a boundary's gets a gradient, the model's input (the batch) none."""
    if grad:
        return leaf_input(value)
    return [], map_tensors(lambda t: t.clone(), value)


def runner(
    layer: nn.Module, loss_fn: LossFn | None, rematerialized: bool, first: bool, selective: bool = False
) -> Callable[[Any], Any]:
    """The layer's forward as a stage runs it: under the engine's checkpoint wrapper if ``rematerialized`` (copying a
    received input, as the engine does; the selective wrapper with ``selective``), then the loss if it is the last
    layer (outside the wrapper)."""

    def run(x: Any) -> Any:
        wrapped = rematerialized or selective
        output = checkpointed(layer, x, copy_input=not first, selective=selective) if wrapped else layer(x)
        return loss_fn(output) if loss_fn is not None else output

    return run
