"""Cutting a LightningModule down to one stage: finding the sequence, and what a pipeline refuses."""

import pytest
import torch
from helpers.models import mlp
from helpers.runif import RunIf
from torch import nn

from lightning_gpipe.partition.discovery import find_sequence
from lightning_gpipe.partition.sequence import PipelinedSequential, materialize, partition_module


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
    with pytest.raises(TypeError, match=r"several nn.Sequential attributes \('a', 'b'\).*module_name='b'"):
        find_sequence(Holder(a=mlp().requires_grad_(False), b=mlp()))
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


class Rotary(nn.Module):
    """A layer with a table computed in __init__ and kept out of the state dict, as rotary embeddings are."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0).cos(), persistent=False)
        self.register_buffer("position_ids", torch.arange(4)[None], persistent=False)  # as BERT's embeddings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.table + self.position_ids


def rotary_model() -> Holder:
    torch.manual_seed(0)
    return Holder(layers=nn.Sequential(Rotary(), nn.Tanh(), Rotary(), Rotary()))


def test_reassembled_model_gets_the_other_stages_non_persistent_buffers() -> None:
    # Reassembly loaded a state dict into the other stages' layers after to_empty; non-persistent buffers are in no
    # state dict, so they stayed uninitialized memory (NaN rotary tables, BERT's position_ids out of range).
    plain = rotary_model()
    modules = [rotary_model(), rotary_model()]
    parts = [
        partition_module(module, "layers", module.layers, [2, 2], stage=stage) for stage, module in enumerate(modules)
    ]
    parts[0].reassemble([part.stage_state() for part in parts], {})
    whole = modules[0].layers
    assert isinstance(whole, nn.Sequential)
    expected = dict(plain.layers.named_buffers())
    assert dict(whole.named_buffers()).keys() == expected.keys()
    for name, buffer in whole.named_buffers():
        assert torch.equal(buffer, expected[name]), name
    x = torch.randn(3, 4)
    assert torch.equal(whole(x), plain.layers(x))


class LayerScale(nn.Module):
    """A parameter made directly in __init__, with no reset_parameters, as timm's ConvNeXt gamma."""

    def __init__(self) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((4,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


def test_meta_built_tensors_that_no_reset_parameters_writes_are_refused() -> None:
    # materialize allocated them with to_empty and nothing wrote them: training started from uninitialized memory.
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), LayerScale()), Rotary())
    materialize([(0, model[0])], torch.device("cpu"), seed=0)  # Linear's reset_parameters covers it
    refused = r"layer 1 was built on the meta device, and no reset_parameters\(\) initializes 1\.1\.gamma: "
    fix = r"add one to their module, or build the model in __init__"
    with pytest.raises(ValueError, match=refused + fix):
        materialize([(1, model[1])], torch.device("cpu"), seed=0)
    with pytest.raises(ValueError, match=r"no reset_parameters\(\) initializes 2\.table, 2\.position_ids:"):
        materialize([(2, model[2])], torch.device("cpu"), seed=0)


def test_a_refused_stage_keeps_no_meta_tensor_so_teardown_can_move_it() -> None:
    # The refusal came at the first such layer and left the later ones on meta: the teardown that follows the error
    # moved the module to the CPU and torch's "Cannot copy out of meta tensor" replaced the refusal.
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), LayerScale(), nn.Linear(4, 4), LayerScale())
    with pytest.raises(ValueError, match=r"layers 1, 3 were built on the meta device, .* 1\.gamma, 3\.gamma:"):
        materialize(list(enumerate(model)), torch.device("cpu"), seed=0)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    model.cpu()


class Whole(nn.Module):
    """A model kept whole next to the sequence built from its parts (a Hugging Face model and its blocks)."""

    def __init__(self, blocks: nn.Sequential) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)


