"""Bytes of tensors in training, counted from their storages (a ``TorchDispatchMode`` sees every operator), so they do
not depend on the allocator or its cache: storages alive and their peak (:class:`LiveTensorBytes`), a layer's
parameters and buffers, the activations autograd saves for its backward (:func:`saved_bytes`), its output and its
backward's transient peak, what ``checkpoint="selective"`` keeps of it, and what a split backward keeps for its weight
pass."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gpipe.engine.rematerialization import KEPT_OPS
from lightning_gpipe.engine.torch_compat import TorchDispatchMode, storage_key
from lightning_gpipe.engine.tree import flatten
from lightning_gpipe.profile.layer_run import tensor_leaves, training_input

__all__ = [
    "LiveTensorBytes",
    "activation_bytes",
    "saved_bytes",
    "selective_bytes",
    "state_bytes",
    "state_keys",
    "storage_bytes",
    "weighted_output_bytes",
]


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the tensor storages created while active and still alive, and their peak (``live``, ``peak``).

    Exact and allocator-independent: the profiler counts with it, and the memory benchmarks measure with it.

    A storage is new when an operator returns it and no input shares it (views and in-place operators return their
    input's storage). A ``weakref.finalize`` on the storage takes its bytes off when it dies.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak = self.live

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        output = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tensor_leaves((args, kwargs))}
        for tensor in tensor_leaves(output):
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in inputs or key in self._sizes:
                continue
            self._sizes[key] = size
            self.live += size
            weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.live)
        return output


def state_bytes(layer: nn.Module, seen: set[int]) -> tuple[int, int, int]:
    """Bytes of ``layer``'s parameters, of those that are trainable, and of its buffers, each tensor counted once over
    the calls that share ``seen`` (a tied tensor in the first layer that holds it)."""
    params = trainable = buffers = 0
    for param in layer.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        nbytes = param.numel() * param.element_size()
        params += nbytes
        trainable += nbytes if param.requires_grad else 0
    for buffer in layer.buffers():
        if id(buffer) not in seen:
            seen.add(id(buffer))
            buffers += buffer.numel() * buffer.element_size()
    return params, trainable, buffers


def state_keys(layers: Iterable[nn.Module]) -> set[int]:
    """The storages of the parameters and buffers of ``layers``: what a layer saves of them is no activation."""
    return {storage_key(t) for layer in layers for t in (*layer.parameters(), *layer.buffers())}


def _saved_forward(run: Callable[[Any], Any], x: Any, state: set[int], saved: dict[int, int]) -> Any:
    """``run(x)`` with grad enabled, recording into ``saved`` the storage bytes of each tensor autograd saves for the
    backward pass, those of ``state`` (parameters, buffers) left out."""

    def pack(t: Tensor) -> Tensor:
        key = storage_key(t)
        if key not in state:
            # A view keeps its whole storage alive, so the storage's size is what the layer holds on to.
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return run(x)


def saved_bytes(layer: nn.Module, value: Any, state: set[int], *, input_grad: bool = True) -> float:
    """Bytes of the activations autograd saves for one backward pass of ``layer`` on ``value``, each storage counted
    once and the storages in ``state`` (:func:`state_keys`) left out. Deterministic, and works on the meta device.

    ``input_grad``: the input gets a gradient, as a stage boundary's does; the model's input (the batch) gets none, and
    a layer with nothing to train then saves nothing."""
    saved: dict[int, int] = {}
    _saved_forward(layer, training_input(value, input_grad)[1], state, saved)
    return float(sum(saved.values()))


@dataclass(frozen=True)
class _Bytes:
    """What :func:`activation_bytes` counts, for the whole sample (not per sample)."""

    saved: float
    output: float
    transient: float
    saved_input: float
    saved_output: float
    saved_input_leaves: tuple[float, ...]
    output_leaves: tuple[float, ...]
    saved_output_leaves: tuple[float, ...]
    passthrough: tuple[int, ...]


def _leaf_bytes(x: Any, output: Any, saved: dict[int, int]) -> dict[str, tuple[Any, ...]]:
    """Per leaf of the input and the output: the bytes the layer saved of it, its size, and which input an output
    leaf is (the same storage, passed on unchanged). A storage that two leaves share counts at its first leaf only."""

    def keys(value: Any) -> list[int | None]:
        return [storage_key(t) if isinstance(t, Tensor) else None for t in flatten(value)[0]]

    def first_saved(found: list[int | None], skip: Sequence[int]) -> tuple[float, ...]:
        return tuple(
            float(saved.get(k, 0)) if k is not None and k not in found[:i] and i not in skip else 0.0
            for i, k in enumerate(found)
        )

    inputs, outputs = keys(x), keys(output)
    passthrough = tuple(inputs.index(k) if k is not None and k in inputs else -1 for k in outputs)
    sizes = tuple(float(t.untyped_storage().nbytes()) if isinstance(t, Tensor) else 0.0 for t in flatten(output)[0])
    return {
        "saved_input_leaves": first_saved(inputs, ()),
        "output_leaves": sizes,
        # A passed-on input that the layer saves is counted with the input already.
        "saved_output_leaves": first_saved(outputs, [j for j, p in enumerate(passthrough) if p >= 0]),
        "passthrough": passthrough,
    }


def activation_bytes(run: Callable[[Any], Any], value: Any, state: set[int], input_grad: bool = True) -> _Bytes:
    """Bytes of one forward plus backward of ``run`` on ``value`` (not per sample): saved (as :func:`saved_bytes`
    counts them), output, transient, the parts of the saved bytes that are the input's and the output's own storages,
    and the same per leaf."""
    saved: dict[int, int] = {}

    def shared(tensors: Any) -> float:
        keys = {storage_key(t) for t in tensor_leaves(tensors)}
        return float(sum(size for key, size in saved.items() if key in keys))

    leaves, x = training_input(value, input_grad)
    if any(t.is_meta for t in leaves) or any(t.is_meta for t in tensor_leaves(x)):
        output = _saved_forward(run, x, state, saved)
        out_bytes = storage_bytes(output)
        # No storage to watch on meta: the backward holds the output's gradient and the input's.
        transient = float(2 * max(out_bytes, storage_bytes(x)))
        leaves_of = _leaf_bytes(x, output, saved)
        return _Bytes(float(sum(saved.values())), float(out_bytes), transient, shared(x), shared(output), **leaves_of)
    counter = LiveTensorBytes()
    with counter:
        output = _saved_forward(run, x, state, saved)
        after_forward = counter.live
        counter.reset_peak()
        outputs = [t for t in tensor_leaves(output) if t.requires_grad]
        if outputs:
            torch.autograd.grad(outputs, outputs + leaves, [torch.ones_like(t) for t in outputs], allow_unused=True)
    transient = float(max(0, counter.peak - after_forward))
    total = float(sum(saved.values()))
    return _Bytes(
        total, float(storage_bytes(output)), transient, shared(x), shared(output), **_leaf_bytes(x, output, saved)
    )


class _KeptOutputs(TorchDispatchMode):
    """Holds the outputs of the operators in ``KEPT_OPS``, by storage: what the selective checkpoint wrapper stores.
    A plain forward runs under it, so it counts on the meta device too."""

    def __init__(self) -> None:
        super().__init__()
        # Held, as the wrapper holds them: a freed output's address could be reused by a later tensor.
        self.kept: dict[int, Tensor] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        output = func(*args, **(kwargs or {}))
        if func in KEPT_OPS:
            for tensor in tensor_leaves(output):
                self.kept[storage_key(tensor)] = tensor
        return output


def selective_bytes(layer: nn.Module, value: Any, input_grad: bool) -> tuple[float, float]:
    """Bytes (not per sample) that ``checkpoint="selective"`` keeps of ``layer`` on ``value``: the outputs of the
    operators in ``KEPT_OPS`` that are not the layer's output, and those that are."""
    recorder = _KeptOutputs()
    with torch.enable_grad(), recorder:
        output = layer(training_input(value, input_grad)[1])
    outputs = {storage_key(t) for t in tensor_leaves(output)}
    sizes = {key: t.untyped_storage().nbytes() for key, t in recorder.kept.items()}
    inside = sum(size for key, size in sizes.items() if key not in outputs)
    return float(inside), float(sum(sizes.values()) - inside)


