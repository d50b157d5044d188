"""Stage assembly without a Trainer: both stages of a K=2 pipeline built in one process train as the plain model."""

from __future__ import annotations

import copy
import datetime
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
import torch
from helpers.models import IN, batch, build, loss_fn
from torch import nn

from lightning_gpipe.engine.thread_transport import ThreadTransport
from lightning_gpipe.partition.assembly import AssembledStage, assemble_stage, resolve_balance
from lightning_gpipe.partition.config import BuildConfig

CPU = torch.device("cpu")


class Net(nn.Module):
    """A plain module (no LightningModule) holding the sequence to pipeline and a buffer outside it."""

    def __init__(self, layers: nn.Sequential | None = None) -> None:
        super().__init__()
        self.layers = build("mlp") if layers is None else layers
        self.register_buffer("scale", torch.tensor(2.0))


def assemble(model: nn.Module, config: BuildConfig, sample: Any = None) -> list[AssembledStage]:
    """Every stage of one pipeline, each from its own copy of ``model``, linked by threads."""
    K = config.pipe_size
    assert K is not None
    transports = ThreadTransport.create(K, timeout=datetime.timedelta(seconds=60))
    # Stage j runs on rank K - 1 - j: the layout puts the last stage on the pipeline's lowest rank.
    return [
        assemble_stage(copy.deepcopy(model), config.resolve(K, K - 1 - j), CPU, transports[j], sample=sample)
        for j in range(K)
    ]


def train_in_threads(stages: Sequence[AssembledStage], data: Any) -> None:
    errors: list[BaseException] = []

    def work(stage: AssembledStage) -> None:
        try:
            stage.pipeline.train_step(data, loss_fn)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=work, args=(stage,)) for stage in stages]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a stage did not finish its step"
    assert not errors, errors


def test_stages_assembled_in_one_process_train_as_the_plain_model() -> None:
    model = Net()
    config = BuildConfig(pipe_size=2, chunks=4)
    stages = assemble(model, config, sample=torch.randn(2, IN))  # balance=None with a sample: by FLOPs

    assert stages[0].layers + stages[1].layers == list(range(8))
    assert stages[0].partition.bounds == stages[1].partition.bounds  # every stage resolved the same balance
    for stage in stages:
        assert stage.names.keys == list(model.state_dict())  # checkpoints keep the whole module's names
        assert stage.names.shapes["scale"] == ()
        assert stage.whole_parameters == (sum(p.numel() for p in model.parameters()),) * 2
        assert stage.pipeline.chunks == 4
    assert sum(stage.stage_parameters[0] for stage in stages) == stages[0].whole_parameters[0]

    data = batch(16)
    model.zero_grad()
    loss_fn(model.layers(data[0]), data).backward()
    train_in_threads(stages, data)
    for stage in stages:
        module = stage.partition.module
        for name, parameter in module.named_parameters():  # a stage's module names only its own layers' parameters
            expected = model.get_parameter(name).grad
            torch.testing.assert_close(parameter.grad, expected, rtol=1e-5, atol=1e-7)

    # The inverse: the stages' parts put the whole module back (the strategy gathers them over the pipeline).
    parts = [stage.partition.stage_state() for stage in stages]
    for stage in stages:
        stage.partition.reassemble(parts, stage.ties.values())
        whole = stage.partition.module
        assert isinstance(whole.layers, nn.Sequential)
        torch.testing.assert_close(whole.layers(data[0]), model.layers(data[0]))


def test_a_list_balance_and_deferred_batch_norm_are_applied() -> None:
    from lightning_gpipe.engine.batchnorm import DeferredBatchNorm

    model = Net(nn.Sequential(nn.Linear(IN, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)))
    config = BuildConfig(pipe_size=2, chunks=2, balance=[3, 1], deferred_batch_norm=True)
    stages = assemble(model, config)
    assert [stage.layers for stage in stages] == [[0, 1, 2], [3]]
    assert isinstance(stages[0].stage.cell[1], DeferredBatchNorm)


