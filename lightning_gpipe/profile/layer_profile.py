"""The profile: what each layer of a sequence costs in training (:class:`LayerProfile`, :class:`ModelProfile`), and
:func:`profile_layers`, which measures it for the planner, each layer run alone on the previous one's output
(:mod:`~lightning_gpipe.profile.layer_run`): pass times per micro-batch size (:mod:`~lightning_gpipe.profile.timing`, or
the analytic time of its FLOPs) and bytes (:mod:`~lightning_gpipe.profile.tensor_bytes`). A model built on the meta
device is profiled one layer at a time, so only one layer must fit; the model itself is left unchanged."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_gpipe.engine.tree import map_tensors
from lightning_gpipe.profile.layer_run import (
    LossFn,
    layer_inputs,
    layer_output,
    preserved_state,
    resized,
    tensor_leaves,
)
from lightning_gpipe.profile.optimizer_step import OptimizerFactory, update_times
from lightning_gpipe.profile.tensor_bytes import (
    activation_bytes,
    selective_bytes,
    state_bytes,
    state_keys,
    storage_bytes,
    weighted_output_bytes,
)
from lightning_gpipe.profile.timing import graph_nodes, measured_times

__all__ = ["LayerProfile", "ModelProfile", "SplitTimes", "profile_layers"]


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
    # Per sample, the outputs of its operations with a trainable weight (measured with split=True): the output
    # gradients a split backward keeps from the input pass to the weight pass.
    weighted_output_bytes: float = 0.0
    # Its largest trainable parameter: the gradient a backward pass computes at once before adding it to the one held
    # (0: not recorded, taken as all of trainable_bytes).
    largest_trainable_bytes: int = 0

    @property
    def computed_gradient_bytes(self) -> int:
        """The most bytes of parameter gradient its backward computes at once (see ``largest_trainable_bytes``)."""
        return self.largest_trainable_bytes or self.trainable_bytes


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
    tensors = tensor_leaves(sample)
    target = torch.device(device) if device is not None else (tensors[0].device if tensors else torch.device("cpu"))
    if target.type == "meta" and flops_per_second is None:
        raise ValueError(
            "the sample is on the meta device, where nothing can be timed; pass flops_per_second=, or a real sample"
        )
    sample = map_tensors(lambda t: t.to(target), sample)
    rows = sizes[0]
    with preserved_state(layers, sample):
        # Bytes at the smallest size, layer by layer (meta layers materialized one at a time).
        base = resized(sample, rows)
        results, last = _layer_bytes(layers, base, rows, target, split)
        # The loss runs after the last stage's cell, outside its re-materialization: its activations stay per
        # micro-batch whatever the checkpoint mode, so they are kept apart from the last layer's.
        loss_bytes = (0.0, 0.0)  # per sample: saved, transient
        if loss_fn is not None and last is not None:
            counted = activation_bytes(loss_fn, layer_output(*last), set())
            loss_bytes = (counted.saved / rows, counted.transient / rows)
        profile = ModelProfile(tuple(results), storage_bytes(base) / rows, {}, str(target), *loss_bytes)
        if flops_per_second is not None:
            return replace(profile, times=_flop_times(results, sizes, flops_per_second))
        measured = measured_times(
            layers, loss_fn, sample, sizes, target, repeats, warmup, rematerialized, selective, split
        )
        updates, update_call = update_times(layers, optimizer, target, repeats, warmup)
    return replace(profile, updates=updates, update_call=update_call, **measured.profile_fields())


def _layer_bytes(
    layers: list[nn.Module], base: Any, rows: int, target: torch.device, split: bool
) -> tuple[list[LayerProfile], tuple[nn.Module, Any] | None]:
    """Each layer's profile but its times, per sample of ``base``'s ``rows``, and the last layer with its input.

    Meta layers are materialized on ``target`` one at a time; ``split``: also what a split backward counts.
    """
    seen: set[int] = set()
    results: list[LayerProfile] = []
    last: tuple[nn.Module, Any] | None = None
    for index, (layer, (real, x)) in enumerate(zip(layers, layer_inputs(layers, base, target), strict=True)):
        params, trainable, buffers = state_bytes(layer, seen)
        counted = activation_bytes(real, x, state_keys([real]), input_grad=index > 0)
        kept_inside, kept_output = selective_bytes(real, x, input_grad=index > 0)
        results.append(
            LayerProfile(
                type(layer).__name__,
                params,
                trainable,
                buffers,
                counted.saved / rows,
                counted.output / rows,
                counted.transient / rows,
                _forward_flops(real, x) / rows,
                counted.saved_input / rows,
                counted.saved_output / rows,
                tuple(b / rows for b in counted.saved_input_leaves),
                tuple(b / rows for b in counted.output_leaves),
                tuple(b / rows for b in counted.saved_output_leaves),
                counted.passthrough,
                kept_inside / rows,
                kept_output / rows,
                graph_nodes(real, x, input_grad=index > 0) if split else 0,
                weighted_output_bytes(real, x, input_grad=index > 0) / rows if split else 0.0,
                max((p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad), default=0),
            )
        )
        last = (real, x)
    return results, last


def _forward_flops(run: Callable[[Any], Any], value: Any) -> float:
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        run(map_tensors(lambda t: t.clone(), value))
    return float(counter.get_total_flops())


def _flop_times(
    layers: list[LayerProfile], sizes: list[int], rate: float
) -> dict[int, tuple[tuple[float, ...], tuple[float, ...]]]:
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"flops_per_second={rate!r} must be a positive finite rate")
    return {
        n: (tuple(layer.flops * n / rate for layer in layers), tuple(2 * layer.flops * n / rate for layer in layers))
        for n in sizes
    }
