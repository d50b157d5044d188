"""``data_parallel="fsdp"``: two pipelines of two stages whose replicas shard each stage train exactly like ``"ddp"``.

The multi-process tests share four jobs of 4 gloo ranks (:data:`JOBS`), each launched when a test first asks for it;
every fit runs under ``"ddp"`` and under ``"fsdp"`` (Adam, clipping by norm, 5 steps), and the tests compare what each
rank holds at the end of training, its parameters gathered whole stage by stage (``full_tensor``), and the whole model
that ``trainer.strategy.gather_module()`` puts back on global rank 0. Checkpoints: ``test_fsdp_checkpoints.py``.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.fsdp_job import wide
from helpers.jobs import run_job
from helpers.runif import RunIf
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.engine.layout import ProcessLayout
from lightning_gpipe.engine.sharding import ShardedCell, is_sharded, whole
from lightning_gpipe.engine.thread_transport import ThreadTransport
from lightning_gpipe.partition.assembly import assemble_stage
from lightning_gpipe.partition.config import BuildConfig
from lightning_gpipe.partition.fsdp import _skeleton, mixed_precision, shard_stage, ties_kept_whole, unshard_stage
from lightning_gpipe.partition.sequence import partition_module
from lightning_gpipe.partition.tied import Tie
from zoo.hf.causal_lm_tiny import save_tiny_causal_lm, tiny_causal_config

TOLERANCE = 1e-5
WORLD = 4
CAUSAL = "hf_causal_lm"
LLAMA = "llama_bf16"  # a Llama saved in bfloat16 safetensors shards, read per stage by zoo.load_pretrained
_ZOO = {"steps": 3, "chunks": 2, "clip": None}
_PAIR = {"pipe_size": 2, "devices": WORLD, "chunks": 4, "steps": 5, "clip": 0.05}
SCHEDULES: dict[str, dict[str, Any]] = {
    "gpipe": {},
    "1f1b": {"schedule": "1f1b"},
    "zero_bubble": {"schedule": "zero_bubble"},
    "interleaved": {"schedule": "interleaved", "virtual_stages": 2},
    "zbv": {"schedule": "zbv"},
}
FLOWS: dict[str, dict[str, Any]] = {
    "accumulation, always": {"accumulate": 2, "checkpoint": "always"},
    "selective, zero bubble": {"checkpoint": "selective", "schedule": "zero_bubble"},
    "never, 1f1b": {"checkpoint": "never", "schedule": "1f1b"},
    "deferred batch norm": {"batch_norm": True, "deferred_batch_norm": True},
    "meta": {"meta": True},
    "validation, logging": {
        **{"limit_val_batches": 2, "val_check_interval": 2, "sync_dist": True, "optimizer": "sgd", "predict": True}
    },
    "bf16-mixed": {"precision": "bf16-mixed"},
    "bf16-true": {"precision": "bf16-true"},
    "16-mixed": {"precision": "16-mixed"},  # with a GradScaler, as on a GPU
    # Embedding and head on two processes (sharded alike), on one ZB-V process (kept whole), and built on meta.
    "tied": {"model": "tied"},
    "tied, zbv": {"model": "tied", "schedule": "zbv"},
    "tied, interleaved, meta": {"model": "tied", "schedule": "interleaved", "virtual_stages": 2, "meta": True},
}
# One pipeline of 4 stages: nothing to shard over.
_ALONE = {"pipe_size": 4, "devices": WORLD, "chunks": 4, "steps": 2}
# A model of 16 layers of 4 MiB built on meta, one stage over 4 replicas: what setup allocates per rank.
_WIDE = {"pipe_size": 1, "devices": WORLD, "chunks": 2, "steps": 1, "model": "wide", "meta": True, "optimizer": "sgd"}


def _pairs(fits: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    runs = {}
    for name, run in fits.items():
        for data_parallel in ("ddp", "fsdp"):
            runs[f"{name} {data_parallel}"] = {**_PAIR, **run, "data_parallel": data_parallel}
    return runs


JOBS: dict[str, dict[str, dict[str, Any]]] = {
    "schedules": {
        **_pairs(SCHEDULES),
        "alone ddp": {**_ALONE, "data_parallel": "ddp"},
        "alone fsdp": {**_ALONE, "data_parallel": "fsdp"},
    },
    "flows": _pairs(FLOWS),
    # A Hugging Face decoder LM (Gemma: its embedding tied to the head across the stages, rotary tables), then greedy
    # decoding in predict steps, and the zoo's encoder-decoder Transformer (a nested boundary value with a padding
    # mask), each decoder layer its own unit. No clipping: Adam turns the noise-level gradients of attention's key
    # biases into whole steps, so a norm summed in another order (shards, then stages) moves them by 1e-4; without it
    # the two are bit for bit equal. chunks=2: decoding 4 prompts in 4 micro-batches fails under "ddp" too (reported).
    # Then a Llama whose weights each rank reads for its stage alone from bfloat16 shards, as hub checkpoints ship.
    "zoo": {
        f"{name} {dp}": {**_PAIR, **_ZOO, "zoo": name, "data_parallel": dp, "decode": name == CAUSAL}
        for name in (CAUSAL, "transformer", LLAMA)
        for dp in ("ddp", "fsdp")
    },
    "setup": {f"wide {dp}": {**_WIDE, "measure_setup": True, "data_parallel": dp} for dp in ("ddp", "fsdp")},
}


class Fit:
    """What one fit of a job left: per rank at the start and end of training, the gathered model, logs."""

    def __init__(self, folder: Path, index: int, stdout: str) -> None:
        self.folder, self.index, self.stdout = folder, index, stdout

    def held(self, rank: int) -> dict[str, Any]:
        return torch.load(self.folder / f"held-{self.index}-rank{rank}.pt", weights_only=True)

    @property
    def result(self) -> dict[str, torch.Tensor]:
        return torch.load(self.folder / f"result-{self.index}.pt", weights_only=True)

    @property
    def metrics(self) -> dict[str, torch.Tensor]:
        return torch.load(self.folder / f"metrics-{self.index}.pt", weights_only=True)


class SharedJobs:
    """The jobs of :data:`JOBS`, each launched on first use; ``jobs(name)[fit]``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._done: dict[str, dict[str, Fit]] = {}

    def __call__(self, job: str) -> dict[str, Fit]:
        if job not in self._done:
            folder = self.root / job
            folder.mkdir(parents=True)
            if job == "zoo":
                save_tiny_causal_lm(folder / f"{CAUSAL}-source", "gemma", init_std=0.3)
                save_bfloat16_llama(folder / f"{LLAMA}-source")
            config = folder / "config.json"
            config.write_text(json.dumps({"runs": list(JOBS[job].values())}))
            results = run_job("helpers.fsdp_job", [str(config)], WORLD, timeout=540)
            for rank, result in enumerate(results):
                assert result.returncode == 0, f"rank {rank} failed:\n{result.stdout[-6000:]}"
            self._done[job] = {name: Fit(folder, index, results[0].stdout) for index, name in enumerate(JOBS[job])}
        return self._done[job]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> SharedJobs:
    return SharedJobs(tmp_path_factory.mktemp("fsdp"))


