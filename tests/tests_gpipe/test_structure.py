"""Nested values flatten to leaves and rebuild to equal values."""

import dataclasses
from collections import OrderedDict, namedtuple
from collections.abc import Iterator, Mapping

import pytest
import torch

from lightning_gpipe.engine.tree import flatten, leaf_paths, map_tensors, unflatten

Pair = namedtuple("Pair", ["left", "right"])


@dataclasses.dataclass
class Example:
    image: torch.Tensor
    meta: dict
    name: str = "x"


def test_round_trip_keeps_every_container_type() -> None:
    value = (
        [torch.ones(2), None],
        {"a": torch.zeros(3), "b": Pair(1, torch.arange(2))},
        Example(torch.ones(1), OrderedDict(k=torch.ones(2)), "n"),
        torch.Size([2, 3]),
    )
    leaves, spec = flatten(value)
    rebuilt = unflatten(leaves, spec)
    assert type(rebuilt[1]["b"]) is Pair
    assert type(rebuilt[2]) is Example
    assert type(rebuilt[2].meta) is OrderedDict
    assert rebuilt[3] == torch.Size([2, 3])  # tuple subclasses stay leaves
    assert [type(leaf).__name__ for leaf in leaves] == ["Tensor", "NoneType", "Tensor", "int", "Tensor", "Tensor"] + [
        "Tensor",
        "str",
        "Size",
    ]


def test_equal_structures_have_equal_specs_and_paths_are_readable() -> None:
    _, spec_a = flatten({"x": (torch.ones(1), torch.ones(2))})
    _, spec_b = flatten({"x": (torch.zeros(5), torch.zeros(1))})
    _, spec_c = flatten({"x": [torch.ones(1), torch.ones(2)]})
    assert spec_a == spec_b
    assert spec_a != spec_c
    assert leaf_paths(spec_a) == ["value['x'][0]", "value['x'][1]"]


def test_is_leaf_keeps_a_container_whole() -> None:
    # Micro-batching splits a list of per-sample strings as one value, so it must come out as one leaf.
    value = {"text": ["a", "b"], "x": torch.ones(2), "nest": [["c"], ("d", "e")]}
    leaves, spec = flatten(value, is_leaf=lambda node: isinstance(node, list) and all(type(i) is str for i in node))
    assert leaves[:2] == [["a", "b"], value["x"]]
    assert leaves[2:] == [["c"], "d", "e"]  # the outer list holds lists: looked into
    assert leaf_paths(spec) == ["value['text']", "value['x']", "value['nest'][0]", "value['nest'][1][0]"] + [
        "value['nest'][1][1]"
    ]
    assert unflatten(leaves, spec) == value


def test_map_tensors_leaves_other_leaves_alone() -> None:
    doubled = map_tensors(lambda t: t * 2, (torch.ones(2), "keep", 3))
    assert doubled[0].tolist() == [2.0, 2.0]
    assert doubled[1:] == ("keep", 3)


def test_unflatten_rejects_a_wrong_number_of_leaves() -> None:
    leaves, spec = flatten((torch.ones(1), torch.ones(1)))
    with pytest.raises(ValueError, match="too few leaves"):
        unflatten(leaves[:1], spec)
    with pytest.raises(ValueError, match="3 leaves given"):
        unflatten([*leaves, torch.ones(1)], spec)


class Columns(Mapping):
    """A read-only mapping built from keywords only, so not from a dict of its items."""

    def __init__(self, **columns: torch.Tensor) -> None:
        self._columns = columns

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._columns[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._columns)

    def __len__(self) -> int:
        return len(self._columns)


def test_a_mapping_that_cannot_be_built_from_a_dict_comes_back_as_a_dict() -> None:
    leaves, spec = flatten(Columns(x=torch.ones(2)))
    assert leaf_paths(spec, "batch") == ["batch['x']"]
    rebuilt = unflatten([torch.zeros(2)], spec)
    assert type(rebuilt) is dict
    assert torch.equal(rebuilt["x"], torch.zeros(2))
