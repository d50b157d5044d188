"""Pretrained weights read per stage (``partition/reader.py``), for any module with a reader: both stages of a K = 2
pipeline built in one process read their own tensors only, and train as the plain module."""

from __future__ import annotations

import copy
import datetime
import threading
from collections.abc import Collection, Mapping

import pytest
import torch
from torch import Tensor, nn

from lightning_gpipe.engine.thread_transport import ThreadTransport
from lightning_gpipe.partition.assembly import AssembledStage, assemble_stage
from lightning_gpipe.partition.config import BuildConfig
from lightning_gpipe.partition.reader import claim_reader
from lightning_gpipe.partition.sequence import materialize

CPU = torch.device("cpu")
V, D = 11, 6  # vocabulary, width


class Halve(nn.Module):
    """A layer with a value it computes for itself (a non-persistent buffer, as a rotary table is)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("factor", torch.tensor(0.5, device="cpu"), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.factor


class Net(nn.Module):
    """A user's module whose last layer is new (a fine-tuning head). (A tensor tied across stages is read by each
    stage that holds it: tests/tests_zoo/test_per_stage_loading.py, where stages are processes.)"""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Embedding(V, D), nn.Linear(D, D), Halve(), nn.Tanh(), nn.Linear(D, V, bias=False), nn.Linear(V, 3)
        )


class DictReader:
    """The reader protocol over tensors in memory: keys(), read_into(tensors); records what it reads."""

    def __init__(self, values: Mapping[str, Tensor]) -> None:
        self.values = dict(values)
        self.read: list[str] = []

    def keys(self) -> Collection[str]:
        return self.values.keys()

    def read_into(self, tensors: Mapping[str, Tensor]) -> None:
        for key, tensor in tensors.items():
            self.read.append(key)
            tensor.copy_(self.values[key])


class Pending(Net):
    """The module built on the meta device, its weights waiting in a reader it hands over once."""

    def __init__(self, reader: DictReader | None) -> None:
        with torch.device("meta"):
            super().__init__()
        self.reader = reader

    def claim_weights_reader(self) -> DictReader | None:
        reader, self.reader = self.reader, None
        return reader


def _assemble(readers: list[DictReader]) -> list[AssembledStage]:
    config = BuildConfig(pipe_size=2, chunks=2, balance=[3, 3])
    transports = ThreadTransport.create(2, timeout=datetime.timedelta(seconds=60))
    stages = []
    for j, reader in enumerate(readers):  # stage j runs on rank 1 - j
        module = Pending(reader)
        stages.append(assemble_stage(module, config.resolve(2, 1 - j), CPU, transports[j], reader=claim_reader(module)))
    return stages


def _train(stages: list[AssembledStage], data: tuple[Tensor, Tensor]) -> None:
    def loss(output: Tensor, batch: tuple[Tensor, Tensor]) -> Tensor:
        return nn.functional.cross_entropy(output, batch[1])

    threads = [threading.Thread(target=stage.pipeline.train_step, args=(data, loss)) for stage in stages]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)


def test_each_stage_reads_its_own_tensors_and_trains_as_the_plain_module() -> None:
    torch.manual_seed(0)
    source = Net()
    pretrained = {key: value for key, value in source.state_dict().items() if not key.startswith("layers.5.")}
    readers = [DictReader(pretrained), DictReader(pretrained)]
    stages = _assemble(readers)

    assert sorted(readers[0].read) == ["layers.0.weight", "layers.1.bias", "layers.1.weight"]
    assert sorted(readers[1].read) == ["layers.4.weight"]
    # What no reader provides starts as a meta-built layer does: reset_parameters, seeded per layer.
    expected_new = copy.deepcopy(Pending(None).layers[5])
    materialize([(5, expected_new)], CPU, torch.initial_seed() % 2**62)
    plain = Net()
    plain.load_state_dict({**pretrained, **{f"layers.5.{k}": v for k, v in expected_new.state_dict().items()}})
    for stage in stages:
        module = stage.partition.module
        for key, value in module.state_dict().items():
            assert torch.equal(value, plain.state_dict()[key]), key
        assert all(not t.is_meta for t in [*module.layers.parameters(), *module.layers.buffers()])
    assert stages[0].partition.module.layers[2].factor.item() == 0.5, "a computed buffer keeps its value"

    data = (torch.randint(0, V, (4,)), torch.randint(0, 3, (4,)))
    nn.functional.cross_entropy(plain.layers(data[0]), data[1]).backward()
    _train(stages, data)
    for stage in stages:
        for name, parameter in stage.partition.module.named_parameters():
            torch.testing.assert_close(parameter.grad, plain.get_parameter(name).grad, rtol=1e-5, atol=1e-7)


def test_a_claim_that_returns_no_reader_is_refused_naming_the_method() -> None:
    class Wrong(nn.Module):
        def claim_weights_reader(self) -> object:
            return {"layers.0.weight": torch.zeros(1)}

    assert claim_reader(nn.Linear(2, 2)) is None
    with pytest.raises(TypeError, match=r"Wrong.claim_weights_reader\(\) returned a dict, which lacks keys\(\) or"):
        claim_reader(Wrong())
