"""Per-layer costs that partitioning balances (the paper's c_i).

Each source returns one non-negative float per layer of an ``nn.Sequential``, for
:func:`~lightning_gpipe.partition.balance.balance_by_cost`:

- :func:`param_cost`: parameters per layer. Needs no input and works on the meta device.
- :func:`flops_cost`: analytic forward FLOPs on a sample. Deterministic, works on the meta device.
- :func:`time_cost`: measured forward + backward seconds. What the pipeline actually waits for, but noisy.
- :func:`memory_cost`: bytes a layer holds during training: saved activations, parameters, gradients and optimizer
  state. Deterministic; works on the meta device.

The sources that run the layers (flops, time, memory) feed each layer the previous layer's output, as
``nn.Sequential`` does, and leave the module as they found it: buffers (BatchNorm running statistics) and the torch
random number generators are restored, parameter ``.grad`` is never touched. Time and memory are measured by the
profiler the planner uses (:mod:`lightning_gpipe.profile.layer_profile`). Layers run in whatever mode (train or
eval) they are in; call ``.train()`` first to profile training.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_gpipe.engine.tree import flatten, map_tensors
from lightning_gpipe.profile.layer_run import layer_inputs, preserved_state
from lightning_gpipe.profile.tensor_bytes import saved_bytes, state_bytes, state_keys
from lightning_gpipe.profile.timing import timed_passes

__all__ = [
    "COST_SOURCES",
    "CostFn",
    "flops_cost",
    "layer_costs",
    "memory_cost",
    "param_cost",
    "time_cost",
]

CostFn = Callable[[nn.Module], float]
"""A user's cost of one layer (the paper's c_i): any non-negative number, larger meaning slower."""
COST_SOURCES: tuple[str, ...] = ("params", "flops", "time", "memory")
"""The built-in cost sources; the last three run the layers on a sample input."""
_NEEDS_SAMPLE = ("flops", "time", "memory")


def layer_costs(layers: Iterable[nn.Module], how: str | CostFn | None = None, sample: Any = None) -> list[float]:
    """Return one cost per layer, computed the way ``how`` names.

    Args:
        layers: the layers to partition, usually an ``nn.Sequential``.
        how: ``"params"``, ``"flops"``, ``"time"``, ``"memory"`` (see the module docstring), or a callable
            ``cost(layer) -> float``. ``None`` picks an analytic source: ``"flops"`` when a ``sample`` is given,
            otherwise ``"params"``. Measured time is left to an explicit ``"time"`` because it differs from run to run,
            and so would the partition: every process of a job must agree on it, and a checkpoint's layout should not
            depend on how busy the machine was.
        sample: one micro-batch of input for the first layer (a tensor, or a tuple/list of tensors); needed by
            ``"flops"``, ``"time"`` and ``"memory"``.

    Raises:
        ValueError: unknown ``how``, a source that needs a sample without one, or a callable returning a negative or
            non-finite cost.
        TypeError: ``how`` is neither a string nor callable, or a callable returns something that is not a number.
    """
    layers = list(layers)
    if how is None:
        how = "flops" if sample is not None else "params"
    if callable(how):
        return _called_costs(layers, how)
    if not isinstance(how, str):
        raise TypeError(f"the cost source must be a name or a callable cost(layer), got {how!r} ({type(how).__name__})")
    if how not in COST_SOURCES:
        raise ValueError(
            f"unknown cost source {how!r}; use one of {', '.join(map(repr, COST_SOURCES))},"
            " or a callable cost(layer) -> float"
        )
    if how in _NEEDS_SAMPLE and sample is None:
        raise ValueError(
            f"cost source {how!r} runs the layers, so it needs a sample input; pass one micro-batch as sample=, or "
            "use 'params'"
        )
    if how == "params":
        return param_cost(layers)
    if how == "flops":
        return flops_cost(layers, sample)
    if how == "time":
        return time_cost(layers, sample)
    return memory_cost(layers, sample)


def _called_costs(layers: list[nn.Module], cost: CostFn) -> list[float]:
    costs: list[float] = []
    for index, layer in enumerate(layers):
        result = cost(layer)
        try:
            value = float(result)
        except (TypeError, ValueError):
            raise TypeError(
                f"the cost function returned {result!r} ({type(result).__name__}) for layer {index} "
                f"({type(layer).__name__}), not a number"
            ) from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                f"the cost function returned {value!r} for layer {index} ({type(layer).__name__});"
                " costs must be non-negative and finite"
            )
        costs.append(value)
    return costs


def param_cost(layers: Iterable[nn.Module]) -> list[float]:
    """Return the number of parameters of each layer.

    A parameter shared by several layers (tied embeddings) is counted once, in the first layer that holds it, so the
    costs add up to the model's parameter count. Frozen parameters count too: they occupy memory all the same.
    """
    seen: set[int] = set()
    costs: list[float] = []
    for layer in layers:
        count = 0
        for param in layer.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                count += param.numel()
        costs.append(float(count))
    return costs


def flops_cost(layers: Iterable[nn.Module], sample: Any) -> list[float]:
    """Return the forward FLOPs of each layer on ``sample``, as counted by ``torch.utils.flop_counter``.

    The counter's convention is two FLOPs per multiply-add of matrix products and convolutions (``nn.Linear(i, o)``
    on a batch of ``n`` costs ``2·n·i·o``); elementwise operations, normalisation and bias additions count zero, so
    an activation or BatchNorm layer costs 0. The backward pass is roughly twice the forward for these operations,
    so forward FLOPs rank layers the same way training does.

    Works with meta-device layers and a meta sample: FLOPs depend only on shapes.
    """
    layers = list(layers)
    costs: list[float] = []
    with preserved_state(layers, sample), torch.no_grad():
        # A copy, so that an in-place first layer (ReLU(inplace=True)) cannot change the caller's tensor.
        x = map_tensors(lambda t: t.clone(), sample)
        for layer in layers:
            counter = FlopCounterMode(display=False)
            with counter:
                x = layer(x)
            costs.append(float(counter.get_total_flops()))
    return costs


def time_cost(layers: Iterable[nn.Module], sample: Any, *, repeats: int = 5, warmup: int = 2) -> list[float]:
    """Return the median seconds of a forward plus a backward pass of each layer on ``sample``.

    Every layer is timed ``warmup + repeats`` times and the first ``warmup`` runs are dropped: they pay for lazy
    initialisation, allocator growth and kernel selection (the first ``torch.autograd.grad`` of a process alone
    imports sympy, seconds on a slow disk). The layers are timed round-robin rather than one after
    the other, so a burst of load on a shared machine spreads over all layers instead of inflating one. The median
    of the remaining runs is reported: unlike the mean it ignores a few runs delayed by the scheduler or the garbage
    collector, and unlike the minimum it does not reward a single lucky run.

    The backward pass is ``torch.autograd.grad`` with respect to the layer's input and parameters, with ones as the
    output gradient, so parameter ``.grad`` is left untouched. CUDA work is synchronised before the clock is read.
    The passes are :func:`~lightning_gpipe.profile.timing.timed_passes`, the planner's; unlike the planner, the cost
    keeps the floor every timed pass pays (a stage pays it once per micro-batch), which is the same for every layer.

    Raises:
        ValueError: a layer or the sample is on the meta device (there is nothing to time), or ``repeats < 1`` or
            ``warmup < 0``.
    """
    layers = list(layers)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an int >= 1: the median needs at least one timed run")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup={warmup!r} must be an int >= 0 (the number of untimed runs per layer)")
    _refuse_meta(layers, sample)

    # Every layer's input gets a gradient here, the first's too: the sample stands for any micro-batch.
    passes = timed_passes(layers, sample, _device(layers, sample), repeats=repeats, warmup=warmup, input_grad=True)
    return passes.medians()


def memory_cost(layers: Iterable[nn.Module], sample: Any, *, optimizer_slots: float = 2.0) -> list[float]:
    """Return the bytes each layer occupies during training with micro-batches shaped like ``sample``.

    The sum of

    - activations: tensors autograd saves for the layer's backward pass (found with
      ``torch.autograd.graph.saved_tensors_hooks``), each storage counted once; parameters and buffers the layer
      saves are not activations and are left out;
    - parameters and buffers (a tensor shared by several layers counts in the first one only);
    - gradients: one per trainable parameter;
    - optimizer state: ``optimizer_slots`` × the trainable parameters' bytes (2 for Adam's two moments, 1 for SGD
      with momentum, 0 for plain SGD).

    The count is deterministic and needs no allocator statistics, so it works alike on CPU, CUDA and the meta device
    (each device's kernels may save slightly different tensors: CPU dropout keeps a float mask, CUDA a bool one).
    Activations are those of one micro-batch: with re-materialization a stage rebuilds them for one micro-batch at a
    time, keeping only the boundary input of the others.

    Raises:
        ValueError: ``optimizer_slots`` is negative or not finite.
    """
    layers = list(layers)
    slots = float(optimizer_slots)
    if not math.isfinite(slots) or slots < 0:
        raise ValueError(
            f"optimizer_slots={optimizer_slots!r} must be a non-negative number, e.g. 2 for Adam, 0 for plain SGD"
        )
    # Any layer may save a parameter or buffer (its own or a tied one); none of them is a per-micro-batch activation.
    state = state_keys(layers)
    seen: set[int] = set()
    costs: list[float] = []
    with preserved_state(layers, sample):
        for layer, (real, x) in zip(layers, layer_inputs(layers, sample, _device(layers, sample)), strict=True):
            params, trainable, buffers = state_bytes(layer, seen)
            activation = saved_bytes(real, x, state | state_keys([real]), input_grad=True)
            costs.append(activation + params + trainable * (1.0 + slots) + buffers)
    return costs


def _device(layers: list[nn.Module], sample: Any) -> torch.device:
    """Where the layers run: the sample's device (the layers' when it holds no tensor)."""
    tensors = [t for t in flatten(sample)[0] if isinstance(t, Tensor)]
    tensors += [t for layer in layers for t in (*layer.parameters(), *layer.buffers())]
    return tensors[0].device if tensors else torch.device("cpu")


def _refuse_meta(layers: list[nn.Module], sample: Any) -> None:
    if any(isinstance(t, Tensor) and t.is_meta for t in flatten(sample)[0]):
        raise ValueError(
            "time_cost runs the layers, but the sample is on the meta device; give a real one, or use 'flops' or "
            "'params'"
        )
    for index, layer in enumerate(layers):
        if any(t.is_meta for t in (*layer.parameters(), *layer.buffers())):
            raise ValueError(
                f"time_cost runs the layers, but layer {index} ({type(layer).__name__}) is on the meta device; "
                "materialize it, or use 'flops' or 'params'"
            )
