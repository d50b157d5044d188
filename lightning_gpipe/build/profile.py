"""The profiler: what each layer of a sequence costs in training, timed on a device and counted in bytes.

It serves both the balance by measurement (:func:`~lightning_gpipe.build.cost.time_cost` and
:func:`~lightning_gpipe.build.cost.memory_cost`) and the planner (:func:`profile_layers`). Every layer runs alone, on
the previous layer's output, as a stage would run it:

- :func:`timed_passes` times forward and backward passes of every layer, round-robin, each round with the floor that
  any timed pass costs (a one-element layer's pass), so that a consumer can take it off;
- :func:`saved_bytes` counts the activations autograd saves for a layer's backward, exactly, from tensor storages;
- :func:`profile_layers` records, per layer, pass times at each micro-batch size the planner weighs (or, with
  ``flops_per_second``, the analytic time of its FLOPs), what re-materializing it adds (under the engine's own
  checkpoint wrapper, whole or selective), the seconds of one optimizer step over its parameters, its parameter,
  trainable and buffer bytes, and per sample its saved activations, output and the transient peak of its backward,
  and what ``checkpoint="selective"`` keeps of it (the outputs of the operators in
  :data:`~lightning_gpipe.engine.rematerialization.KEPT_OPS`); with ``split=True`` also its backward split as the
  zero-bubble schedules run it (the engine's own :mod:`~lightning_gpipe.engine.split`: the input pass, then the weight
  pass).

Bytes are counted from tensor storages (a ``TorchDispatchMode`` sees every operator), so they do not depend on the
allocator or its cache. A model built on the meta device is profiled one layer at a time: each layer is copied to
``device``, filled with small random values, measured and dropped, so only one layer must fit. Every measurement
restores what it moves (:func:`preserved_state`) and never touches a parameter's ``.grad``.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_gpipe.engine.rematerialization import KEPT_OPS, checkpointed
from lightning_gpipe.engine.split import input_pass
from lightning_gpipe.engine.torch_compat import TorchDispatchMode, storage_key
from lightning_gpipe.engine.tree import flatten, map_tensors

__all__ = [
    "LayerProfile",
    "LiveTensorBytes",
    "ModelProfile",
    "OptimizerFactory",
    "Passes",
    "Split",
    "SplitTimes",
    "layer_inputs",
    "leaf_input",
    "preserved_state",
    "profile_layers",
    "saved_bytes",
    "state_bytes",
    "state_keys",
    "timed_passes",
]

LossFn = Callable[[Any], Tensor]
OptimizerFactory = Callable[[list[Tensor]], torch.optim.Optimizer]
"""Builds the optimizer whose step is timed from a list of parameters, e.g. ``torch.optim.Adam`` or
``functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)``."""


@dataclass(frozen=True)
class LayerProfile:
    """What one layer costs in training. Activation bytes are per sample; state bytes are the layer's own."""

    name: str
    param_bytes: int
    trainable_bytes: int  # parameters that get a gradient and optimizer state
    buffer_bytes: int
    saved_bytes: float  # per sample: activations autograd keeps for the backward pass
    output_bytes: float  # per sample: what the layer hands to the next one
    transient_bytes: float  # per sample: the backward pass's peak above what the forward left alive
    flops: float  # per sample, forward
    saved_input_bytes: float = 0.0  # per sample: the part of saved_bytes that is the layer's input itself
    saved_output_bytes: float = 0.0  # per sample: the part of saved_bytes that is the layer's output itself
    # Per tensor leaf of the layer's input and output (flattened in container order), per sample, so that a tensor
    # that several layers save, or that a layer passes on unchanged, is counted once (see plan.memory.stage_bytes):
    saved_input_leaves: tuple[float, ...] = ()  # bytes of each input leaf the layer saves (0: not saved)
    output_leaves: tuple[float, ...] = ()  # bytes of each output leaf
    saved_output_leaves: tuple[float, ...] = ()  # bytes of each output leaf the layer saves (0: not saved)
    passthrough: tuple[int, ...] = ()  # for each output leaf, the input leaf it is (the same storage), or -1
    # Per sample, what selective re-materialization keeps of the layer: the outputs of KEPT_OPS that are not the
    # layer's output, and those that are (which a stage's engine may hold already as the output it sent on).
    selective_bytes: float = 0.0
    selective_output_bytes: float = 0.0
    graph_nodes: int = 0  # autograd nodes of its backward (counted with split=True), which a later layer's split walks


class SplitTimes(NamedTuple):
    """Per layer, seconds of its backward split as the engine splits it (:meth:`ModelProfile.split_times`)."""

    input: list[float]  # the input pass
    weight: list[float]  # the weight pass
    walk: list[float]  # the input pass where the input takes no gradient (the first stage's): the walk alone
    # What each pass adds per autograd node below the layer in its stage (``LayerProfile.graph_nodes`` of the layers
    # before it): the weight pass's autograd call per group of parameters, and the input pass's search for the nodes
    # each group starts from, walk the graph below.
    input_below: list[float]
    weight_below: list[float]


