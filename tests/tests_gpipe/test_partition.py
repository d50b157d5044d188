"""Partitioning: the optimum against brute force, the validation messages, and cells that keep the original layers."""

from __future__ import annotations

import itertools
import random
import statistics
from collections.abc import Sequence

import pytest
import torch
from torch import nn

from lightning_gpipe.partition.balance import balance_by_cost, cell_bounds, in_place_starts, split, validate_balance


def all_balances(num_layers: int, num_stages: int) -> list[list[int]]:
    """Every way to cut ``num_layers`` layers into ``num_stages`` non-empty contiguous cells."""
    balances = []
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        edges = (0, *cuts, num_layers)
        balances.append([end - start for start, end in itertools.pairwise(edges)])
    return balances


def cell_costs(costs: Sequence[float], balance: Sequence[int]) -> list[float]:
    return [sum(costs[bounds.start : bounds.stop]) for bounds in cell_bounds(balance)]


def brute_force(costs: Sequence[float], num_stages: int) -> list[int]:
    """The specification: least bottleneck, then least variance, then the lexicographically smallest balance."""
    return min(
        all_balances(len(costs), num_stages),
        key=lambda balance: (
            max(cell_costs(costs, balance)),
            statistics.pvariance(cell_costs(costs, balance)),
            balance,
        ),
    )


def test_balance_matches_brute_force_on_integer_costs() -> None:
    # Small integer costs make ties common, so the variance and lexicographic tie-breaks are exercised, and integer
    # sums are exact, so brute force and the dynamic program agree to the bit.
    rng = random.Random(0)
    for _ in range(600):
        num_layers = rng.randint(1, 10)
        num_stages = rng.randint(1, num_layers)
        costs = [rng.randint(0, 5) for _ in range(num_layers)]
        balance = balance_by_cost(costs, num_stages)
        expected = brute_force(costs, num_stages)
        assert len(balance) == num_stages
        assert sum(balance) == num_layers
        assert min(balance) >= 1
        assert max(cell_costs(costs, balance)) == max(cell_costs(costs, expected)), (costs, num_stages)
        assert statistics.pvariance(cell_costs(costs, balance)) == statistics.pvariance(cell_costs(costs, expected))
        assert balance == expected, (costs, num_stages)


def test_balance_matches_brute_force_on_float_costs() -> None:
    rng = random.Random(1)
    for _ in range(300):
        num_layers = rng.randint(1, 10)
        num_stages = rng.randint(1, num_layers)
        costs = [rng.uniform(0.0, 10.0) for _ in range(num_layers)]
        balance = balance_by_cost(costs, num_stages)
        expected = brute_force(costs, num_stages)
        assert max(cell_costs(costs, balance)) == pytest.approx(max(cell_costs(costs, expected)), rel=1e-12)
        assert statistics.pvariance(cell_costs(costs, balance)) == pytest.approx(
            statistics.pvariance(cell_costs(costs, expected)), rel=1e-9, abs=1e-12
        )


@pytest.mark.parametrize(
    ("costs", "num_stages", "expected"),
    [
        pytest.param([1, 2, 3, 4, 5, 6], 2, [4, 2], id="paper-like"),
        pytest.param([0, 0], 2, [1, 1], id="zeros"),
        pytest.param([0, 0, 0, 0], 3, [1, 1, 2], id="zeros-lexicographic"),
        pytest.param([5, 0, 0, 0], 2, [1, 3], id="zero-tail"),
        pytest.param([1, 2, 3], 1, [3], id="one-stage"),
        pytest.param([1, 2, 3], 3, [1, 1, 1], id="one-layer-per-stage"),
        # Bottleneck 4 is fixed by the first layer; [1, 1, 3] and [1, 3, 1] reach it too, but cells 4, 2, 2 vary least.
        pytest.param([4, 1, 1, 1, 1], 3, [1, 2, 2], id="variance-before-lexicographic"),
        pytest.param([1.0, 2.0, 3.0, 4.0], 2, [3, 1], id="floats"),
    ],
)
def test_balance_examples(costs: list[float], num_stages: int, expected: list[int]) -> None:
    assert balance_by_cost(costs, num_stages) == expected


def test_balance_of_huge_costs_does_not_overflow() -> None:
    # Squares of 4e300 overflow to inf, which would make every partition tie on variance.
    assert balance_by_cost([4e300, 1e300, 1e300, 1e300, 1e300], 3) == [1, 2, 2]


def test_balance_of_uniform_costs_at_scale_is_even_and_smaller_stages_first() -> None:
    assert balance_by_cost([1.0] * 1000, 16) == [62] * 8 + [63] * 8


