"""The one profiler behind balance="time"/"memory" and the planner, and the one walker of nested values."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import torch
from torch import nn

import lightning_gpipe
from lightning_gpipe.profile import cost, layer_profile, tensor_bytes, timing
from lightning_gpipe.profile.layer_run import layer_inputs
from lightning_gpipe.profile.tensor_bytes import saved_bytes, state_keys
from lightning_gpipe.profile.timing import timed_passes

PACKAGE = Path(lightning_gpipe.__file__).parent


def _sources() -> dict[str, str]:
    return {str(path.relative_to(PACKAGE)): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}


def test_balance_by_measurement_and_the_planner_share_one_profiler() -> None:
    # Issue 30: cost.py, measure.py and plan/profile.py each ran and timed layers, in copies that could drift apart.
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
        "perf_counter(": ["profile/timing.py"],
        "saved_tensors_hooks(": ["profile/tensor_bytes.py"],
        "autograd.grad(": ["profile/tensor_bytes.py", "profile/timing.py"],
    }
    for needle, owner in owners.items():
        users = [name for name, text in _sources().items() if needle in text and not name.startswith("engine/")]
        assert users == owner, (needle, users)


def test_one_walker_of_nested_values() -> None:
    # Issue 30: torch.utils._pytree (private) and hand-written recursions over tuples, lists and dicts walked batches
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
    # Issue 31: the profile timed only the whole backward B, and the planner took W as half of it; the engine's split
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