@dataclass(frozen=True)
class ModelProfile:
    """A profiled sequence of layers: bytes per layer and pass times per micro-batch size.

    ``times[n]`` holds ``(forward, backward)`` seconds per layer for micro-batches of ``n`` samples, and
    ``recompute[n]`` what re-materializing each layer adds to them (empty when not measured: the planner then charges
    the forward again), of which ``recompute_forward[n]`` falls in the forward pass: the checkpoint wrapper's hook on
    every tensor autograd saves runs in the first forward too, not only in the replay. ``selective_recompute[n]`` and
    ``selective_forward[n]`` are the same under the selective wrapper (``checkpoint="selective"``). Sizes that were
    not measured
    are interpolated linearly between the nearest measured ones (a fixed launch cost plus a per-sample cost), and
    extrapolated proportionally to the samples beyond them.

    The checkpoint wrapper and the optimizer step also cost something once per call, whatever the layers:
    ``recompute_call`` and ``update_call``, which a stage pays once and which ``recompute`` and ``updates`` leave out.

    ``split_input[n]`` and ``split_weight[n]`` are the backward split as ``"zero_bubble"`` and ``"zbv"`` run it, per
    layer: the engine's input pass (its walk of the autograd graph and the input's gradient) and its weight pass (one
    autograd call per group of parameters), together more than the whole backward. ``split_walk[n]`` is the input pass
    of a layer whose input takes no gradient, as on the first stage, where it only walks the graph and the weight pass
    runs the whole backward. ``split_input_below`` and ``split_weight_below`` are what each pass adds per autograd node
    of the layers below it in a stage (:class:`SplitTimes`), a walk whatever the size, timed at the smallest. Empty
    when not measured.
    """

    layers: tuple[LayerProfile, ...]
    input_bytes: float  # per sample, the first layer's input
    times: dict[int, tuple[tuple[float, ...], tuple[float, ...]]] = field(default_factory=dict)
    device: str = "cpu"
    loss_saved_bytes: float = 0.0  # per sample: what the loss keeps for backward, on the last stage
    loss_transient_bytes: float = 0.0  # per sample: the loss's backward peak above that
    recompute: dict[int, tuple[float, ...]] = field(default_factory=dict)  # per size: seconds per layer
    recompute_call: float = 0.0  # seconds per re-materialized micro-batch and stage
    recompute_forward: dict[int, tuple[float, ...]] = field(default_factory=dict)  # per size: the forward's share
    selective_recompute: dict[int, tuple[float, ...]] = field(default_factory=dict)  # per size: seconds per layer
    selective_forward: dict[int, tuple[float, ...]] = field(default_factory=dict)  # per size: the forward's share
    updates: tuple[float, ...] = ()  # per layer: seconds of one optimizer step over its parameters; () unmeasured
    update_call: float = 0.0  # seconds per optimizer step and stage
    split_input: dict[int, tuple[float, ...]] = field(default_factory=dict)  # per size: seconds per layer
    split_weight: dict[int, tuple[float, ...]] = field(default_factory=dict)  # per size: seconds per layer
    split_walk: dict[int, tuple[float, ...]] = field(default_factory=dict)  # per size: seconds per layer
    split_input_below: tuple[float, ...] = ()  # per layer: seconds per node below, at every size
    split_weight_below: tuple[float, ...] = ()  # per layer: seconds per node below, at every size

    def __len__(self) -> int:
        return len(self.layers)

    def pass_times(self, samples: int) -> tuple[list[float], list[float]]:
        """Forward and backward seconds of every layer for a micro-batch of ``samples`` samples.

        A measured size gives its measurement. Otherwise, with three or more measured sizes each layer's times are
        fitted as ``a + b·samples`` by Theil-Sen (the median of the pairwise slopes); with fewer, the nearest
        measurement is scaled (one size) or the two are interpolated.
        """
        if not self.times:
            raise ValueError("this profile has no times; profile with microbatch_sizes or flops_per_second")
        forward = _at_size({n: f for n, (f, _) in self.times.items()}, samples)
        backward = _at_size({n: b for n, (_, b) in self.times.items()}, samples)
        return forward, backward

    def recompute_times(self, samples: int, *, selective: bool = False) -> list[float] | None:
        """Seconds re-materialization adds to each layer for a micro-batch of ``samples`` samples (as
        :meth:`pass_times` fits them), without the wrapper's per-call ``recompute_call``; ``None`` if not measured.
        ``selective``: under the selective wrapper."""
        table = self.selective_recompute if selective else self.recompute
        return _at_size(table, samples) if table else None

    def recompute_forward_times(self, samples: int, *, selective: bool = False) -> list[float]:
        """The part of :meth:`recompute_times` that a re-materialized micro-batch pays in its forward pass, per layer
        (zeros when not measured: the whole cost then falls in the backward)."""
        table = self.selective_forward if selective else self.recompute_forward
        if not table:
            return [0.0] * len(self.layers)
        return _at_size(table, samples)

    def split_times(self, samples: int) -> SplitTimes | None:
        """Seconds of each layer's split backward for a micro-batch of ``samples`` samples (as :meth:`pass_times` fits
        them); ``None`` if not measured."""
        if not self.split_input:
            return None
        tables = (self.split_input, self.split_weight, self.split_walk)
        below = [list(b) if b else [0.0] * len(self.layers) for b in (self.split_input_below, self.split_weight_below)]
        return SplitTimes(*(_at_size(table, samples) for table in tables), *below)

    def stage_update(self, cell: range) -> float:
        """Seconds of the optimizer step of a stage that holds the layers ``cell`` (0 when not measured)."""
        if not self.updates:
            return 0.0
        trainable = any(self.layers[i].trainable_bytes for i in cell)
        return sum(self.updates[i] for i in cell) + (self.update_call if trainable else 0.0)

    def scaled(self, *, layers: int | None = None) -> ModelProfile:
        """This profile with its layers repeated (cyclically) to ``layers`` entries: a deeper model of the same kind."""
        if layers is None or layers == len(self.layers):
            return self

        def repeat(values: tuple[Any, ...]) -> tuple[Any, ...]:
            return tuple(values[i % len(values)] for i in range(layers)) if values else ()

        return replace(
            self,
            layers=repeat(self.layers),
            times={n: (repeat(f), repeat(b)) for n, (f, b) in self.times.items()},
            recompute={n: repeat(r) for n, r in self.recompute.items()},
            recompute_forward={n: repeat(r) for n, r in self.recompute_forward.items()},
            selective_recompute={n: repeat(r) for n, r in self.selective_recompute.items()},
            selective_forward={n: repeat(r) for n, r in self.selective_forward.items()},
            updates=repeat(self.updates),
            split_input={n: repeat(t) for n, t in self.split_input.items()},
            split_weight={n: repeat(t) for n, t in self.split_weight.items()},
            split_walk={n: repeat(t) for n, t in self.split_walk.items()},
            split_input_below=repeat(self.split_input_below),
            split_weight_below=repeat(self.split_weight_below),
        )