def test_balance_accepts_numbers_of_any_kind() -> None:
    assert balance_by_cost((torch.tensor(1.0), 2, 3.0), 2) == [2, 1]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("costs", "num_stages", "error", "match"),
    [
        (
            [1, 2, 3],
            4,
            ValueError,
            r"^cannot split 3 layers into 4 stages; use pipe_size <= 3 or more layers$",
        ),
        ([], 1, ValueError, r"cannot split 0 layers into 1 stages"),
        ([1, 2], 0, ValueError, r"^the number of stages must be at least 1, got 0; use pipe_size >= 1$"),
        ([1, 2], -1, ValueError, r"at least 1, got -1"),
        ([1, 2], 2.0, TypeError, r"^the number of stages must be an int, got 2\.0 \(float\)$"),
        ([1, 2], True, TypeError, r"must be an int, got True \(bool\)"),
        ([1, -2], 1, ValueError, r"^cost of layer 1 is -2; layer costs must be non-negative and finite"),
        ([1, float("nan")], 1, ValueError, r"^cost of layer 1 is nan; layer costs must be non-negative and finite$"),
        ([float("inf")], 1, ValueError, r"cost of layer 0 is inf; layer costs must be non-negative and finite"),
        ([1, "big"], 1, TypeError, r"^cost of layer 1 is 'big', which is not a number"),
        ("123", 1, TypeError, r"^costs must be a sequence of numbers, one per layer, got str$"),
        ((c for c in [1, 2]), 1, TypeError, r"got generator"),
    ],
)
def test_balance_by_cost_rejects(costs: object, num_stages: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        balance_by_cost(costs, num_stages)  # type: ignore[arg-type]


def test_validate_balance_returns_a_list() -> None:
    assert validate_balance((3, 2), 5) == [3, 2]


@pytest.mark.parametrize(
    ("balance", "num_layers", "error", "match"),
    [
        (
            [2, 2],
            5,
            ValueError,
            r"^balance \[2, 2\] sums to 4 but the module has 5 layers; use e.g. \[3, 2\]$",
        ),
        ([4, 4], 5, ValueError, r"sums to 8 but the module has 5 layers; use e\.g\. \[3, 2\]$"),
        (
            [1, 1, 1, 1],
            3,
            ValueError,
            r"^balance \[1, 1, 1, 1\] has 4 stages but the module has only 3 layers; give at most 3 stages$",
        ),
        (
            [3, 0, 2],
            5,
            ValueError,
            r"^balance \[3, 0, 2\] gives stage 1 0 layers; every stage needs at least one$",
        ),
        ([-1, 6], 5, ValueError, r"gives stage 0 -1 layers"),
        ([], 5, ValueError, r"^balance \[\] has no stages; give one positive int per stage$"),
        ([2.0, 3], 5, TypeError, r"^balance \[2\.0, 3\] has 2\.0 \(float\) for stage 0, not an int$"),
        ([True, 4], 5, TypeError, r"has True \(bool\) for stage 0"),
        ("23", 5, TypeError, r"^balance must be a list of ints \(layers per stage\), got '23' \(str\)$"),
        (5, 5, TypeError, r"got 5 \(int\)"),
        ([1], 0, ValueError, r"^the module must have at least one layer to partition, got num_layers=0$"),
    ],
)
def test_validate_balance_rejects(balance: object, num_layers: int, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        validate_balance(balance, num_layers)  # type: ignore[arg-type]


def test_cell_bounds() -> None:
    assert cell_bounds([2, 3, 1]) == [range(0, 2), range(2, 5), range(5, 6)]


def test_split_keeps_layer_objects_and_original_names() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    cells = split(model, [2, 3])
    assert [len(cell) for cell in cells] == [2, 3]
    assert [layer for cell in cells for layer in cell] == list(model)
    assert all(a is b for a, b in zip([layer for cell in cells for layer in cell], model, strict=True))
    assert list(cells[0].state_dict()) == ["0.weight", "0.bias"]
    assert list(cells[1].state_dict()) == ["2.weight", "2.bias", "4.weight", "4.bias"]
    # The cells share parameters with the model, so training a cell trains the model.
    assert cells[1][2].weight is model[4].weight
    x = torch.randn(5, 2)
    assert torch.equal(cells[1](cells[0](x)), model(x))


def test_split_keeps_custom_child_names() -> None:
    model = nn.Sequential()
    model.add_module("stem", nn.Linear(2, 2))
    model.add_module("head", nn.Linear(2, 1))
    first, second = split(model, [1, 1])
    assert list(first.state_dict()) == ["stem.weight", "stem.bias"]
    assert list(second.state_dict()) == ["head.weight", "head.bias"]


def test_split_counts_a_repeated_layer_at_every_position() -> None:
    # named_children() would yield the shared layer once and shift the head into the wrong cell.
    shared = nn.Linear(2, 2)
    head = nn.Linear(2, 1)
    model = nn.Sequential(shared, shared, head)
    first, second = split(model, [2, 1])
    assert list(first) == [shared, shared]
    assert list(second) == [head]


def test_split_rejects() -> None:
    with pytest.raises(
        TypeError, match=r"^split needs an nn.Sequential, got ModuleList; pass nn.Sequential\(\*layers\)$"
    ):
        split(nn.ModuleList([nn.Linear(1, 1)]), [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"balance \[1, 1\] sums to 2 but the module has 3 layers"):
        split(nn.Sequential(nn.ReLU(), nn.ReLU(), nn.ReLU()), [1, 1])


def test_balance_does_not_start_a_cell_with_an_in_place_layer_when_it_need_not() -> None:
    # Parameter costs give ReLU nothing, so the tie between cutting before and after it went to the smaller first
    # stage: the second cell started with ReLU(inplace=True), which costs a copy of its input.
    layers = nn.Sequential(
        nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.Sequential(nn.ReLU(inplace=True)), nn.Linear(4, 4)
    )
    starts = in_place_starts(layers)
    assert starts == [1, 3]
    assert balance_by_cost([20, 0, 20, 0, 20], 3, avoid_cuts=starts) == [2, 2, 1]
    # Only among optimal partitions: the bottleneck is never traded for it.
    assert balance_by_cost([20, 5, 15], 2, avoid_cuts=[1]) == [1, 2]