@pytest.mark.parametrize("first", ["whole", "layers"])
def test_a_module_holding_the_sequences_layers_from_outside_is_refused_with_the_fix(first: str) -> None:
    # Registered first, its parameters were reported as "outside the sequence" although they are the sequence's;
    # registered after, torch failed with "Cannot copy out of meta tensor" when the module was moved to the device.
    layers = mlp()
    children = {"whole": Whole(layers), "layers": layers}
    module = Holder(**(children if first == "whole" else dict(reversed(children.items()))))
    refused = r"reaches layers of the pipelined sequence 'layers' from outside it too: whole.blocks.0 is layers.0"
    fix = r"; assign 'whole' with `object.__setattr__\(self, 'whole', model\)`$"
    with pytest.raises(ValueError, match=refused + r".*" + fix):
        partition_module(module, "layers", module.layers, [4, 4], stage=0)


def test_a_model_kept_outside_the_submodules_shares_the_reassembled_layers() -> None:
    module = Holder(layers=mlp())
    object.__setattr__(module, "whole", Whole(module.layers))  # the fix the message gives
    part = partition_module(module, "layers", module.layers, [4, 4], stage=0)
    other = Holder(layers=mlp())
    part.reassemble(
        [part.stage_state(), partition_module(other, "layers", other.layers, [4, 4], stage=1).stage_state()], {}
    )
    assert module.whole.blocks[6].weight is module.layers[6].weight
    assert not module.whole.blocks[6].weight.is_meta


def test_a_stateless_layer_also_used_outside_the_sequence_is_not_an_alias() -> None:
    # An activation kept as an attribute and reused in the sequence holds nothing a stage could lose.
    layers = mlp()
    module = Holder(act=layers[1], layers=layers)
    part = partition_module(module, "layers", module.layers, [4, 4], stage=0)
    assert part.stage == 0


def test_materializing_leaves_the_cuda_generators_alone() -> None:
    # R9: materialize seeded with torch.manual_seed under a CPU-only fork, which reseeds every CUDA generator for good
    # (on a machine where CUDA has not started, torch queues that reseed for when it does), so the CUDA stream the
    # user seeded was lost. Here the queued reseed is what shows it.
    tracker = torch.cuda._lazy_seed_tracker
    torch.manual_seed(0)
    queued = tracker.get_calls()
    with torch.device("meta"):
        model = mlp()
    before = torch.get_rng_state()
    materialize(list(enumerate(model)), torch.device("cpu"), seed=5)
    assert torch.equal(torch.get_rng_state(), before)
    assert tracker.get_calls() == queued


@RunIf(gpu=True)
def test_materializing_on_cuda_leaves_its_generator_alone() -> None:
    # R9 on a GPU: the CUDA generator's state is the same before and after, and the weights still come from the seed.
    torch.cuda.manual_seed(3)
    before = torch.cuda.get_rng_state()
    with torch.device("meta"):
        a, b = mlp(), mlp()
    materialize([(2, a[2])], torch.device("cuda"), seed=5)
    assert torch.equal(torch.cuda.get_rng_state(), before)
    materialize([(2, b[2])], torch.device("cuda"), seed=5)
    assert torch.equal(a[2].weight, b[2].weight)


def test_the_pipelined_sequence_is_indexed_and_sliced_as_the_users_sequence() -> None:
    # Issue 17.11: `self.layers[-1]` in configure_optimizers failed: PipelinedSequential was not subscriptable.
    module = Holder(layers=mlp())
    last = module.layers[-1]
    partition_module(module, "layers", module.layers, [4, 4], stage=1)
    assert len(module.layers) == 8
    assert module.layers[-1] is last
    assert module.layers[7] is last
    assert list(module.layers[0].parameters()) == []  # held by stage 0: nothing to optimize here
    body = list(module.layers[:-1].parameters())
    assert len(body) == 4  # layers 4 and 6, weights and biases
    assert {id(p) for p in body}.isdisjoint(id(p) for p in last.parameters())
    assert list(module.layers[2:4].parameters()) == []
    with pytest.raises(IndexError, match="index 8 is out of range for a sequence of 8 layers"):
        module.layers[8]
    with pytest.raises(TypeError, match="indexed by int or slice, not str"):
        module.layers["0"]  # type: ignore[index]
    spread = r"layers 3, 4, 5 are spread over the stages \(held here: 4, 5\); call the whole sequence"
    with pytest.raises(RuntimeError, match=spread):
        module.layers[3:6](torch.randn(2, 6))