def _at_size(table: dict[int, tuple[float, ...]], samples: int) -> list[float]:
    """Per-layer seconds at ``samples`` from seconds measured at the sizes ``table`` holds (see
    :meth:`ModelProfile.pass_times`)."""
    sizes = sorted(table)
    if samples in table:
        return list(table[samples])
    if len(sizes) >= 3:
        fitted: list[float] = []
        for layer in range(len(table[sizes[0]])):
            points = [(n, table[n][layer]) for n in sizes]
            slopes = [(tb - ta) / (nb - na) for i, (na, ta) in enumerate(points) for nb, tb in points[i + 1 :]]
            slope = max(0.0, statistics.median(slopes))
            intercept = max(0.0, statistics.median(t - slope * n for n, t in points))
            fitted.append(intercept + slope * samples)
        return fitted
    if len(sizes) == 2 and sizes[0] < samples < sizes[1]:
        share = (samples - sizes[0]) / (sizes[1] - sizes[0])
        return [a + (b - a) * share for a, b in zip(table[sizes[0]], table[sizes[1]], strict=True)]
    nearest = min(sizes, key=lambda n: abs(n - samples))
    return [t * samples / nearest for t in table[nearest]]


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
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        for tensor in _tensors(output):
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in inputs or key in self._sizes:
                continue
            self._sizes[key] = size
            self.live += size
            weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.live)
        return output


def _tensors(value: Any) -> list[Tensor]:
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
    tensors = [t for layer in layers for t in (*layer.parameters(), *layer.buffers())] + _tensors(sample)
    cuda_indices = sorted({t.get_device() for t in tensors if t.is_cuda})
    with torch.random.fork_rng(devices=cuda_indices, device_type="cuda"):
        try:
            yield
        finally:
            with torch.no_grad():
                for module, name, buffer, saved in snapshot:
                    buffer.copy_(saved)
                    setattr(module, name, buffer)


def _resized(sample: Any, samples: int) -> Any:
    """``sample`` with ``samples`` rows along dim 0 (rows repeated or dropped)."""

    def resize(t: Tensor) -> Tensor:
        if t.dim() == 0:
            return t
        repeats = math.ceil(samples / t.shape[0])
        return t.repeat(repeats, *([1] * (t.dim() - 1)))[:samples].clone() if repeats > 1 else t[:samples].clone()

    return map_tensors(resize, sample)