def test_too_few_layers_for_the_stages_are_refused_with_the_fix() -> None:
    config = BuildConfig(pipe_size=4, chunks=4)
    transport = ThreadTransport.create(4)[0]
    with pytest.raises(ValueError, match=r"cannot split the 3 layers of 'layers' into 4 stages; use pipe_size <= 3 or"):
        assemble_stage(Net(build("mlp")[:3]), config.resolve(4, 3), CPU, transport)


def test_a_measured_balance_needs_a_sample_input() -> None:
    config = BuildConfig(pipe_size=2, chunks=4, balance="flops")
    transport = ThreadTransport.create(2)[0]
    with pytest.raises(ValueError, match=r"balance='flops' needs a sample input: set `self.example_input_array`"):
        assemble_stage(Net(), config.resolve(2, 1), CPU, transport)


def test_assembly_takes_the_resolved_settings_and_hands_their_engine_part_down() -> None:
    settings = BuildConfig(pipe_size=2, chunks=2, balance=[3, 5]).resolve(world_size=2, rank=1)  # stage 0
    assembled = assemble_stage(Net(), settings, CPU, ThreadTransport.create(2)[0])
    assert assembled.layers == [0, 1, 2]
    assert assembled.pipeline.config is settings.pipeline  # not rebuilt, nor checked again
    assert assembled.stage.config is settings.pipeline


# ------------------------------------------------------------------ several stages per process


def test_a_zbv_process_holds_two_slices_that_share_one_tied_parameter() -> None:
    from helpers.tied_job import tied_lm

    from lightning_gpipe.engine.layout import ProcessLayout
    from lightning_gpipe.partition.sequence import partition_module
    from lightning_gpipe.partition.tied import ties_between_processes

    layout = ProcessLayout(2, 2, 0, "zbv")  # rank 0: stages 0 and 3, the embedding and the head tied to it
    lm = tied_lm()
    partition = partition_module(Net(lm), "layers", lm, [2, 2, 2, 2], layout.stages)
    assert partition.stages == (0, 3)
    assert partition.layers == [0, 1, 6, 7]
    # The plain module's names, the tied weight under both (so a checkpoint's merged parts are the plain state dict).
    held = ["layers.0.weight", "layers.1.weight", "layers.1.bias", "layers.7.weight", "layers.7.bias"]
    assert list(partition.module.state_dict()) == ["scale", *held]
    first, last = (partition.stand_in.cell(partition.bounds[stage]) for stage in partition.stages)
    assert [name for name, _ in first.named_children()] == ["0", "1"]
    assert first[0].weight is last[1].weight  # one Parameter: one gradient, no collective
    (tie,) = ties_between_processes(partition.ties, layout.position_of)
    assert tie.stages == (0,)  # one place: TiedCopies keeps no copy of it
    (across,) = ties_between_processes(partition.ties, ProcessLayout(2, 2, 0, "interleaved", 2).position_of)
    assert across.stages == (0, 1)  # interleaved puts stage 3 on the other process: two copies, summed


def test_balance_counts_every_stage_of_every_process() -> None:
    config = BuildConfig(pipe_size=2, chunks=4, schedule="interleaved", virtual_stages=2)
    settings = config.resolve(world_size=2, rank=0)
    assert settings.num_stages == 4
    assert settings.layout.stages == (1, 3)
    balance = resolve_balance(replace(settings, balance="params"), build("mlp"), None, CPU)
    assert len(balance) == 4  # one entry per stage, K * v
    assert sum(balance) == 8
    with pytest.raises(ValueError, match=r"balance=\[4, 4\] has 2 stages but the pipeline has 4: pipe_size=2 "):
        BuildConfig(pipe_size=2, chunks=4, schedule="interleaved", virtual_stages=2, balance=[4, 4])
    with pytest.raises(ValueError, match=r"has 2 stages but the pipelines have 4 \(2 processes x 2 stages each\)"):
        BuildConfig(chunks=4, schedule="zbv", balance=[4, 4]).resolve(world_size=2, rank=0)


def test_more_stages_than_layers_names_the_schedule() -> None:
    config = BuildConfig(pipe_size=2, chunks=4, schedule="interleaved", virtual_stages=3)
    with pytest.raises(ValueError, match=r"3 layers of 'layers' into 6 stages.*pipe_size x 3 stages per process "
                                         r"\(schedule='interleaved'\) <= 3"):  # fmt: skip
        assemble_stage(Net(build("mlp")[:3]), config.resolve(2, 0), CPU, {1: ThreadTransport.create(2)[0]})


