"""Whole-model state from stages: merged state dicts and optimizer state keyed by name, portable across K."""

import pytest
import torch
from helpers.models import cells, mlp
from torch import nn

from lightning_gpipe.partition.state_dict import (
    check_loadable,
    local_optimizer_state,
    merge_optimizer_states,
    merge_state_dicts,
    optimizer_state_by_name,
)


class Wrapper(nn.Module):
    def __init__(self, layers: nn.Module) -> None:
        super().__init__()
        self.layers = layers


def step(module: nn.Module, optimizer: torch.optim.Optimizer, width: int = 6) -> None:
    optimizer.zero_grad()
    module.layers(torch.randn(5, width)).pow(2).sum().backward()
    optimizer.step()


def test_optimizer_state_from_stages_loads_into_the_plain_optimizer_and_any_split() -> None:
    whole = Wrapper(mlp())
    order = [name for name, _ in whole.named_parameters()]
    # Two "stages", each a module holding its own layers under the original names.
    stages = [Wrapper(nn.Sequential()) for _ in range(2)]
    for stage, cell, offset in zip(stages, cells(whole.layers, [4, 4]), [0, 4], strict=True):
        for index, layer in enumerate(cell):
            stage.layers.add_module(str(offset + index), layer)
    optimizers = [torch.optim.Adam(stage.parameters(), lr=0.1) for stage in stages]
    for stage, optimizer, width in zip(stages, optimizers, [6, 12], strict=True):
        step(stage, optimizer, width)
    merged = merge_optimizer_states(
        [optimizer_state_by_name(o, s) for o, s in zip(optimizers, stages, strict=True)], order
    )
    assert merged["param_groups"][0]["params"] == order
    plain = torch.optim.Adam(whole.parameters(), lr=0.1)
    plain.load_state_dict(merged)  # torch matches parameters by position
    first = whole.layers[0].weight
    assert torch.equal(plain.state[first]["exp_avg"], optimizers[0].state[first]["exp_avg"])
    # ... and into a single stage holding everything (K = 1)
    local = local_optimizer_state(merged, plain, whole, order)
    assert set(local["state"]) == set(order)


def test_positional_state_of_a_plain_optimizer_is_read_by_name() -> None:
    whole = Wrapper(mlp())
    order = [name for name, _ in whole.named_parameters()]
    plain = torch.optim.SGD(whole.parameters(), lr=0.1, momentum=0.9)
    step(whole, plain)
    local = local_optimizer_state(plain.state_dict(), plain, whole, order)
    assert local["param_groups"][0]["params"] == order


def test_mismatched_groups_are_refused() -> None:
    whole = Wrapper(mlp())
    order = [name for name, _ in whole.named_parameters()]
    two_groups = torch.optim.SGD([{"params": whole.layers[0].parameters()}, {"params": whole.layers[2].parameters()}])
    saved = optimizer_state_by_name(torch.optim.SGD(whole.parameters(), lr=0.1), whole)
    with pytest.raises(ValueError, match="1 parameter groups, this one has 2"):
        local_optimizer_state(saved, two_groups, whole, order)


def test_merge_state_dicts_requires_every_key() -> None:
    assert list(merge_state_dicts([{"b": 1}, {"a": 2}], ["a", "b"])) == ["a", "b"]
    with pytest.raises(RuntimeError, match="no stage holds c"):
        merge_state_dicts([{"a": 1}], ["a", "c"])


def test_check_loadable_names_what_is_missing_unexpected_or_of_another_shape() -> None:
    keys, shapes = ["a.weight", "b.weight"], {"a.weight": (2, 3), "b.weight": (4,)}
    good = {"a.weight": torch.zeros(2, 3), "b.weight": torch.zeros(4)}
    check_loadable(good, keys, shapes)
    refused = r"missing \['b.weight'\], unexpected \['c'\] \(another model's, or one stage's\)\. Nothing was loaded\.$"
    with pytest.raises(ValueError, match=refused):
        check_loadable({"a.weight": torch.zeros(2, 3), "c": torch.zeros(1)}, keys, shapes)
    check_loadable({"a.weight": torch.zeros(2, 3)}, keys, shapes, strict=False)  # only shapes count then
    with pytest.raises(ValueError, match=r"1 tensor\(s\) have another shape \(a.weight: \(3, 2\) in the checkpoint"):
        check_loadable({**good, "a.weight": torch.zeros(3, 2)}, keys, shapes, strict=False)
