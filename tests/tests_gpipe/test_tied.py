"""Tied weights and shared modules across stages: a copy per stage, gradients summed, checkpoints like the plain model.

The multi-process test trains a tiny language model whose output projection is its input embedding (layer 0 and layer
7) with K = 1, 2, 4 and 2 stages x 2 replicas, and one model whose blocks all read one buffer-only module, against
plain Lightning and DDP.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers.jobs import run_job
from helpers.runif import RunIf
from helpers.tied_job import VOCAB, TiedModule, shared_table, tied_lm, tokens
from helpers.tied_job import fit as fit_tied
from test_strategy_equivalence import assert_same_parameters
from torch import nn

from lightning_gpipe import Pipeline, run_in_threads
from lightning_gpipe.engine.gradients import clip_grad_norm
from lightning_gpipe.engine.transport import ProcessGroupTransport
from lightning_gpipe.partition.balance import split
from lightning_gpipe.partition.sequence import materialize, partition_module
from lightning_gpipe.partition.state_dict import (
    local_optimizer_state,
    merge_optimizer_states,
    optimizer_state_by_name,
    parameter_aliases,
)
from lightning_gpipe.partition.tied import Tie, TiedCopies, find_ties, retie
from tools.launch import run_processes


class Holder(nn.Module):
    def __init__(self, layers: nn.Sequential) -> None:
        super().__init__()
        self.layers = layers


def lm_loss(output: torch.Tensor, microbatch: Any) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, VOCAB), microbatch[1].reshape(-1))


def plain_gradients(model: nn.Sequential, batch: Any) -> dict[str, torch.Tensor]:
    model.zero_grad()
    lm_loss(model(batch[0]), batch).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------- finding ties


def test_ties_are_found_with_the_stages_of_their_names() -> None:
    assert find_ties(tied_lm(), [4, 4]) == [Tie(("0.weight", "7.weight"), (0, 1), is_parameter=True)]
    assert find_ties(tied_lm(), [8]) == [Tie(("0.weight", "7.weight"), (0, 0), is_parameter=True)]
    (table,) = find_ties(shared_table(), [1, 3])
    assert table.names == ("0.table.scale", "1.table.scale", "2.table.scale", "3.table.scale")
    assert (table.stages, table.owner, table.is_parameter, table.local_name(1)) == ((0, 1), 0, False, "1.table.scale")


def test_a_batch_norm_shared_by_two_stages_is_refused() -> None:
    norm = nn.BatchNorm1d(4)
    layers = nn.Sequential(nn.Linear(4, 4), norm, nn.Linear(4, 4), norm)
    refused = r"layer 1 \(stage 0\) and layer 3 \(stage 1\) share one BatchNorm1d; give each its own, set "
    with pytest.raises(ValueError, match=refused + r"track_running_stats=False, or keep both on one stage$"):
        partition_module(Holder(layers), "layers", layers, [2, 2], stage=0)
    partition_module(Holder(layers), "layers", layers, [4], stage=0)  # within one stage: as the plain model


# ---------------------------------------------------------------------------------------------- partitioning


def test_every_stage_holds_the_tensors_its_layers_share_with_another_stage() -> None:
    # Moving the other stage's layers to meta also moved the module they share with this stage's layers,
    # whose buffers were then meta (uninitialized after materialize): NaN from the first step, no error.
    for stage in (0, 1):
        layers = shared_table()
        partition_module(Holder(layers), "layers", layers, [2, 2], stage=stage)
        assert not layers[2 * stage].table.scale.is_meta
        assert torch.equal(layers[2 * stage + 1].table.scale, torch.linspace(0.5, 1.5, 8))
        assert layers[2 - 2 * stage].linear.weight.is_meta  # the other stage's own weights are set aside
    lm = tied_lm()
    partition_module(Holder(lm), "layers", lm, [4, 4], stage=1)
    assert not lm[7].weight.is_meta
    assert lm[7].weight is lm[0].weight  # the set-aside embedding still names this stage's tensor
    assert lm[1].weight.is_meta


def test_a_model_built_on_meta_keeps_its_ties_after_materializing() -> None:
    # materialize() gives each layer new tensors (to_empty), which silently untied the head from the embedding even
    # on one stage: two parameters trained apart.
    with torch.device("meta"):
        lm = tied_lm()
    partition = partition_module(Holder(lm), "layers", lm, [8], stage=0)
    materialize(list(enumerate(lm)), torch.device("cpu"), seed=1)
    assert lm[7].weight is not lm[0].weight
    retie(lm, partition.ties)
    assert lm[7].weight is lm[0].weight
    assert len(list(lm.parameters())) == len(list(tied_lm().parameters()))


# ------------------------------------------------------------------------------------------- norm and optimizer state


def test_a_tied_copy_counts_once_in_the_global_norm() -> None:
    owned, copy_ = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    owned.grad, copy_.grad = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0])
    norm = clip_grad_norm([owned, copy_], 1.0, None, duplicates=[copy_])
    assert norm.item() == pytest.approx(3.0)
    assert copy_.grad.tolist() == pytest.approx([0.0, 4.0 / 3.0], rel=1e-5)  # scaled all the same


def test_optimizer_state_of_tied_copies_is_saved_once_under_the_first_name() -> None:
    whole = Holder(tied_lm())
    aliases = parameter_aliases(whole)
    assert aliases == {"layers.7.weight": "layers.0.weight"}
    order = [name for name, _ in whole.named_parameters()]
    stages, parts = [], []
    for stage in (0, 1):
        module = copy.deepcopy(whole)
        partition_module(module, "layers", module.layers, [4, 4], stage=stage)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        for parameter in module.parameters():
            parameter.grad = torch.ones_like(parameter)
        optimizer.step()
        stages.append((module, optimizer))
        parts.append(optimizer_state_by_name(optimizer, module, aliases))
    assert "layers.0.weight" in parts[1]["state"]  # stage 1's copy, under the plain model's name
    merged = merge_optimizer_states(parts, order)
    assert merged["param_groups"][0]["params"] == order
    plain = torch.optim.SGD(whole.parameters(), lr=0.1, momentum=0.9)
    positional = {**merged, "param_groups": [{**merged["param_groups"][0], "params": list(range(len(order)))}]}
    positional["state"] = {order.index(name): value for name, value in merged["state"].items()}
    plain.load_state_dict(positional)  # the plain optimizer takes it
    module, optimizer = stages[1]
    optimizer.load_state_dict(local_optimizer_state(merged, optimizer, module, order, aliases))
    assert torch.equal(
        optimizer.state[module.get_parameter("layers.7.weight")]["momentum_buffer"], torch.ones(VOCAB, 8)
    )


# ---------------------------------------------------------------------------------------------- the engine


def test_split_refuses_a_tensor_shared_by_two_cells_unless_allowed() -> None:
    # split() handed each process a cell whose copy of a tied weight trained apart from the others'.
    with pytest.raises(
        ValueError, match=r"layer 0\.weight \(cell 0\) and layer 7\.weight \(cell 1\) share one parameter"
    ):
        split(tied_lm(), [4, 4])
    shared = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"layer 0\.weight \(cell 0\) and layer 2\.weight \(cell 1\) share one .*"
                       r"allow_shared=True.*run_in_threads.*TiedCopies"):  # fmt: skip
        split(nn.Sequential(shared, nn.Tanh(), shared), [2, 1])
    with pytest.raises(
        ValueError, match=r"layer 0\.table\.scale \(cell 0\) and layer 2\.table\.scale \(cell 1\) share"
    ):
        split(shared_table(), [2, 2])
    assert len(split(tied_lm(), [8])) == 1  # within one cell: the plain model
    assert len(split(tied_lm(), [4, 4], allow_shared=True)) == 2


@pytest.mark.parametrize("balance", [[4, 4], [2, 2, 2, 2]])
def test_threads_share_the_tied_tensor_and_accumulate_its_whole_gradient(balance: list[int]) -> None:
    torch.manual_seed(0)
    model = tied_lm()
    batch = tokens(16)[:]
    expected = plain_gradients(model, batch)
    model.zero_grad()
    run_in_threads(split(model, balance, allow_shared=True), batch, lm_loss, chunks=4)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, expected[name], atol=1e-6, rtol=1e-5)


def _pipeline_with_tied_copies(rank: int, world_size: int) -> dict[str, torch.Tensor | None]:
    torch.manual_seed(0)  # every process builds the same model and keeps its own cell
    model = tied_lm()
    ties = find_ties(model, [4, 4])
    cell = split(model, [4, 4], allow_shared=True)[rank]
    if rank == 1:
        nn.init.zeros_(cell.get_parameter("7.weight"))  # a copy that differs: the owner's value must replace it
    copies = TiedCopies(ties, cell, stage=rank, pipelines=[[0, 1]])
    copies.broadcast()
    pipeline = Pipeline(cell, ProcessGroupTransport(ranks=[0, 1]), chunks=4)
    pipeline.train_step(tokens(16)[:], lm_loss)
    copies.sum_gradients()
    grads: dict[str, torch.Tensor | None] = {name: p.grad for name, p in cell.named_parameters()}
    # A tied layer used only on stage 0 this step, and one used nowhere: the sum reaches stage 1, None stays None.
    used, unused = nn.Linear(2, 2), nn.Linear(2, 2)
    layers = nn.Sequential(used, unused, used, unused)
    cell = split(layers, [2, 2], allow_shared=True)[rank]
    copies = TiedCopies(find_ties(layers, [2, 2]), cell, stage=rank, pipelines=[[0, 1]])
    if rank == 0:
        used(torch.ones(1, 2)).sum().backward()
    copies.sum_gradients()
    grads.update({"used": used.weight.grad, "unused": unused.weight.grad})
    return grads


@RunIf(multiprocess=True)
@pytest.mark.slow  # the strategy's tied test runs the same copies in processes by default
def test_pipeline_processes_keep_tied_copies_equal_with_tied_copies() -> None:
    stages = run_processes(_pipeline_with_tied_copies, 2, timeout=240)
    torch.manual_seed(0)
    expected = plain_gradients(tied_lm(), tokens(16)[:])
    assert stages[0].pop("used").tolist() == stages[1].pop("used").tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert (stages[0].pop("unused"), stages[1].pop("unused")) == (None, None)
    assert stages[1].keys() == {"5.weight", "5.bias", "7.weight", "7.bias"}
    for name, grad in [*stages[0].items(), *stages[1].items()]:
        torch.testing.assert_close(torch.as_tensor(grad), expected[name.replace("7.weight", "0.weight")])


# ---------------------------------------------------------------------------------------------- the strategy


def _launch(folder: Path, world_size: int, runs: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
    folder.mkdir(parents=True)
    config = folder / "config.json"
    config.write_text(json.dumps({"runs": runs}))
    results = run_job("helpers.tied_job", [str(config)], world_size, timeout=400)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank} failed:\n{result.stdout[-4000:]}"
    for index, run in enumerate(runs):
        if run.get("model", "lm") == "lm":
            assert json.loads((folder / f"tied-{index}.json").read_text())["tied"], f"run {index} untied the model"
    return [torch.load(folder / f"result-{index}.pt", weights_only=True) for index in range(len(runs))]


def _plain(tmp_path: Path, **run: Any) -> dict[str, torch.Tensor]:
    return fit_tied({**run, "strategy": "auto", "devices": 1}, tmp_path / "plain").state_dict()


CLIP = 0.3  # below the gradient norm (~0.6), so clipping acts and a tied weight counted twice would show
EPOCH = {"epochs": 1, "steps": -1, "chunks": 4, "clip": CLIP}  # 4 steps
DATA_PARALLEL = {"steps": 3, "chunks": 4, "clip": CLIP, "distributed_sampler": True, "shuffle": True}


def _assert_checkpoint_is_the_plain_modules(checkpoint: Path) -> None:
    # The tied tensor under both names (gathered from two stages: equal bits), optimizer state once, by name.
    saved = torch.load(checkpoint, weights_only=True)
    plain = TiedModule()
    plain.load_state_dict(saved["state_dict"], strict=True)
    assert plain.layers[0].weight is plain.layers[7].weight  # type: ignore[index]
    assert torch.equal(saved["state_dict"]["layers.7.weight"], saved["state_dict"]["layers.0.weight"])
    assert "layers.7.weight" not in saved["optimizer_states"][0]["state"]
    assert "layers.0.weight" in saved["optimizer_states"][0]["state"]


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
def test_tied_embeddings_and_a_shared_buffer_module_train_like_plain_lightning_compiled_or_not(tmp_path: Path) -> None:
    # Before: the tied embedding was refused ("share one parameter"), and a table shared by two stages' layers gave
    # NaN. With compile=True each stage's layers, compiled in place, train as the plain model and save its names.
    checkpoint, compiled_checkpoint = tmp_path / "two-stages.ckpt", tmp_path / "compiled.ckpt"
    compiled = {"options": {"compile": True}}
    two = _launch(tmp_path / "two", 2, [
        {**EPOCH, "pipe_size": 2, "devices": 2, "save": str(checkpoint)},
        {"model": "table", "steps": 3, "chunks": 4, "pipe_size": 2, "devices": 2},
        {**EPOCH, **compiled, "pipe_size": 2, "devices": 2, "save": str(compiled_checkpoint)},
        {**EPOCH, **compiled, "pipe_size": 2, "devices": 2, "checkpoint": "always"},
    ])  # fmt: skip
    one_epoch = _plain(tmp_path, **EPOCH)
    assert_same_parameters(two[0], one_epoch)
    assert_same_parameters(two[1], _plain(tmp_path, model="table", steps=3))
    _assert_checkpoint_is_the_plain_modules(checkpoint)
    assert_same_parameters(two[2], one_epoch)
    assert_same_parameters(two[3], one_epoch)
    _assert_checkpoint_is_the_plain_modules(compiled_checkpoint)


@pytest.mark.slow  # two jobs of 2 and 4 processes, about 3 minutes on a loaded 2-core machine
@RunIf(multiprocess=True)
def test_tied_embeddings_train_like_plain_lightning_with_any_k_and_like_ddp_with_replicas(tmp_path: Path) -> None:
    checkpoint = tmp_path / "two-stages.ckpt"
    two = _launch(tmp_path / "two", 2, [
        {**EPOCH, "pipe_size": 2, "devices": 2, "save": str(checkpoint)},
        {**DATA_PARALLEL, "strategy": "ddp", "devices": 2},
        {**DATA_PARALLEL, "pipe_size": 1, "devices": 2},  # K = 1, two replicas
        {**EPOCH, "pipe_size": 2, "devices": 2, "meta": True},
    ])  # fmt: skip
    four = _launch(tmp_path / "four", 4, [
        {**EPOCH, "pipe_size": 4, "devices": 4},
        {**DATA_PARALLEL, "pipe_size": 2, "devices": 4},  # 2 stages x 2 replicas
        {**EPOCH, "epochs": 2, "pipe_size": 4, "devices": 4, "resume": str(checkpoint)},  # written with K = 2
    ])  # fmt: skip
    one_epoch = _plain(tmp_path, **EPOCH)
    one_stage = fit_tied({**EPOCH, "pipe_size": 1, "devices": 1}, tmp_path / "one").state_dict()
    assert_same_parameters(one_stage, one_epoch)
    assert_same_parameters(two[0], one_epoch)
    assert_same_parameters(four[0], one_epoch)
    assert_same_parameters(four[1], two[1])
    assert_same_parameters(two[2], two[1])
    assert_same_parameters(four[2], _plain(tmp_path, **{**EPOCH, "epochs": 2}))
    _assert_checkpoint_is_the_plain_modules(checkpoint)
    # A model built on meta starts from the same weights on every number of stages: the embedding's.
    meta_one_stage = fit_tied({**EPOCH, "pipe_size": 1, "devices": 1, "meta": True}, tmp_path / "meta").state_dict()
    assert_same_parameters(two[3], meta_one_stage)