@pytest.mark.parametrize(("schedule", "virtual_stages"), [("zbv", 1), ("interleaved", 2)])
def test_processes_of_several_stages_assembled_in_threads_train_as_the_plain_model(
    schedule: str, virtual_stages: int
) -> None:
    # K=2 processes of two stages each, every process a thread over the ThreadTransports of its stages. The tied
    # language model's embedding (layer 0) and head (layer 7) share one weight: under ZB-V both sit on process 0, as
    # two stages whose cells use one Parameter, which gets both stages' gradients with no collective at all.
    from helpers.tied_job import VOCAB, tied_lm, tokens

    def lm_loss(output: torch.Tensor, microbatch: Any) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(output.reshape(-1, VOCAB), microbatch[1].reshape(-1))

    torch.manual_seed(0)
    model = Net(tied_lm() if schedule == "zbv" else build("mlp"))
    loss = lm_loss if schedule == "zbv" else loss_fn
    data = tokens(16).tensors if schedule == "zbv" else batch(16)
    config = BuildConfig(pipe_size=2, chunks=4, balance=[2, 2, 2, 2], schedule=schedule, virtual_stages=virtual_stages)
    transports = ThreadTransport.create(4, timeout=datetime.timedelta(seconds=60))
    processes = []
    for rank in range(2):
        settings = config.resolve(2, rank)
        links = {stage: transports[stage] for stage in settings.layout.stages}
        processes.append(assemble_stage(copy.deepcopy(model), settings, CPU, links))
    if schedule == "zbv":
        first, last = (processes[0].pipeline.stages[i].cell for i in (0, 1))
        assert first[0].weight is last[1].weight
        assert not processes[0].ties.ties  # nothing to keep equal across processes
    model.zero_grad()
    loss(model.layers(data[0]), data).backward()
    errors: list[BaseException] = []

    def work(process: AssembledStage) -> None:
        try:
            process.pipeline.train_step(data, loss)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=work, args=(process,)) for process in processes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    for process in processes:
        for name, parameter in process.partition.module.named_parameters():
            torch.testing.assert_close(parameter.grad, model.get_parameter(name).grad, rtol=1e-5, atol=1e-7)
    parts = [process.partition.stage_state() for process in processes]
    for process in processes:
        process.partition.reassemble(parts, process.ties.values())
        torch.testing.assert_close(process.partition.module.layers(data[0]), model.layers(data[0]))


def test_layers_a_rank_lacks_are_refused_rather_than_initialized_afresh() -> None:
    # After gather_module a rank keeps its own stage's layers, the others on meta; cut another way, its new stage
    # would have started from reset_parameters without a word.
    stages = assemble(Net(), BuildConfig(pipe_size=2, chunks=2, balance=[4, 4]))
    module = stages[1].partition.module
    stages[1].partition.put_back(allocate=False)  # as on stage 1's rank after a gather: layers 4-7, the rest on meta
    assert module.layers[0].weight.is_meta
    assert not module.layers[4].weight.is_meta
    settings = BuildConfig(pipe_size=2, chunks=2, balance=[2, 6]).resolve(2, 0)  # rank 0 holds stage 1: layers 2-7
    refused = r"layer 2 of the sequence is on the meta device on this rank while layers 4, 6, 7 hold weights"
    with pytest.raises(ValueError, match=refused + r": cut as before .* or resume from a checkpoint"):
        assemble_stage(module, settings, CPU, ThreadTransport.create(2)[1])


def test_a_module_cut_by_an_earlier_trainer_is_refused_with_the_way_back() -> None:
    (stage,) = assemble(Net(), BuildConfig(pipe_size=1, chunks=2))
    refused = r"Net.layers holds one stage only, cut by another Trainer that has not put it back: "
    with pytest.raises(ValueError, match=refused + r"call that Trainer's strategy.gather_module\(\) on every rank"):
        assemble_stage(
            stage.partition.module, BuildConfig(pipe_size=1).resolve(1, 0), CPU, ThreadTransport.create(1)[0]
        )
