"""Seconds of each layer's passes in training, timed on a device: forward and backward, under the checkpoint wrappers,
and the backward split as the zero-bubble schedules run it (:func:`timed_passes`), round-robin and each round with the
floor that any timed pass costs so that a consumer can take it off (:func:`measured_times`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gpipe.engine.split import input_pass
from lightning_gpipe.engine.tree import map_tensors
from lightning_gpipe.profile.layer_run import (
    LossFn,
    layer_inputs,
    on_device,
    preserved_state,
    resized,
    runner,
    tensor_leaves,
    training_input,
)

__all__ = [
    "BELOW",
    "Pass",
    "Passes",
    "Split",
    "graph_nodes",
    "measured_times",
    "sync",
    "timed_passes",
]

Pass = tuple[float, float]
"""A timed pass's ``(forward, backward)`` seconds."""
Split = tuple[float, float, float, float, float]
"""A split backward's seconds: input pass, weight pass, walk alone, and what :data:`BELOW` nodes below add to the two
passes."""


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA), so that a clock read after it sees the work done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pass_seconds(
    run: Callable[[Any], Any], layer: nn.Module, value: Any, device: torch.device, input_grad: bool = True
) -> tuple[float, float]:
    """Seconds of one forward and one backward of ``run`` (``layer``, perhaps followed by the loss) on ``value``."""
    leaves, x = training_input(value, input_grad)
    params = [p for p in layer.parameters() if p.requires_grad]
    sync(device)
    start = time.perf_counter()
    output = run(x)
    sync(device)
    middle = time.perf_counter()
    outputs = [t for t in tensor_leaves(output) if t.requires_grad]
    wrt = leaves + params
    if outputs and wrt:
        torch.autograd.grad(outputs, wrt, grad_outputs=[torch.ones_like(t) for t in outputs], allow_unused=True)
    sync(device)
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
    leaves, x = training_input(value, input_grad)
    each = below // max(1, sum(t.requires_grad for t in tensor_leaves(x)))

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
        outputs = [t for t in tensor_leaves(output) if t.requires_grad]
        sync(device)
        start = time.perf_counter()
        input_pass(outputs, None, [])
        sync(device)
        walked = time.perf_counter()
        grads: list[Tensor] | None = None
        if loss is not None:
            torch.autograd.backward(loss)
            grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in cut]
        _, weights = input_pass(outputs, grads, leaves)
        sync(device)
        middle = time.perf_counter()
        weights.run()
        sync(device)
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


def graph_nodes(layer: nn.Module, value: Any, input_grad: bool) -> int:
    """The autograd nodes of ``layer``'s backward on ``value``, those of its input's copy left out."""
    x = training_input(value, input_grad)[1]
    with torch.enable_grad():
        output = layer(x)
    stop = {t.grad_fn for t in tensor_leaves(x) if t.grad_fn is not None}
    stack = [t.grad_fn for t in tensor_leaves(output) if t.grad_fn is not None and t.grad_fn not in stop]
    seen = set(stack)
    while stack:
        for child, _ in stack.pop().next_functions:
            if child is not None and child not in seen and child not in stop:
                seen.add(child)
                stack.append(child)
    return len(seen)


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
        return _pass_seconds(runner(self.tiny, None, rematerialized, first=False), self.tiny, self.value, self.device)

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
        bare = runner(self.bare, None, False, first=False)
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
    round_robin = all(on_device(layer, device) for layer in layers)
    # 0: plain, 1: under the checkpoint wrapper, 2: under the selective one, 3: the backward split
    variants = (0, *([1] if rematerialized else []), *([2] if selective else []), *([3] if split else []))
    timer = _PassTimer(len(layers), device, loss_fn, input_grad, split, split_below)
    with preserved_state(layers, sample):
        floor = floor if floor is not None else _Floor(device)  # inside: its Linear draws from the generator
        inputs: list[Any] = []
        for index, (real, x) in enumerate(layer_inputs(layers, sample, device)):
            inputs.append(x)
            if not round_robin:
                # Each pass but the first follows one of the same layer: both variants run warm alike.
                now = timer.floor_now(floor)
                for _ in range(warmup + repeats):
                    timer.note_floor(now, [index])
                    for variant in variants:
                        timer.time_pass(real, index, x, variant)
        if round_robin:
            for _ in range(warmup + repeats):
                timer.note_floor(timer.floor_now(floor), range(len(layers)))
                for variant in variants:
                    for index, layer in enumerate(layers):
                        timer.time_pass(layer, index, inputs[index], variant)
    return timer.passes(warmup, selective)


class _PassTimer:
    """The runs :func:`timed_passes` times, kept per variant and layer, each with the floor of its round."""

    def __init__(
        self, count: int, device: torch.device, loss_fn: LossFn | None, input_grad: bool, split: bool, below: bool
    ) -> None:
        self.device, self.loss_fn, self.input_grad, self.split, self.below = device, loss_fn, input_grad, split, below
        self.last = count - 1
        # runs[variant][layer]: (forward, backward) seconds of every timed run (split_runs: the split's); floors[layer]:
        # the floor timed just before the round (round-robin) or the layer's runs (one after the other) it belongs to
        self.runs: list[list[list[Pass]]] = [[[] for _ in range(count)] for _ in range(3)]
        self.split_runs: list[list[Split]] = [[] for _ in range(count)]
        self.floors: list[list[Pass]] = [[] for _ in range(count)]
        self.split_floors: list[list[Split]] = [[] for _ in range(count)]

    def time_pass(self, layer: nn.Module, index: int, value: Any, variant: int) -> None:
        """Time one pass of ``layer``, the ``index``-th, on ``value``: plain, wrapped, selective or split (0 to 3)."""
        grad = self.input_grad or index > 0
        loss = self.loss_fn if index == self.last else None
        if variant == 3:
            split = _split_pass(layer, loss, value, self.device, input_grad=grad, below=self.below)
            self.split_runs[index].append(split)
            return
        run = runner(layer, loss, variant == 1, index == 0, selective=variant == 2)
        with torch.enable_grad():
            self.runs[variant][index].append(_pass_seconds(run, layer, value, self.device, input_grad=grad))

    def floor_now(self, floor: _Floor) -> tuple[Pass, Split]:
        """The floor of a round: a one-element layer's pass, and its split."""
        now = floor.warm()
        return now, floor.warm_split(now[1], self.below) if self.split else (0.0, 0.0, 0.0, 0.0, 0.0)

    def note_floor(self, now: tuple[Pass, Split], indices: Iterable[int]) -> None:
        """Record ``now`` as the floor of the next run of each layer of ``indices``."""
        for index in indices:
            self.floors[index].append(now[0])
            self.split_floors[index].append(now[1])

    def passes(self, warmup: int, selective: bool) -> Passes:
        """The runs after the first ``warmup`` of each layer."""
        kept = [[layer_runs[warmup:] for layer_runs in variant_runs] for variant_runs in self.runs]
        return Passes(
            kept[0],
            kept[1],
            [f[warmup:] for f in self.floors],
            kept[2] if selective else [],
            [r[warmup:] for r in self.split_runs] if self.split else [],
            [f[warmup:] for f in self.split_floors] if self.split else [],
        )


@dataclass(frozen=True)
class _Measured:
    """What :func:`measured_times` found: its fields are :class:`~lightning_gpipe.profile.layer_profile.ModelProfile`'s
    of the same names."""

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

    def profile_fields(self) -> dict[str, Any]:
        """The measurements by name, as ``ModelProfile`` takes them."""
        return {name.name: getattr(self, name.name) for name in fields(self)}


def measured_times(
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
            resized(sample, n),
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
