"""The split backward: the input pass and the weight pass sum to one ``backward``, and neither repeats the other."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from helpers.models import BALANCES, HIDDEN, IN, OUT, batch, build, cells, full_batch_grads, loss_fn, relative_error
from torch import nn
from torch.autograd.graph import Node
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_gpipe.engine import split
from lightning_gpipe.engine.pipeline import run_in_threads
from lightning_gpipe.engine.rematerialization import CheckpointMode
from lightning_gpipe.engine.split import input_pass
from lightning_gpipe.engine.stage import Stage
from lightning_gpipe.engine.thread_transport import ThreadTransport
from lightning_gpipe.partition.compile import compile_layers


class Counted(torch.autograd.Function):
    """The identity, counting its backward calls: it sits on the input's side only, which the weight pass skips."""

    calls = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        Counted.calls += 1
        return grad


class Cell(nn.Module):
    """Two linears (the second tied twice), a parameter reached also without the input, one reached only so."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 5)
        self.second = nn.Linear(5, 5)
        self.norm = nn.BatchNorm1d(5)
        self.offset = nn.Parameter(torch.randn(5))
        self.alone = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = Counted.apply(torch.tanh(self.first(x)))
        h = self.norm(self.second(self.second(h)) + self.offset)
        return h * 2, self.alone * 3 + self.offset.sum()  # the second output does not depend on x


def reference(stage: nn.Module, x: torch.Tensor, grads: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
    leaf = x.detach().requires_grad_()
    torch.autograd.backward(stage(leaf), grads)
    result = {name: p.grad.clone() for name, p in stage.named_parameters()}
    stage.zero_grad(set_to_none=True)
    return leaf.grad, result


@pytest.mark.parametrize("with_input", [True, False])
def test_input_and_weight_passes_sum_to_one_backward_computing_the_input_side_once(with_input: bool) -> None:
    stage, x = Cell(), torch.randn(6, 4)
    grads = [torch.randn(6, 5), torch.randn(3)]
    expected_input, expected = reference(stage, x, grads)

    leaf = x.detach().requires_grad_(with_input)
    Counted.calls = 0
    dinputs, weights = input_pass(list(stage(leaf)), grads, [leaf] if with_input else [])
    assert all(p.grad is None for p in stage.parameters())  # the input pass leaves the parameters alone
    assert Counted.calls == (1 if with_input else 0)
    weights.run()
    assert Counted.calls == 1  # the weight pass starts below the input's side (the first stage: runs it whole)
    if with_input:
        torch.testing.assert_close(dinputs[0], expected_input)
        assert leaf.grad is None
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], msg=name)


def test_an_unused_input_gets_no_gradient() -> None:
    layer, x, unused = nn.Linear(3, 3), torch.randn(2, 3, requires_grad=True), torch.randn(2, requires_grad=True)
    dinputs, weights = input_pass([layer(x)], [torch.ones(2, 3)], [x, unused])
    weights.run()
    assert dinputs[1] is None
    assert layer.weight.grad is not None


@pytest.mark.parametrize("mode", ["always", "except_last", "selective", "never"])
def test_zero_bubble_recomputes_each_rematerialized_microbatch_once(mode: str) -> None:
    # The input pass replays the forward; the weight pass must reuse that graph, not replay it again.
    model = build("mlp")
    stage_cells = cells(model, BALANCES["mlp"][2])
    calls: list[int] = []
    for cell in stage_cells:
        cell[0].register_forward_hook(lambda module, args, out: calls.append(1))
    reference = full_batch_grads(build("mlp"), batch())
    model.zero_grad()
    run_in_threads(stage_cells, batch(), loss_fn, chunks=4, checkpoint=mode, schedule="zero_bubble")
    replayed = {"always": 4, "except_last": 3, "selective": 3, "never": 0}[mode]
    assert len(calls) == 2 * (4 + replayed)  # two stages: each forward, plus one replay per re-materialized one
    for name, p in model.named_parameters():
        assert relative_error(p.grad, reference[name]) <= 1e-6, name


class _CountAddmm(TorchDispatchMode):
    """Counts the ``addmm`` calls that run (a linear layer's forward), below any mode that answers them from a cache."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += func is torch.ops.aten.addmm.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("mode", "calls"), [("selective", 4), ("always", 8)])
def test_a_selective_replay_reads_the_kept_matrix_multiplications(mode: str, calls: int) -> None:
    # One stage, two micro-batches through two linears. "selective" re-materializes the first one and its replay
    # reads the linears' outputs back (2 + 0, then 2 for the last); "always" replays both in full (2 + 2, twice).
    cell = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    stage = Stage(cell, ThreadTransport.create(1)[0], checkpoint=mode)
    x = torch.randn(6, 4)
    expected = full_grads(cell, x)
    with _CountAddmm() as counter:
        stage.begin_step([3, 3], split_backward=True)
        losses = [stage.forward(i, x[3 * i : 3 * i + 3]).square().sum() for i in range(2)]
        for i in range(2):
            stage.input_backward(i, losses[i])
            stage.weight_backward(i)
        stage.end_step()
    assert counter.calls == calls
    for name, p in cell.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], msg=name)