def _difference(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[str, float]:
    assert actual.keys() == expected.keys()
    return max(((k, (actual[k].double() - v.double()).abs().max().item()) for k, v in expected.items()), key=_second)


def _second(item: tuple[str, float]) -> float:
    return item[1]


def save_bfloat16_llama(directory: Path) -> None:
    """A tiny Llama of 4 layers, random-initialized, saved in bfloat16 safetensors shards with their index."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_causal_config("llama", layers=4))
    model.to(torch.bfloat16).save_pretrained(directory, max_shard_size="20KB")


def assert_trains_like_ddp(ddp: Fit, fsdp: Fit, tolerance: float = TOLERANCE) -> None:
    """Every rank's parameters, gathered whole, and the gathered model equal ``"ddp"``'s; they moved in training."""
    for rank in range(WORLD):
        expected, actual = ddp.held(rank)["parameters"], fsdp.held(rank)["parameters"]
        key, difference = _difference(actual, expected)
        assert difference <= tolerance, f"rank {rank}, {key}: max abs difference {difference:.2e}"
    key, difference = _difference(fsdp.result, ddp.result)
    assert difference <= tolerance, f"gathered {key}: max abs difference {difference:.2e}"


# ------------------------------------------------------------------ settings, without processes


def test_data_parallel_is_ddp_by_default_and_an_unknown_value_is_refused() -> None:
    assert BuildConfig().data_parallel == "ddp"
    assert GPipeStrategy(data_parallel="fsdp").config.data_parallel == "fsdp"
    with pytest.raises(ValueError, match=r"data_parallel='zero3' is not a data-parallel mode; use 'ddp' or 'fsdp'"):
        BuildConfig(data_parallel="zero3")  # type: ignore[arg-type]


def test_compiled_layers_are_refused_with_fsdp() -> None:
    with pytest.raises(ValueError, match=r"compile=True with data_parallel='fsdp' is not supported yet.*compile=False"):
        BuildConfig(data_parallel="fsdp", compile=True)


def test_fsdp_with_a_single_replica_warns_and_runs_as_ddp() -> None:
    with pytest.warns(UserWarning, match=r"data_parallel='fsdp' with a single replica.*nothing to shard"):
        resolved = BuildConfig(pipe_size=2, data_parallel="fsdp").resolve(world_size=2, rank=0)
    assert resolved.data_parallel == "ddp"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert BuildConfig(pipe_size=2, data_parallel="fsdp").resolve(world_size=4, rank=0).data_parallel == "fsdp"


def test_lightning_precisions_map_to_fsdp_mixed_precision() -> None:
    bf16 = mixed_precision("bf16-mixed")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    fp16 = mixed_precision("16-mixed")
    assert (fp16.param_dtype, fp16.reduce_dtype) == (torch.float16, torch.float32)
    for precision in ("32-true", "bf16-true", "64-true"):
        assert mixed_precision(precision).param_dtype is None  # the module itself is in that precision
    with pytest.raises(ValueError, match=r"precision='transformer-engine' is not supported with data_parallel='fsdp'"):
        mixed_precision("transformer-engine")


def test_a_tie_of_two_layers_on_one_process_stays_whole_and_one_across_processes_is_sharded() -> None:
    embedding_and_head = Tie(("0.weight", "7.weight"), (0, 3), is_parameter=True)
    table = Tie(("1.table.scale", "2.table.scale"), (0, 0), is_parameter=False)
    across = {0: 0, 1: 1, 2: 1, 3: 0}  # ZB-V with K = 2: process 0 holds stages 0 and 3
    assert ties_kept_whole([embedding_and_head, table], across.__getitem__) == [embedding_and_head]
    assert ties_kept_whole([embedding_and_head], {0: 0, 3: 1}.__getitem__) == []  # gpipe: two processes
    within_a_layer = Tie(("0.a.weight", "0.b.weight"), (0, 0), is_parameter=True)
    assert ties_kept_whole([within_a_layer], {0: 0}.__getitem__) == []  # one unit can hold it


def test_a_layer_skeleton_is_on_meta_and_keeps_its_shared_tensors_shared() -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
            self.b.weight = self.a.weight
            self.register_buffer("scale", torch.ones(3))

    layer = Shared()
    skeleton = _skeleton(layer)
    assert all(t.is_meta for t in [*skeleton.parameters(), *skeleton.buffers()])
    assert skeleton.b.weight is skeleton.a.weight
    assert not layer.a.weight.is_meta  # the layer itself is untouched
    assert layer.b.weight is layer.a.weight


def test_trainable_parameters_outside_the_sequence_are_refused_under_fsdp() -> None:
    class Outside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
            self.scale = nn.Parameter(torch.ones(()))

    settings = BuildConfig(pipe_size=2, balance=[1, 1], data_parallel="fsdp").resolve(world_size=4, rank=0)
    transport = ThreadTransport.create(2)[1]
    with pytest.raises(ValueError, match=r"trainable parameters outside the pipelined sequence 'layers': scale"):
        assemble_stage(Outside(), settings, torch.device("cpu"), transport)


@pytest.mark.usefixtures("loopback_process_group")
def test_a_model_with_layers_sharded_already_is_refused() -> None:
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    module = nn.Module()
    module.layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    fully_shard(module.layers[1], mesh=mesh)  # on the other stage: the check must look at the whole sequence
    partition = partition_module(module, "layers", module.layers, [1, 1], stage=0)
    with pytest.raises(ValueError, match=r"Module already holds layers sharded with fully_shard.*unsharded"):
        shard_stage(partition, ProcessLayout(4, 2, 1), mesh, torch.device("cpu"), seed=0, deferred_batch_norm=False)


@pytest.mark.usefixtures("loopback_process_group")
def test_a_sharded_stage_is_whole_again_in_the_sequence_put_back() -> None:
    # The sequence holds a meta copy of each sharded layer: put back as it was, the stage's layers had no memory.
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    torch.manual_seed(0)
    module = nn.Module()
    module.layers = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    module.layers[1].running_mean.add_(1.0)
    expected = {key: value.clone() for key, value in module.layers.state_dict().items()}
    layout = ProcessLayout(2, 2, 0)  # global rank 0: the last stage of a pipeline of two, its only replica
    partition = partition_module(module, "layers", module.layers, [1, 2], stage=layout.stage)
    shard_stage(partition, layout, mesh, torch.device("cpu"), seed=0, deferred_batch_norm=True)
    assert all(is_sharded(p) for p in partition.stand_in.parameters())
    assert all(t.is_meta for t in partition.original[2].parameters())
    unshard_stage(partition)
    partition.put_back(allocate=False)
    partition.finish({})
    layers = module.layers
    assert type(layers) is nn.Sequential
    assert [type(layer) for layer in layers] == [nn.Linear, nn.BatchNorm1d, nn.Linear]  # no FSDP, no deferred BN
    assert layers[0].weight.is_meta  # the other stage's layer
    for key, value in layers.state_dict().items():
        if not key.startswith("0."):
            assert not is_sharded(value)
            assert torch.equal(value, expected[key]), key


@pytest.mark.usefixtures("loopback_process_group")
def test_a_sharded_cell_reduces_the_steps_whole_gradients_once_at_its_end_and_drops_a_failed_steps() -> None:
    # One rank: the reduction is an identity, so the shards' gradients must be the plain layers' own.
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    cell = copy.deepcopy(plain)
    for layer in (cell[0], cell[2]):
        fully_shard(layer, mesh=mesh)
    sharded = ShardedCell.of(cell)
    assert sharded is not None
    assert ShardedCell.of(plain) is None
    sharded.begin_step()
    for part in torch.randn(6, 3).split(2):  # three micro-batches, each its own backward
        cell(part).sum().backward()
        plain(part).sum().backward()
        assert not any(is_sharded(p) for p in cell.parameters())  # gathered for the whole step
    sharded.end_step(reduce=True)
    assert all(is_sharded(p) for p in cell.parameters())
    expected = [p.grad.clone() for p in plain.parameters()]
    assert all(torch.equal(whole(p.grad), g) for p, g in zip(cell.parameters(), expected, strict=True))
    sharded.begin_step()
    cell(torch.randn(2, 3)).sum().backward()  # a failed step's backward: dropped, not added to the next
    sharded.abort()
    sharded.begin_step()
    sharded.end_step(reduce=True)
    assert all(torch.equal(whole(p.grad), g) for p, g in zip(cell.parameters(), expected, strict=True))


# ------------------------------------------------------------------ two pipelines of two stages, 4 gloo ranks


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_sharded_stages_train_like_ddp_under_every_schedule(jobs: SharedJobs, schedule: str) -> None:
    fits = jobs("schedules")
    ddp, fsdp = fits[f"{schedule} ddp"], fits[f"{schedule} fsdp"]
    assert_trains_like_ddp(ddp, fsdp)
    for rank in range(WORLD):
        assert fsdp.held(rank)["sharded"]
        assert not ddp.held(rank)["sharded"]


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_ranks_hold_half_the_parameters_gradients_and_optimizer_state(jobs: SharedJobs, schedule: str) -> None:
    fits = jobs("schedules")
    totals = {}
    for data_parallel in ("ddp", "fsdp"):
        held = [fits[f"{schedule} {data_parallel}"].held(rank)["held"] for rank in range(WORLD)]
        totals[data_parallel] = {kind: sum(h[kind] for h in held) for kind in ("parameters", "gradients", "optimizer")}
    ratios = {kind: totals["fsdp"][kind] / totals["ddp"][kind] for kind in totals["ddp"]}
    assert all(0.5 <= ratio <= 0.6 for ratio in ratios.values()), ratios
    both = (totals["fsdp"]["parameters"] + totals["fsdp"]["optimizer"]) / (
        totals["ddp"]["parameters"] + totals["ddp"]["optimizer"]
    )
    assert both <= 0.6


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
def test_the_mesh_is_pipe_by_data_and_the_module_sees_it(jobs: SharedJobs) -> None:
    fsdp = jobs("schedules")["gpipe fsdp"]
    for rank in range(WORLD):
        pipe, data = fsdp.held(rank)["mesh"]
        assert pipe == [rank - rank % 2, rank - rank % 2 + 1]  # consecutive ranks form a pipeline
        assert data == [rank % 2, rank % 2 + 2]  # the same offset in each pipeline: the stage's replicas
        assert fsdp.held(rank)["module_mesh"]
    assert jobs("schedules")["gpipe ddp"].held(0)["mesh"] is None


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
def test_a_single_pipeline_under_fsdp_warns_and_trains_as_ddp(jobs: SharedJobs) -> None:
    fits = jobs("schedules")
    assert "nothing to shard over" in fits["alone fsdp"].stdout
    assert_trains_like_ddp(fits["alone ddp"], fits["alone fsdp"], tolerance=0.0)
    assert not any(fits["alone fsdp"].held(rank)["sharded"] for rank in range(WORLD))


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("flow", list(FLOWS))
def test_sharded_stages_train_like_ddp_with_every_flow(jobs: SharedJobs, flow: str) -> None:
    fits = jobs("flows")
    assert_trains_like_ddp(fits[f"{flow} ddp"], fits[f"{flow} fsdp"])


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
def test_validation_logged_values_and_predictions_are_those_of_ddp(jobs: SharedJobs) -> None:
    fits = jobs("flows")
    ddp, fsdp = fits["validation, logging ddp"], fits["validation, logging fsdp"]
    assert {"train_loss", "val_loss"} <= ddp.metrics.keys() == fsdp.metrics.keys()
    key, difference = _difference(fsdp.metrics, ddp.metrics)
    assert difference <= TOLERANCE, key
    expected = torch.load(ddp.folder / f"predictions-{ddp.index}.pt", weights_only=True)
    predicted = torch.load(fsdp.folder / f"predictions-{fsdp.index}.pt", weights_only=True)
    assert predicted.shape == expected.shape == (64, 3)
    assert (predicted - expected).abs().max().item() <= TOLERANCE


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
def test_mixed_precision_gathers_the_parameters_in_half_precision(jobs: SharedJobs) -> None:
    fits = jobs("flows")
    for rank in (0, 2):  # the last stages, whose steps run on after the sequence's call
        assert fits["bf16-mixed fsdp"].held(rank)["gathered_dtypes"] == ["torch.bfloat16"]
        assert fits["bf16-mixed ddp"].held(rank)["gathered_dtypes"] == ["torch.float32"]  # autocast casts per op
        assert fits["bf16-true fsdp"].held(rank)["gathered_dtypes"] == ["torch.bfloat16"]
        assert fits["16-mixed fsdp"].held(rank)["gathered_dtypes"] == ["torch.float16"]


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
def test_tied_copies_are_sharded_across_processes_and_kept_whole_within_one(jobs: SharedJobs) -> None:
    fits = jobs("flows")
    # gpipe: the embedding (layer 0, stage 0 on ranks 1 and 3) and the head (layer 7, stage 1 on ranks 0 and 2).
    assert "layers.0.weight" in fits["tied fsdp"].held(1)["sharded"]
    assert "layers.7.weight" in fits["tied fsdp"].held(0)["sharded"]
    # ZB-V: ranks 0 and 2 hold stages 0 and 3, so both names of the tie: one tensor there, kept whole; the head's
    # bias is sharded.
    zbv = fits["tied, zbv fsdp"].held(0)["sharded"]
    assert "layers.0.weight" not in zbv
    assert "layers.7.weight" not in zbv
    assert "layers.7.bias" in zbv
    reassembled = fits["tied, interleaved, meta fsdp"].result
    assert torch.equal(reassembled["layers.0.weight"], reassembled["layers.7.weight"])


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["hf_causal_lm", "transformer"])
def test_zoo_models_train_like_ddp_with_sharded_stages(jobs: SharedJobs, name: str) -> None:
    fits = jobs("zoo")
    assert_trains_like_ddp(fits[f"{name} ddp"], fits[f"{name} fsdp"])
    sharded = {n for rank in range(WORLD) for n in fits[f"{name} fsdp"].held(rank)["sharded"]}
    assert len(sharded) > 10
    if name == "hf_causal_lm":  # then greedy decoding in predict steps, each token a relayed call of the stages
        ddp, fsdp = (fits[f"{name} {dp}"] for dp in ("ddp", "fsdp"))
        decoded = [torch.load(f.folder / f"predictions-{f.index}.pt", weights_only=True) for f in (ddp, fsdp)]
        assert decoded[0].shape == (4, 12)
        assert torch.equal(decoded[0], decoded[1])


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
def test_a_pretrained_llama_trains_sharded_from_exactly_its_weights_each_rank_reading_its_stage(
    jobs: SharedJobs,
) -> None:
    import zoo

    fits = jobs("zoo")
    fsdp = fits[f"{LLAMA} fsdp"]
    # The plain model: zoo.load_pretrained read whole, outside any pipeline (bfloat16 to float32, as the stages read).
    plain = zoo.load_pretrained(fsdp.folder / f"{LLAMA}-source", lr=1e-2)
    plain.load_weights()
    expected = {name: p.detach() for name, p in plain.named_parameters()}
    started: set[str] = set()
    for rank in range(WORLD):
        held = fsdp.held(rank)
        for name, value in held["start"].items():  # gathered whole from the shards when training starts
            assert torch.equal(value, expected[name]), (rank, name)
        started |= held["start"].keys()
        assert held["read"], f"rank {rank} read nothing"
        assert sorted(held["read"]) == sorted(held["stage_keys"]), f"rank {rank} read other stages' tensors"
        assert held["sharded"]
    assert started == expected.keys()
    assert_trains_like_ddp(fits[f"{LLAMA} ddp"], fsdp)


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
def test_a_meta_built_stage_allocates_its_share_and_one_layer_not_the_stage(jobs: SharedJobs) -> None:
    fits = jobs("setup")
    stage_bytes = 4 * sum(p.numel() for p in wide().parameters())  # every layer on this stage: pipe_size=1
    layer_bytes = 4 * max(sum(p.numel() for p in layer.parameters()) for layer in wide())
    for rank in range(WORLD):
        ddp, fsdp = fits["wide ddp"].held(rank)["setup_growth"], fits["wide fsdp"].held(rank)["setup_growth"]
        assert ddp >= 0.9 * stage_bytes  # the measurement sees the stage's allocation
        assert fsdp <= stage_bytes / WORLD + 3 * layer_bytes, (rank, fsdp / 2**20, ddp / 2**20)
    assert_trains_like_ddp(fits["wide ddp"], fits["wide fsdp"])
