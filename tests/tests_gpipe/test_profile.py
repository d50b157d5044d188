"""The one profiler behind balance="time"/"memory" and the planner, and the one walker of nested values."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import lightning_gpipe
from lightning_gpipe.profile import cost, layer_profile, optimizer_step, tensor_bytes, timing
from lightning_gpipe.profile.layer_profile import profile_layers
from lightning_gpipe.profile.layer_run import layer_inputs
from lightning_gpipe.profile.tensor_bytes import saved_bytes, state_keys
from lightning_gpipe.profile.timing import timed_passes

PACKAGE = Path(lightning_gpipe.__file__).parent


def _sources() -> dict[str, str]:
    return {str(path.relative_to(PACKAGE)): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}


def test_balance_by_measurement_and_the_planner_share_one_profiler() -> None:
    # cost.py, measure.py and plan/profile.py each ran and timed layers, in copies that could drift apart.
    # balance="time" and the planner's pass times now come from the same timing loop, balance="memory" and the
    # planner's activation bytes from the same count of what autograd saves.
    assert cost.timed_passes is timing.timed_passes
    assert "timed_passes" in cost.time_cost.__code__.co_names
    assert "timed_passes" in timing.measured_times.__code__.co_names
    assert "measured_times" in layer_profile.profile_layers.__code__.co_names
    assert cost.saved_bytes is tensor_bytes.saved_bytes
    assert "saved_bytes" in cost.memory_cost.__code__.co_names
    assert "_saved_forward" in tensor_bytes.saved_bytes.__code__.co_names
    assert "_saved_forward" in tensor_bytes.activation_bytes.__code__.co_names
    planner = importlib.import_module("lightning_gpipe.plan")  # the package; lightning_gpipe.plan is its function
    assert planner.profile_layers is layer_profile.profile_layers
    assert "profile_layers" in planner.plan.__code__.co_names
    # Nothing else in the library reads the clock around a layer or hooks the tensors autograd saves (the engine's
    # timeline stamps spans of the running pipeline; it times no layer).
    owners = {
        "perf_counter(": ["profile/optimizer_step.py", "profile/timing.py"],
        "saved_tensors_hooks(": ["profile/tensor_bytes.py"],
        "autograd.grad(": ["profile/tensor_bytes.py", "profile/timing.py"],
    }
    for needle, owner in owners.items():
        users = [name for name, text in _sources().items() if needle in text and not name.startswith("engine/")]
        assert users == owner, (needle, users)


def test_one_walker_of_nested_values() -> None:
    # torch.utils._pytree (private) and hand-written recursions over tuples, lists and dicts walked batches
    # beside engine/tree.py, each with its own idea of which containers count.
    private = [name for name, text in _sources().items() if "_pytree" in text]
    assert private == []
    recursive = re.compile(r"def (_\w+)\(value[^)]*\)[^:]*:\n(?:[^\n]*\n){0,6}?[^\n]*\b\1\(item", re.MULTILINE)
    copies = [
        name
        for name, text in _sources().items()
        if recursive.search(text) and name.startswith(("partition/", "profile/", "plan/"))
    ]
    assert copies == []


def test_timed_passes_keep_the_floor_of_each_round_and_leave_the_model_alone() -> None:
    layers = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    state = {name: tensor.clone() for name, tensor in layers.state_dict().items()}
    passes = timed_passes(list(layers), torch.randn(6, 4), torch.device("cpu"), repeats=3, warmup=1)
    assert [len(runs) for runs in passes.plain] == [3] * 4
    assert [len(floors) for floors in passes.floors] == [3] * 4
    assert passes.wrapped == [[], [], [], []]
    assert all(f >= 0 and b >= 0 for runs in passes.plain for f, b in runs)
    assert len(passes.medians()) == 4
    for name, tensor in layers.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    assert all(param.grad is None for param in layers.parameters())


def test_the_split_backward_is_timed_as_the_engine_runs_it_and_costs_more_than_the_whole() -> None:
    # The profile timed only the whole backward B, and the planner took W as half of it; the engine's split
    # (lightning_gpipe.engine.split) walks the autograd graph in Python and makes one autograd call per group of
    # parameters, so its I + W exceeds B and zero_bubble and zbv were predicted too fast.
    layers = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.ReLU())])
    sample = torch.randn(16, 64)
    plain = layer_profile.profile_layers(layers, sample, microbatch_sizes=[16], rematerialized=False, optimizer=None)
    assert plain.split_times(16) is None  # only timed when a split schedule is weighed
    split = layer_profile.profile_layers(
        layers, sample, microbatch_sizes=[16], repeats=5, rematerialized=False, optimizer=None, split=True
    )
    times = split.split_times(16)
    assert times is not None
    input_pass, weight_pass, walk = times.input, times.weight, times.walk
    _, backward = split.pass_times(16)
    assert len(input_pass) == len(weight_pass) == len(walk) == len(times.input_below) == len(times.weight_below) == 8
    # What a later layer of a stage walks: a Linear's addmm, transpose and two accumulators, a ReLU's one node; what
    # it pays per node is a walk, timed at one size for all.
    assert len(split.split_weight_below) == 8
    assert [layer.graph_nodes for layer in split.layers] == [4, 1] * 4
    assert plain.layers[0].graph_nodes == 0  # counted only with split=True
    assert sum(input_pass[1:]) + sum(weight_pass[1:]) > sum(backward[1:])
    # The weight pass's autograd call is paid per layer with weights: each Linear's W exceeds a ReLU's.
    assert min(weight_pass[0::2]) > max(weight_pass[1::2])
    assert all(param.grad is None for param in layers.parameters())  # the weight pass's .grad were put back
    assert split.scaled(layers=16).split_times(16).weight[8:] == weight_pass  # type: ignore[union-attr]


def test_the_models_input_gets_no_gradient_a_boundarys_does() -> None:
    # A parameter-free first layer saves nothing in training (the batch needs no gradient); on a boundary's input,
    # which gradients flow back to, tanh keeps its output.
    layer, sample = nn.Tanh(), torch.randn(3, 5)
    assert saved_bytes(layer, sample, set(), input_grad=False) == 0.0
    assert saved_bytes(layer, sample, set(), input_grad=True) == 3 * 5 * 4


def test_layer_inputs_chain_the_layers_as_sequential_does() -> None:
    first = nn.Linear(3, 4)
    layers = [first, nn.ReLU(inplace=True), nn.Linear(4, 2)]
    sample = torch.randn(2, 3)
    inputs = [x for _, x in layer_inputs(layers, sample, torch.device("cpu"))]
    assert torch.equal(inputs[0], sample)
    assert torch.equal(inputs[1], first(sample).detach())
    assert torch.equal(inputs[2], torch.relu(first(sample)).detach())  # the in-place ReLU ran on a copy
    assert state_keys([first]) == {first.weight.untyped_storage().data_ptr(), first.bias.untyped_storage().data_ptr()}


def test_profile_counts_bytes_alike_on_cpu_and_meta() -> None:
    def build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))

    torch.manual_seed(0)
    real = profile_layers(build(), torch.randn(4, 32), microbatch_sizes=[2, 4], repeats=1, warmup=0)
    with torch.device("meta"):
        meta_layers = build()
    meta = profile_layers(meta_layers, torch.empty(4, 32, device="meta"), microbatch_sizes=[2, 4], flops_per_second=1e9)
    for a, b in zip(real.layers, meta.layers, strict=True):
        assert (a.param_bytes, a.saved_bytes, a.output_bytes, a.flops) == (
            b.param_bytes,
            b.saved_bytes,
            b.output_bytes,
            b.flops,
        )
    assert real.layers[0].saved_bytes == 32 * 4  # the Linear saves its input: 32 floats per sample
    assert real.layers[0].flops == 2 * 32 * 64
    assert meta.pass_times(4)[0][0] == pytest.approx(4 * 2 * 32 * 64 / 1e9)
    # Interpolated between the measured sizes; layers this small cost less than the call of timing them alone, which
    # the profile takes off, so they may read 0.
    backward = real.pass_times(3)[1]
    assert len(backward) == 3
    assert all(t >= 0 for t in backward)


def test_profile_times_rematerialization_and_the_optimizer_step_without_changing_the_model() -> None:
    torch.manual_seed(0)
    # Wide enough that a step over the first layer's 1M weights clearly exceeds the step's fixed cost, which is taken
    # off: smaller layers' difference is lost in the noise of a loaded machine and reads 0.
    first, second = nn.Linear(1024, 1024), nn.Linear(1024, 1024)
    second.weight = first.weight  # tied: stepped with the first layer only
    layers = nn.Sequential(first, nn.ReLU(), second)
    before = [t.detach().clone() for t in layers.state_dict().values()]
    profile = profile_layers(layers, torch.randn(4, 1024), microbatch_sizes=[2, 4], repeats=2, warmup=1)
    assert all(a.equal(b) for a, b in zip(before, layers.state_dict().values(), strict=True))
    assert profile.updates[0] > 0
    assert profile.updates[1] == 0.0
    assert profile.stage_update(range(1, 2)) == 0.0  # nor does a stage of it pay the step's call
    assert profile.stage_update(range(3)) == pytest.approx(sum(profile.updates) + profile.update_call)
    extra = profile.recompute_times(4)
    assert extra is not None
    assert len(extra) == 3
    assert all(t >= 0 for t in extra)
    share = profile.recompute_forward_times(4)  # the part of it paid in the first forward
    assert all(0 <= part <= total for part, total in zip(share, extra, strict=True))
    plain = profile_layers(layers, torch.randn(4, 1024), microbatch_sizes=[4], rematerialized=False, optimizer=None)
    assert plain.recompute_times(4) is None
    assert plain.updates == ()
    assert plain.stage_update(range(3)) == 0.0


class _Clock:
    """``time.perf_counter`` of an exactly regular machine, perhaps slowing down steadily: the n-th reading comes
    ``tick * (1 + drift * n)`` seconds after the one before. Every pass of any layer then reads one tick forward and
    one backward, scaled by the drift: what the profile must take off as the cost of being timed alone."""

    def __init__(self, tick: float, drift: float = 0.0) -> None:
        self.tick, self.drift = tick, drift
        self.now = 0.0
        self.readings = 0

    def __call__(self) -> float:
        self.readings += 1
        self.now += self.tick * (1 + self.drift * self.readings)
        return self.now


def _sixteen_one_element_layers_seconds(monkeypatch: pytest.MonkeyPatch, clock: _Clock) -> float:
    """The profiled forward and backward seconds of 16 one-element layers, summed, on ``clock``: each layer costs no
    more than the floor."""
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=clock))
    tiny = nn.Sequential(*[nn.Linear(1, 1) for _ in range(16)])
    profile = profile_layers(
        tiny, torch.ones(1, 1), microbatch_sizes=[1], repeats=9, warmup=2, rematerialized=False, optimizer=None
    )
    forward, backward = profile.pass_times(1)
    return sum(forward) + sum(backward)


def test_a_layer_is_not_charged_the_cost_of_being_timed_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # The profile times each layer with its own module call and autograd.grad call, which a stage pays once per
    # micro-batch for all its layers; counted per layer, 16 one-element layers would read 16 such calls.
    assert _sixteen_one_element_layers_seconds(monkeypatch, _Clock(tick=1e-4)) == pytest.approx(0.0, abs=1e-12)


def test_the_cost_of_being_timed_alone_is_taken_off_as_the_machine_drifts(monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: a floor timed once, before all the layers, comes from another moment than the layers on a machine
    # whose speed drifts. Timed at the start of every round, on this clock the 16 layers read 0.76 floors (the drift
    # within a round), against 8.9 with the floor timed once and 25.5 without taking it off.
    tick = 1e-4
    floors = _sixteen_one_element_layers_seconds(monkeypatch, _Clock(tick, drift=1 / 600)) / (2 * tick)
    assert floors < 2


def test_a_layer_is_timed_re_materialized_after_another_layer_as_in_a_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: a layer's second pass in a row runs warm, so a wrapped pass timed right after its own plain pass read
    # re-materialization short. Here a pass costs 1 ms forward and 2 ms backward, re-materialized 0.5 and 1.5 ms
    # more, and 0.3 ms less backward when it follows a pass of the same layer: timed as in a stage, each layer reads
    # exactly its costs (timed right after its plain pass: 1.7 ms).
    layers = nn.Sequential(*[nn.Linear(2, 2) for _ in range(3)])
    previous: list[nn.Module | None] = [None]

    def runner(
        layer: nn.Module, loss_fn: Any, rematerialized: bool, first: bool, selective: bool = False
    ) -> tuple[nn.Module, bool]:
        return layer, rematerialized

    def pass_seconds(
        run: tuple[nn.Module, bool], layer: nn.Module, value: Any, device: torch.device, input_grad: bool = True
    ) -> tuple[float, float]:
        module, wrapped = run
        warm = previous[0] is module
        previous[0] = module
        if not any(module is own for own in layers):
            return 0.0, 0.0  # the one-element layer whose pass is the cost of being timed alone: none here
        return 1e-3 + 0.5e-3 * wrapped, 2e-3 + 1.5e-3 * wrapped - 0.3e-3 * warm

    monkeypatch.setattr(timing, "runner", runner)
    monkeypatch.setattr(timing, "_pass_seconds", pass_seconds)
    profile = profile_layers(layers, torch.ones(1, 2), microbatch_sizes=[1], repeats=3, warmup=1, optimizer=None)
    assert profile.pass_times(1) == (pytest.approx([1e-3] * 3), pytest.approx([2e-3] * 3))
    assert profile.recompute_times(1) == pytest.approx([2e-3] * 3)
    assert profile.recompute_forward_times(1) == pytest.approx([0.5e-3] * 3)


def test_the_layers_optimizer_steps_are_timed_round_robin(monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: timed one layer after another, a slow moment of a shared machine inflated every sample of the layers
    # timed during it; round-robin, it costs each layer one sample, which the median drops.
    real = optimizer_step._step_seconds
    stepped: list[tuple[torch.Size, ...]] = []

    def recorded(optimizer: Any, shapes: Any, device: torch.device, repeats: int, warmup: int) -> float:
        stepped.append(tuple(shape for shape, _ in shapes))
        return real(optimizer, shapes, device, repeats, warmup)

    monkeypatch.setattr(optimizer_step, "_step_seconds", recorded)
    layers = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    profile = profile_layers(layers, torch.randn(2, 4), microbatch_sizes=[2], repeats=3, warmup=0, rematerialized=False)
    per_layer = [shapes for shapes in stepped if shapes[0] != torch.Size([1])]  # the fixed cost's own steps aside
    first, last = (torch.Size([8, 4]), torch.Size([8])), (torch.Size([2, 8]), torch.Size([2]))
    assert per_layer == [first, last] * 3
    assert profile.updates[1] == 0.0  # the ReLU has nothing to step