def full_grads(cell: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    cell.zero_grad(set_to_none=True)
    cell(x).square().sum().backward()
    grads = {name: p.grad.clone() for name, p in cell.named_parameters()}
    cell.zero_grad(set_to_none=True)
    return grads


class Sine(nn.Module):
    """A linear and a sine; compiled, its backward is one node that yields its input's and its weights' gradients."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.linear(x))


COMPILE = {"backend": "aot_eager", "dynamic": False}  # the same autograd node as inductor's, compiled in a second


def graph_nodes(tensor: torch.Tensor) -> list[Node]:
    """The backward nodes in ``tensor``'s graph."""
    found, seen, stack = [], set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        found.append(node)
        stack += [child for child, _ in node.next_functions]
    return found


def compiled_nodes(tensor: torch.Tensor) -> list[Node]:
    """The compiled regions' backward nodes in ``tensor``'s graph."""
    return [node for node in graph_nodes(tensor) if node.name() == "CompiledFunctionBackward"]


def test_the_weight_pass_runs_no_compiled_backward_again() -> None:
    # A compiled region's backward computes its input's and its weights' gradients at once: the input pass ran it
    # whole, and the weight pass, started from the gradient that reached it, ran it whole again.
    torch.manual_seed(0)
    cell = nn.Sequential(Sine(4), nn.Linear(4, 4), nn.Tanh(), Sine(4))  # compiled on the input and at the output
    eager = copy.deepcopy(cell)
    compiled = compile_layers([cell[0], cell[3]], COMPILE)
    x, grad = torch.randn(6, 4), torch.randn(6, 4)
    expected_input, expected = reference(eager, x, [grad])

    leaf = x.detach().requires_grad_()
    output = cell(leaf)
    calls: list[Node] = []
    nodes = compiled_nodes(output)
    assert len(nodes) == 2
    for node in nodes:
        node.register_prehook(lambda grads, node=node: calls.append(node))
    dinputs, weights = input_pass([output], [grad], [leaf])
    assert len(calls) == 2
    assert all(p.grad is None for p in cell.parameters())
    weights.run()
    assert len(calls) == 2  # the weight pass ran no compiled backward
    compiled.restore()
    assert relative_error(dinputs[0], expected_input) <= 1e-6
    for name, p in cell.named_parameters():
        assert relative_error(p.grad, expected[name]) <= 1e-6, name


def test_a_weight_tied_across_an_eager_and_a_compiled_layer_gets_both_shares() -> None:
    # The eager layer's weight pass walks down to the compiled layer holding the same weight, which then runs again
    # there (its gradient from the input pass is not used, or the compiled share would count twice).
    torch.manual_seed(0)
    cell = nn.Sequential(nn.Linear(4, 4), Sine(4), nn.Linear(4, 4))
    cell[2].weight = cell[1].linear.weight
    eager = copy.deepcopy(cell)
    compiled = compile_layers([cell[1]], COMPILE)
    x, grad = torch.randn(6, 4), torch.randn(6, 4)
    expected_input, expected = reference(eager, x, [grad])
    leaf = x.detach().requires_grad_()
    dinputs, weights = input_pass([cell(leaf)], [grad], [leaf])
    weights.run()
    compiled.restore()
    assert relative_error(dinputs[0], expected_input) <= 1e-6
    for name, p in cell.named_parameters():
        assert relative_error(p.grad, expected[name]) <= 1e-6, name


@pytest.mark.parametrize("mode", ["never", "always", "selective"])
@pytest.mark.parametrize(("schedule", "v", "balance"), [("zero_bubble", 1, [4, 4]), ("zbv", 2, [2, 2, 2, 2])])
def test_compiled_and_eager_layers_in_one_stage_train_like_plain_autograd(
    schedule: str, v: int, balance: list[int], mode: CheckpointMode
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(IN, HIDDEN), Sine(HIDDEN), nn.Linear(HIDDEN, HIDDEN), Sine(HIDDEN),
        nn.Linear(HIDDEN, HIDDEN), Sine(HIDDEN), Sine(HIDDEN), nn.Linear(HIDDEN, OUT),
    )  # fmt: skip
    expected = full_batch_grads(copy.deepcopy(model), batch())
    # As assembly does: under "selective" each compiled layer re-materializes itself and the stage wraps nothing.
    selective = mode == "selective"
    compiled = compile_layers([layer for layer in model if isinstance(layer, Sine)], COMPILE, selective=selective)
    model.zero_grad(set_to_none=True)
    checkpoint: CheckpointMode = "never" if selective else mode
    run_in_threads(
        cells(model, balance), batch(), loss_fn, chunks=4, checkpoint=checkpoint, schedule=schedule, virtual_stages=v
    )
    compiled.restore()
    for name, p in model.named_parameters():
        assert relative_error(p.grad, expected[name]) <= 1e-6, name


class _Visits(dict):
    """A consumers map counting the nodes a walk of the input pass visits (one lookup per node popped)."""

    count = 0

    def get(self, key: Any, default: Any = None) -> Any:
        _Visits.count += 1
        return super().get(key, default)


class _Looks(set):
    """A set of nodes counting the lookups a walk down the graph makes in it."""

    def __contains__(self, node: object) -> bool:
        _Visits.count += 1
        return super().__contains__(node)


@pytest.mark.parametrize("with_input", [True, False])
def test_the_input_pass_walks_an_eager_graph_in_time_linear_in_its_nodes(
    with_input: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each parameter's walk up to the nodes that depend on the input went up to the outputs when nothing did (the
    # first stage): parameters x nodes. Each group walked everything below it when a compiled region might be there.
    closure, below = split._closure, split._below
    monkeypatch.setattr(
        split, "_closure", lambda starts, consumers, stop=None: closure(starts, _Visits(consumers), stop)
    )
    monkeypatch.setattr(split, "_below", lambda starts, within: below(starts, _Looks(within)))
    torch.manual_seed(0)
    stack = nn.Sequential(*[layer for _ in range(8) for layer in (nn.Linear(4, 4), nn.ReLU())])
    leaf = torch.randn(6, 4, requires_grad=with_input)
    output = stack(leaf)
    nodes = len(graph_nodes(output))
    _Visits.count = 0
    input_pass([output], None, [leaf] if with_input else [])
    assert _Visits.count <= 2 * nodes, (_Visits.count, nodes)  # once the input's side, at most once more the rest