class _WeightedOutputs(TorchDispatchMode):
    """Holds, by storage, the first output of each operator that takes one of ``parameters`` with another floating
    tensor (a convolution, a matrix multiplication, a normalization's affine step): the operations with a weight."""

    def __init__(self, parameters: set[int]) -> None:
        super().__init__()
        self.parameters = parameters
        self.kept: dict[int, Tensor] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        output = func(*args, **(kwargs or {}))
        keys = [(storage_key(t), t.is_floating_point()) for t in tensor_leaves((args, kwargs))]
        if any(k in self.parameters for k, _ in keys) and any(f and k not in self.parameters for k, f in keys):
            first = next(iter(tensor_leaves(output)), None)  # a normalization's saved statistics are not its output
            if first is not None:
                self.kept[storage_key(first)] = first
        return output


def weighted_output_bytes(layer: nn.Module, value: Any, input_grad: bool) -> float:
    """Bytes (not per sample) of the outputs of ``layer``'s operations with a trainable weight on ``value``: the output
    gradients a split backward's input pass keeps for its weight pass (:mod:`lightning_gpipe.engine.split`)."""
    recorder = _WeightedOutputs({storage_key(p) for p in layer.parameters() if p.requires_grad})
    with torch.enable_grad(), recorder:
        layer(training_input(value, input_grad)[1])
    return float(sum(t.untyped_storage().nbytes() for t in recorder.kept.values()))


def storage_bytes(value: Any) -> int:
    """Bytes of the storages of the tensors in ``value``, each storage counted once."""
    seen: dict[int, int] = {}
    for t in tensor_leaves(value):
        seen[storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())
