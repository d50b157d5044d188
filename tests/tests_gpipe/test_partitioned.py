"""Cutting a LightningModule down to one stage: finding the sequence, and what a pipeline refuses."""

import pytest
import torch
from helpers.models import mlp
from torch import nn

from lightning_gpipe.partitioned import PipelinedSequential, find_sequence, materialize, partition_module


class Holder(nn.Module):
    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


def test_the_only_top_level_sequence_is_found() -> None:
    module = Holder(body=Holder(layers=mlp()))
    assert find_sequence(module)[0] == "body.layers"
    assert find_sequence(module, "body.layers")[1] is module.body.layers


def test_sequence_errors_tell_the_fix() -> None:
    with pytest.raises(TypeError, match=r"has no nn.Sequential to pipeline.*self.layers = nn.Sequential"):
        find_sequence(Holder(linear=nn.Linear(2, 2)))
    with pytest.raises(TypeError, match=r"several nn.Sequential attributes \('a', 'b'\).*module_name="):
        find_sequence(Holder(a=mlp(), b=mlp()))
    with pytest.raises(TypeError, match=r"module_name='head' must name an nn.Sequential attribute"):
        find_sequence(Holder(a=mlp(), head=nn.Linear(2, 2)), "head")


def test_partition_keeps_names_and_frees_other_stages() -> None:
    module = Holder(layers=mlp())
    keys = list(module.state_dict())
    part = partition_module(module, "layers", module.layers, [4, 4], stage=1)
    assert isinstance(module.layers, PipelinedSequential)
    assert set(module.state_dict()) == {key for key in keys if int(key.split(".")[1]) >= 4}
    assert all(p.is_meta for p in part.original[0].parameters())
    with pytest.raises(RuntimeError, match="holds stage 1 of 2 only"):
        module.layers(torch.randn(2, 6))


def test_trainable_parameters_outside_the_sequence_are_refused() -> None:
    module = Holder(layers=mlp(), head=nn.Linear(3, 3))
    with pytest.raises(ValueError, match=r"trainable parameters outside the pipelined sequence 'layers': head.weight"):
        partition_module(module, "layers", module.layers, [4, 4], stage=0)


def test_meta_layers_get_the_same_weights_whatever_their_stage() -> None:
    with torch.device("meta"):
        a, b = mlp(), mlp()
    materialize([(2, a[2])], torch.device("cpu"), seed=5)
    materialize([(2, b[2]), (3, b[3])], torch.device("cpu"), seed=5)
    assert torch.equal(a[2].weight, b[2].weight)