def _storage_bytes(value: Any) -> int:
    seen: dict[int, int] = {}
    for t in _tensors(value):
        seen[storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _on(layer: nn.Module, device: torch.device) -> bool:
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
    if device.type == "meta" or _on(layer, device):
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
        x = _output(real, x)
        del real


def _output(layer: nn.Module, x: Any) -> Any:
    """``layer``'s output on ``x``, detached; run on a copy, which an in-place layer may overwrite."""
    with torch.no_grad():
        return map_tensors(lambda t: t.detach(), layer(map_tensors(lambda t: t.clone(), x)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _input(value: Any, grad: bool) -> tuple[list[Tensor], Any]:
    """The layer's input as training sees it: a boundary's gets a gradient, the model's input (the batch) none."""
    if grad:
        return leaf_input(value)
    return [], map_tensors(lambda t: t.clone(), value)


def _pass_seconds(
    run: Callable[[Any], Any], layer: nn.Module, value: Any, device: torch.device, input_grad: bool = True
) -> tuple[float, float]:
    """Seconds of one forward and one backward of ``run`` (``layer``, perhaps followed by the loss) on ``value``."""
    leaves, x = _input(value, input_grad)
    params = [p for p in layer.parameters() if p.requires_grad]
    _sync(device)
    start = time.perf_counter()
    output = run(x)
    _sync(device)
    middle = time.perf_counter()
    outputs = [t for t in _tensors(output) if t.requires_grad]
    wrt = leaves + params
    if outputs and wrt:
        torch.autograd.grad(outputs, wrt, grad_outputs=[torch.ones_like(t) for t in outputs], allow_unused=True)
    _sync(device)
    return middle - start, time.perf_counter() - middle


BELOW = 64
"""Autograd nodes put below a layer to time what its split pays per node of the layers before it in a stage."""


def _split_seconds(
    layer: nn.Module,
    loss_fn: LossFn | None,
    value: Any,
    device: torch.device,
    input_grad: bool = True,
    below: int = 0,
) -> tuple[float, float, float]:
    """Seconds of the split backward of ``layer`` (perhaps followed by the loss) on ``value``, after an untimed
    forward, as the engine runs it (:mod:`~lightning_gpipe.engine.split`): the input pass, the weight pass, and before
    them the input pass of a stage whose input takes no gradient (the walk of the graph alone). ``below`` views of the
    input, shared among its tensors, stand for the layers before it in a stage. The parameters' ``.grad``, which the
    weight pass accumulates into, are restored."""
    leaves, x = _input(value, input_grad)
    each = below // max(1, sum(t.requires_grad for t in _tensors(x)))

    def deepened(t: Tensor) -> Tensor:
        for _ in range(each if t.requires_grad else 0):
            t = t.view_as(t)
        return t

    x = map_tensors(deepened, x)
    params = [p for p in layer.parameters() if p.requires_grad]
    kept = [p.grad for p in params]
    cut: list[Tensor] = []

    def cut_off(t: Tensor) -> Tensor:
        # As the engine's last stage: the loss starts from leaves cut off the output, its backward runs whole first.
        if not t.requires_grad:
            return t
        cut.append(t.detach().requires_grad_())
        return cut[-1]

    try:
        for param in params:
            param.grad = None
        with torch.enable_grad():
            output = layer(x)
            loss = loss_fn(map_tensors(cut_off, output)) if loss_fn is not None else None
        outputs = [t for t in _tensors(output) if t.requires_grad]
        _sync(device)
        start = time.perf_counter()
        input_pass(outputs, None, [])
        _sync(device)
        walked = time.perf_counter()
        grads: list[Tensor] | None = None
        if loss is not None:
            torch.autograd.backward(loss)
            grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in cut]
        _, weights = input_pass(outputs, grads, leaves)
        _sync(device)
        middle = time.perf_counter()
        weights.run()
        _sync(device)
        end = time.perf_counter()
    finally:
        for param, grad in zip(params, kept, strict=True):
            param.grad = grad
    return middle - walked, end - middle, walked - start


def _split_pass(
    layer: nn.Module,
    loss_fn: LossFn | None,
    value: Any,
    device: torch.device,
    input_grad: bool = True,
    below: bool = True,
) -> Split:
    """:func:`_split_seconds` of ``layer``, then (``below``) what :data:`BELOW` nodes below it add to its two passes."""
    shallow = _split_seconds(layer, loss_fn, value, device, input_grad)
    if not below:
        return (*shallow, 0.0, 0.0)
    deep = _split_seconds(layer, loss_fn, value, device, input_grad, below=BELOW)
    return (*shallow, deep[0] - shallow[0], deep[1] - shallow[1])


def _graph_nodes(layer: nn.Module, value: Any, input_grad: bool) -> int:
    """The autograd nodes of ``layer``'s backward on ``value``, those of its input's copy left out."""
    x = _input(value, input_grad)[1]
    with torch.enable_grad():
        output = layer(x)
    stop = {t.grad_fn for t in _tensors(x) if t.grad_fn is not None}
    stack = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None and t.grad_fn not in stop]
    seen = set(stack)
    while stack:
        for child, _ in stack.pop().next_functions:
            if child is not None and child not in seen and child not in stop:
                seen.add(child)
                stack.append(child)
    return len(seen)


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
    _saved_forward(layer, _input(value, input_grad)[1], state, saved)
    return float(sum(saved.values()))


@dataclass(frozen=True)
class _Bytes:
    """What :func:`_activation_bytes` counts, for the whole sample (not per sample)."""

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


def _activation_bytes(run: Callable[[Any], Any], value: Any, state: set[int], input_grad: bool = True) -> _Bytes:
    """Bytes of one forward plus backward of ``run`` on ``value`` (not per sample): saved (as :func:`saved_bytes`
    counts them), output, transient, the parts of the saved bytes that are the input's and the output's own storages,
    and the same per leaf."""
    saved: dict[int, int] = {}

    def shared(tensors: Any) -> float:
        keys = {storage_key(t) for t in _tensors(tensors)}
        return float(sum(size for key, size in saved.items() if key in keys))

    leaves, x = _input(value, input_grad)
    if any(t.is_meta for t in leaves) or any(t.is_meta for t in _tensors(x)):
        output = _saved_forward(run, x, state, saved)
        out_bytes = _storage_bytes(output)
        # No storage to watch on meta: the backward holds the output's gradient and the input's.
        transient = float(2 * max(out_bytes, _storage_bytes(x)))
        leaves_of = _leaf_bytes(x, output, saved)
        return _Bytes(float(sum(saved.values())), float(out_bytes), transient, shared(x), shared(output), **leaves_of)
    counter = LiveTensorBytes()
    with counter:
        output = _saved_forward(run, x, state, saved)
        after_forward = counter.live
        counter.reset_peak()
        outputs = [t for t in _tensors(output) if t.requires_grad]
        if outputs:
            torch.autograd.grad(outputs, outputs + leaves, [torch.ones_like(t) for t in outputs], allow_unused=True)
    transient = float(max(0, counter.peak - after_forward))
    total = float(sum(saved.values()))
    return _Bytes(
        total, float(_storage_bytes(output)), transient, shared(x), shared(output), **_leaf_bytes(x, output, saved)
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
            for tensor in _tensors(output):
                self.kept[storage_key(tensor)] = tensor
        return output


def _selective_bytes(layer: nn.Module, value: Any, input_grad: bool) -> tuple[float, float]:
    """Bytes (not per sample) that ``checkpoint="selective"`` keeps of ``layer`` on ``value``: the outputs of the
    operators in ``KEPT_OPS`` that are not the layer's output, and those that are."""
    recorder = _KeptOutputs()
    with torch.enable_grad(), recorder:
        output = layer(_input(value, input_grad)[1])
    outputs = {storage_key(t) for t in _tensors(output)}
    sizes = {key: t.untyped_storage().nbytes() for key, t in recorder.kept.items()}
    inside = sum(size for key, size in sizes.items() if key not in outputs)
    return float(inside), float(sum(sizes.values()) - inside)


def _runner(
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


def _forward_flops(run: Callable[[Any], Any], value: Any) -> float:
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        run(map_tensors(lambda t: t.clone(), value))
    return float(counter.get_total_flops())


class _Floor:
    """What a timed pass costs whatever the layer, from passes of a one-element ``Linear``.

    - The floor: each layer is timed with its own module call and its own ``autograd.grad`` call (and, on a GPU, two
      waits for the device and autograd's hand-off to its device thread), which a stage pays once per micro-batch for
      all its layers, not once per layer. The planner takes it off every layer; the engine's per-micro-batch overhead
      (``DEFAULT_MICROBATCH_OVERHEAD``) is measured against the same profile and pays it once.
    - The checkpoint wrapper's own cost per call (saving and restoring the random state, its hooks' set-up): a
      re-materialized pass less a plain one.
    - The split backward's floor (:meth:`warm_split`), from a one-element parameter-free layer, whose split runs the
      engine's input and weight passes on a graph of no weights.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tiny = nn.Linear(1, 1).to(device)
        self.bare = nn.Tanh()
        self.value = torch.ones(1, 1, device=device)

    def timed_pass(self, rematerialized: bool = False) -> tuple[float, float]:
        """One pass, plain unless ``rematerialized``: ``(forward, backward)`` seconds."""
        return _pass_seconds(_runner(self.tiny, None, rematerialized, first=False), self.tiny, self.value, self.device)

    def warm(self) -> tuple[float, float]:
        """The floor now: the median of three passes after one untimed (the first pass after a large layer runs with
        its call machinery out of cache, and would time the layers short)."""
        self.timed_pass()
        passes = [self.timed_pass() for _ in range(3)]
        return statistics.median(f for f, _ in passes), statistics.median(b for _, b in passes)

    def warm_split(self, backward: float, below: bool = True) -> Split:
        """The split backward's floor now, as :meth:`warm` takes it, given the plain floor's ``backward``: the input
        pass's is that plus what an input pass costs beyond a plain backward on the parameter-free layer (its walk of
        the graph and set-up), so that a layer's input and weight passes less their floors exceed its backward less
        its floor by what its own split adds. The weight pass's and the walk's are the parameter-free layer's: a
        stage pays the weight pass's autograd call once per group of parameters, per layer with weights, and walks
        every layer's nodes. What :data:`BELOW` nodes add to its passes (their own backward and walk, which any layer
        pays) is taken off a layer's."""
        bare = _runner(self.bare, None, False, first=False)
        _split_pass(self.bare, None, self.value, self.device, below=below)
        splits = [_split_pass(self.bare, None, self.value, self.device, below=below) for _ in range(3)]
        plain = statistics.median(_pass_seconds(bare, self.bare, self.value, self.device)[1] for _ in range(3))
        input_, weight, walk, input_below, weight_below = (
            statistics.median(split[part] for split in splits) for part in range(5)
        )
        return backward + max(0.0, input_ - plain), weight, walk, input_below, weight_below

    def wrapper_call(self, runs: int) -> float:
        """The wrapper's cost per call: the median of at least 15 wrapped passes, each less the plain one before it."""
        extra = []
        for _ in range(max(runs, 15)):
            plain = self.timed_pass()
            extra.append(sum(self.timed_pass(rematerialized=True)) - sum(plain))
        return max(0.0, statistics.median(extra))


Pass = tuple[float, float]  # (forward, backward) seconds
# A split backward's seconds: input pass, weight pass, walk alone, and what BELOW nodes below add to the two passes
Split = tuple[float, float, float, float, float]


@dataclass(frozen=True)
class Passes:
    """The timed passes of every layer, warm-up dropped: ``plain[i]`` holds layer ``i``'s ``(forward, backward)``
    seconds per round, ``wrapped[i]`` the same under the engine's checkpoint wrapper (empty unless asked),
    ``floors[i]`` the floor (a one-element layer's pass) timed at the start of each of those rounds, ``selective[i]``
    the passes under the selective wrapper (empty unless asked), and ``split[i]`` the split backward's seconds
    (:data:`Split`) with ``split_floors[i]`` their floor (empty unless asked)."""

    plain: list[list[Pass]]
    wrapped: list[list[Pass]]
    floors: list[list[Pass]]
    selective: list[list[Pass]] = field(default_factory=list)
    split: list[list[Split]] = field(default_factory=list)
    split_floors: list[list[Split]] = field(default_factory=list)

    def medians(self) -> list[float]:
        """Per layer, the median seconds of a forward plus a backward pass, floor included."""
        return [statistics.median(f + b for f, b in runs) for runs in self.plain]


def timed_passes(
    layers: Sequence[nn.Module],
    sample: Any,
    device: torch.device,
    *,
    repeats: int,
    warmup: int,
    loss_fn: LossFn | None = None,
    rematerialized: bool = False,
    input_grad: bool = False,
    floor: _Floor | None = None,
    selective: bool = False,
    split: bool = False,
    split_below: bool = False,
) -> Passes:
    """Time ``warmup + repeats`` forward and backward passes of every layer on ``device``, each on its input from
    ``sample``, and keep the last ``repeats``.

    Layers on the device are timed round-robin, so that a burst of load on a shared machine spreads over all layers
    instead of inflating one: every layer plain, then every layer under the checkpoint wrapper if
    ``rematerialized``, then under the selective wrapper if ``selective``, then with the backward split as the
    engine's zero-bubble schedules split it if ``split`` (and again with :data:`BELOW` autograd nodes below each layer
    if ``split_below``), so that each pass follows another layer's, as in a stage (a layer's second pass in a row runs
    warm). Other layers (on the meta device, or on the CPU for a
    GPU) are copied there and timed one after the other, so that only one copy exists at a time. Each round starts
    with the floor. ``loss_fn`` runs after the last layer, outside the wrapper; the first layer's input gets a
    gradient only with ``input_grad``, as the model's batch gets none. The backward is ``torch.autograd.grad``, so
    no parameter's ``.grad`` changes (the split's weight pass accumulates, and each parameter's ``.grad`` is put
    back); buffers and the random number generators are restored (:func:`preserved_state`).
    """
    round_robin = all(_on(layer, device) for layer in layers)
    last = len(layers) - 1
    # 0: plain, 1: under the checkpoint wrapper, 2: under the selective one, 3: the backward split
    variants = (0, *([1] if rematerialized else []), *([2] if selective else []), *([3] if split else []))
    # runs[variant][layer]: (forward, backward) seconds of every timed run (split_runs: the split's); floors[layer]:
    # the floor timed just before the round (round-robin) or the layer's runs (one after the other) it belongs to
    runs: list[list[list[Pass]]] = [[[] for _ in layers] for _ in range(3)]
    split_runs: list[list[Split]] = [[] for _ in layers]
    floors: list[list[Pass]] = [[] for _ in layers]
    split_floors: list[list[Split]] = [[] for _ in layers]

    def time_pass(layer: nn.Module, index: int, value: Any, variant: int) -> None:
        grad = input_grad or index > 0
        loss = loss_fn if index == last else None
        if variant == 3:
            split_runs[index].append(_split_pass(layer, loss, value, device, input_grad=grad, below=split_below))
            return
        run = _runner(layer, loss, variant == 1, index == 0, selective=variant == 2)
        with torch.enable_grad():
            runs[variant][index].append(_pass_seconds(run, layer, value, device, input_grad=grad))

    def floor_now(floor: _Floor) -> tuple[Pass, Split]:
        now = floor.warm()
        return now, floor.warm_split(now[1], split_below) if split else (0.0, 0.0, 0.0, 0.0, 0.0)

    with preserved_state(layers, sample):
        floor = floor if floor is not None else _Floor(device)  # inside: its Linear draws from the generator
        inputs: list[Any] = []
        for index, (real, x) in enumerate(layer_inputs(layers, sample, device)):
            inputs.append(x)
            if not round_robin:
                # Each pass but the first follows one of the same layer: both variants run warm alike.
                now, split_now = floor_now(floor)
                for _ in range(warmup + repeats):
                    floors[index].append(now)
                    split_floors[index].append(split_now)
                    for wrapped in variants:
                        time_pass(real, index, x, wrapped)
        if round_robin:
            for _ in range(warmup + repeats):
                now, split_now = floor_now(floor)
                for layer_floors, layer_split_floors in zip(floors, split_floors, strict=True):
                    layer_floors.append(now)
                    layer_split_floors.append(split_now)
                for wrapped in variants:
                    for index, layer in enumerate(layers):
                        time_pass(layer, index, inputs[index], wrapped)
    kept = [[layer_runs[warmup:] for layer_runs in variant_runs] for variant_runs in runs]
    return Passes(
        kept[0],
        kept[1],
        [f[warmup:] for f in floors],
        kept[2] if selective else [],
        [r[warmup:] for r in split_runs] if split else [],
        [f[warmup:] for f in split_floors] if split else [],
    )


def profile_layers(
    layers: Iterable[nn.Module],
    sample: Any,
    *,
    microbatch_sizes: Sequence[int] = (),
    device: torch.device | str | None = None,
    loss_fn: LossFn | None = None,
    flops_per_second: float | None = None,
    repeats: int = 3,
    warmup: int = 1,
    rematerialized: bool = True,
    optimizer: OptimizerFactory | None = torch.optim.Adam,
    selective: bool = False,
    split: bool = False,
) -> ModelProfile:
    """Profile ``layers`` for training on ``device``.

    Args:
        layers: the model's sequence of layers (an ``nn.Sequential``); real or on the meta device.
        sample: an input of the first layer with a batch dimension (any number of rows; it is repeated or cut to each
            micro-batch size). On the meta device only with ``flops_per_second``.
        microbatch_sizes: the micro-batch sizes to time; bytes are counted at the smallest (they grow linearly).
        device: where to run; defaults to the sample's device. Meta layers are materialized there one at a time.
        loss_fn: ``loss_fn(last_output) -> scalar``, its time counted with the last layer, its activations
            apart (they are kept per micro-batch whatever the re-materialization).
        flops_per_second: time each layer analytically from its FLOPs at this rate instead of measuring
            (backward = 2 × forward), e.g. for a device you do not have.
        repeats: timed runs per layer and size (the median is kept).
        warmup: untimed runs first (lazy initialisation, allocator growth, kernel selection).
        rematerialized: also time each layer under the engine's checkpoint wrapper (what re-materialization adds);
            skip it when no checkpoint mode but ``"never"`` will be weighed.
        selective: also time each layer under the selective wrapper (``checkpoint="selective"``); what it keeps is
            counted either way.
        split: also time each layer's backward split as ``"zero_bubble"`` and ``"zbv"`` run it, with the engine's
            own input and weight passes (:mod:`~lightning_gpipe.engine.split`); skip it when neither is weighed.
        optimizer: the optimizer whose step is timed over each layer's parameters (zero-filled copies: the model is
            not changed); ``None`` leaves the step out. Neither is timed with ``flops_per_second``.

    Raises:
        ValueError: no micro-batch size, a meta sample without ``flops_per_second``, or bad counts.
    """
    layers = list(layers)
    sizes = sorted({int(n) for n in microbatch_sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"microbatch_sizes={list(microbatch_sizes)!r} must name at least one size >= 1")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    tensors = _tensors(sample)
    target = torch.device(device) if device is not None else (tensors[0].device if tensors else torch.device("cpu"))
    if target.type == "meta" and flops_per_second is None:
        raise ValueError(
            "the sample is on the meta device, where nothing can be timed; pass flops_per_second= (the device's "
            "sustained FLOP rate) to time layers from their FLOPs, or give a real sample and device"
        )
    sample = map_tensors(lambda t: t.to(target), sample)
    rows = sizes[0]
    with preserved_state(layers, sample):
        # Bytes at the smallest size, layer by layer (meta layers materialized one at a time).
        base = _resized(sample, rows)
        seen: set[int] = set()
        results: list[LayerProfile] = []
        last: tuple[nn.Module, Any] | None = None
        for index, (layer, (real, x)) in enumerate(zip(layers, layer_inputs(layers, base, target), strict=True)):
            params, trainable, buffers = state_bytes(layer, seen)
            counted = _activation_bytes(real, x, state_keys([real]), input_grad=index > 0)
            kept_inside, kept_output = _selective_bytes(real, x, input_grad=index > 0)
            flops = _forward_flops(real, x)
            results.append(
                LayerProfile(
                    type(layer).__name__,
                    params,
                    trainable,
                    buffers,
                    counted.saved / rows,
                    counted.output / rows,
                    counted.transient / rows,
                    flops / rows,
                    counted.saved_input / rows,
                    counted.saved_output / rows,
                    tuple(b / rows for b in counted.saved_input_leaves),
                    tuple(b / rows for b in counted.output_leaves),
                    tuple(b / rows for b in counted.saved_output_leaves),
                    counted.passthrough,
                    kept_inside / rows,
                    kept_output / rows,
                    _graph_nodes(real, x, input_grad=index > 0) if split else 0,
                )
            )
            last = (real, x)
        # The loss runs after the last stage's cell, outside its re-materialization: its activations stay per
        # micro-batch whatever the checkpoint mode, so they are kept apart from the last layer's.
        loss_bytes = (0.0, 0.0)  # per sample: saved, transient
        if loss_fn is not None and last is not None:
            counted = _activation_bytes(loss_fn, _output(*last), set())
            loss_bytes = (counted.saved / rows, counted.transient / rows)
        if flops_per_second is not None:
            times = _flop_times(results, sizes, flops_per_second)
            return ModelProfile(tuple(results), _storage_bytes(base) / rows, times, str(target), *loss_bytes)
        measured = _measured_times(
            layers, loss_fn, sample, sizes, target, repeats, warmup, rematerialized, selective, split
        )
        updates, update_call = _update_times(layers, optimizer, target, repeats, warmup)
    return ModelProfile(
        tuple(results),
        _storage_bytes(base) / rows,
        measured.times,
        str(target),
        *loss_bytes,
        recompute=measured.recompute,
        recompute_call=measured.recompute_call,
        recompute_forward=measured.recompute_forward,
        selective_recompute=measured.selective_recompute,
        selective_forward=measured.selective_forward,
        updates=updates,
        update_call=update_call,
        split_input=measured.split_input,
        split_weight=measured.split_weight,
        split_walk=measured.split_walk,
        split_input_below=measured.split_input_below,
        split_weight_below=measured.split_weight_below,
    )


def _flop_times(
    layers: list[LayerProfile], sizes: list[int], rate: float
) -> dict[int, tuple[tuple[float, ...], tuple[float, ...]]]:
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"flops_per_second={rate!r} must be a positive finite rate")
    return {
        n: (tuple(layer.flops * n / rate for layer in layers), tuple(2 * layer.flops * n / rate for layer in layers))
        for n in sizes
    }


@dataclass(frozen=True)
class _Measured:
    times: dict[int, tuple[tuple[float, ...], tuple[float, ...]]]
    recompute: dict[int, tuple[float, ...]]
    recompute_call: float
    recompute_forward: dict[int, tuple[float, ...]]
    selective_recompute: dict[int, tuple[float, ...]]
    selective_forward: dict[int, tuple[float, ...]]
    split_input: dict[int, tuple[float, ...]]
    split_weight: dict[int, tuple[float, ...]]
    split_walk: dict[int, tuple[float, ...]]
    split_input_below: tuple[float, ...]
    split_weight_below: tuple[float, ...]


def _measured_times(
    layers: list[nn.Module],
    loss_fn: LossFn | None,
    sample: Any,
    sizes: list[int],
    device: torch.device,
    repeats: int,
    warmup: int,
    rematerialized: bool,
    selective: bool = False,
    split: bool = False,
) -> _Measured:
    """The planner's pass times at each size: each pass less its round's floor, and what the wrappers add."""
    floor = _Floor(device)
    call = floor.wrapper_call(repeats + warmup) if rematerialized or selective else 0.0
    times: dict[int, tuple[tuple[float, ...], tuple[float, ...]]] = {}
    recompute: dict[int, tuple[float, ...]] = {}
    recompute_forward: dict[int, tuple[float, ...]] = {}
    selective_recompute: dict[int, tuple[float, ...]] = {}
    selective_forward: dict[int, tuple[float, ...]] = {}
    split_times: list[dict[int, tuple[float, ...]]] = [{}, {}, {}]  # input, weight, walk
    below: list[tuple[float, ...]] = [(), ()]  # input, weight: per node below, at the smallest size only
    for n in sizes:
        passes = timed_passes(
            layers,
            _resized(sample, n),
            device,
            repeats=repeats,
            warmup=warmup,
            loss_fn=loss_fn,
            rematerialized=rematerialized,
            floor=floor,
            selective=selective,
            split=split,
            split_below=split and n == sizes[0],
        )
        # Each pass less the floor timed at the start of its round: the median of these paired differences cancels the
        # machine's drift over the profile, which a floor timed once, before all the layers, would keep.
        plain = list(zip(passes.plain, passes.floors, strict=True))
        times[n] = (
            tuple(_less_floor(runs, floors, 0) for runs, floors in plain),
            tuple(_less_floor(runs, floors, 1) for runs, floors in plain),
        )
        if rematerialized:
            recompute[n], recompute_forward[n] = _added(passes.plain, passes.wrapped, call)
        if selective:
            selective_recompute[n], selective_forward[n] = _added(passes.plain, passes.selective, call)
        if split:
            pairs = list(zip(passes.split, passes.split_floors, strict=True))
            for part, table in enumerate(split_times):
                table[n] = tuple(_less_floor(runs, floors, part) for runs, floors in pairs)
            if n == sizes[0]:
                below = [tuple(_less_floor(runs, floors, part) / BELOW for runs, floors in pairs) for part in (3, 4)]
    input_, weight, walk = split_times
    return _Measured(
        times, recompute, call, recompute_forward, selective_recompute, selective_forward, input_, weight, walk, *below
    )


def _added(
    plain: list[list[Pass]], wrapped: list[list[Pass]], call: float
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per layer, what a wrapper adds to a pass (its per-call ``call`` left out), and the forward's share of it."""
    # Each wrapped pass ran in the same round as its plain one: the median of the paired differences cancels the
    # machine's drift between rounds, which a difference of two medians keeps.
    pairs = [list(zip(once, again, strict=True)) for once, again in zip(plain, wrapped, strict=True)]
    total = tuple(max(0.0, statistics.median(sum(a) - sum(p) for p, a in layer_pairs) - call) for layer_pairs in pairs)
    # The forward's share, at most the whole: what the wrapped forward takes beyond the plain one.
    forward = tuple(
        min(whole, max(0.0, statistics.median(a[0] - p[0] for p, a in layer_pairs)))
        for layer_pairs, whole in zip(pairs, total, strict=True)
    )
    return total, forward


def _less_floor(passes: Sequence[tuple[float, ...]], floors: Sequence[tuple[float, ...]], part: int) -> float:
    """The median of the passes' ``part`` (of a :data:`Pass` or a :data:`Split`), each less the floor it was timed
    with."""
    return max(0.0, statistics.median(p[part] - f[part] for p, f in zip(passes, floors, strict=True)))


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
        _sync(device)
        start = time.perf_counter()
        stepper.step()
        _sync(device)
        if index >= warmup:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _update_times(
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
