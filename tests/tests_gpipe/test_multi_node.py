"""GPipeStrategy across machines: two torchrun "nodes" of two processes each, on this host, over gloo.

One job runs three fits with ``Trainer(devices=2, num_nodes=2)``, shared by the tests below:

- two 2-stage pipelines, one per node, the nodes data-parallel replicas (``pipe_size=2``);
- DDP over the four processes, with the same global batch;
- one 4-stage pipeline spanning both nodes (``pipe_size=4``).

Each equals plain training on the global batch of 32 samples. Lightning's distributed samplers share out one
permutation of the dataset per epoch (seed 0 + epoch): 4 DDP ranks of 8 samples, 2 pipelines of 16 and one pipeline of
32 each train on its first 32 samples in the first step.

The job runs twice (:func:`tools.launch.run_job` with ``nodes=2``): with the variables torchrun's agent gives each
rank (``elastic=True``), which Lightning reads through its ``TorchElasticEnvironment`` (it takes ``RANK`` as given),
and with ``LOCAL_RANK`` and ``NODE_RANK`` only, which it reads through its ``LightningEnvironment`` (the strategy
numbers the ranks node-major itself).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers.lightning_job import SequentialModule, dataset, trainer_for
from helpers.runif import RunIf
from torch.utils.data import DataLoader, DistributedSampler

from tools.launch import run_job

TOLERANCE = 1e-5
NODES, DEVICES = 2, 2
GLOBAL_BATCH, STEPS = 32, 3
_COMMON = {"devices": DEVICES, "num_nodes": NODES, "steps": STEPS, "distributed_sampler": True}
FITS: dict[str, dict[str, Any]] = {
    "pipelines-per-node": {**_COMMON, "pipe_size": 2, "chunks": 4, "batch": GLOBAL_BATCH // 2},
    "ddp": {**_COMMON, "strategy": "ddp", "batch": GLOBAL_BATCH // (NODES * DEVICES)},
    "pipeline-across-nodes": {**_COMMON, "pipe_size": 4, "chunks": 4, "batch": GLOBAL_BATCH},
}


ENVIRONMENTS = {True: "TorchElasticEnvironment", False: "LightningEnvironment"}  # elastic -> what Lightning picks


class TwoNodeJob:
    """The job's results: ``models[name]`` (rank 0's state dict), ``seen[name][rank]`` (what each rank saw)."""

    def __init__(self, folder: Path, elastic: bool) -> None:
        self.environment = ENVIRONMENTS[elastic]
        config = folder / "config.json"
        config.write_text(json.dumps({"runs": list(FITS.values())}))
        world_size = NODES * DEVICES
        results = run_job(
            "helpers.jobs",
            ["helpers.multi_node_job", str(config)],
            world_size,
            timeout=500,
            nodes=NODES,
            elastic=elastic,
        )
        for rank, result in enumerate(results):
            assert result.returncode == 0, f"rank {rank} failed:\n{result.stdout[-4000:]}"
        self.models = {
            name: torch.load(folder / f"result-{index}.pt", weights_only=True) for index, name in enumerate(FITS)
        }
        self.seen = {
            name: [json.loads((folder / f"seen-{index}-rank{rank}.json").read_text()) for rank in range(world_size)]
            for index, name in enumerate(FITS)
        }


@pytest.fixture(scope="module", params=[True, False], ids=["torchrun", "node-rank"])
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TwoNodeJob:
    return TwoNodeJob(tmp_path_factory.mktemp("two-nodes"), elastic=request.param)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Plain training on one process, the global batch at once, drawn in the distributed samplers' order."""
    # Lightning's distributed sampler shuffles a training set (seed 0 + epoch) whatever the loader says; on one
    # replica it draws the permutation whose first 32 samples the 2 or 4 replicas of a job share out.
    L.seed_everything(0, verbose=False)
    module = SequentialModule()
    trainer = trainer_for({"strategy": "auto", "devices": 1, "steps": STEPS}, tmp_path_factory.mktemp("plain"))
    sampler: DistributedSampler[Any] = DistributedSampler(dataset(), num_replicas=1, rank=0, shuffle=True, seed=0)
    trainer.fit(module, DataLoader(dataset(), batch_size=GLOBAL_BATCH, sampler=sampler))
    return module.state_dict()


def assert_same_parameters(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        difference = (actual[key].double() - value.double()).abs().max().item()
        assert difference <= TOLERANCE, f"{key}: max abs difference {difference:.2e}"


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
def test_lightning_sees_two_nodes(job: TwoNodeJob) -> None:
    # torchrun's TORCHELASTIC_RUN_ID makes Lightning take TorchElasticEnvironment (first in its detection order), which
    # reads the node from GROUP_RANK and checks devices x num_nodes against WORLD_SIZE; without it, LOCAL_RANK makes
    # it take LightningEnvironment, which reads NODE_RANK.
    for seen in job.seen.values():
        assert [(s["global_rank"], s["node_rank"], s["local_rank"]) for s in seen] == [
            (0, 0, 0),
            (1, 0, 1),
            (2, 1, 0),
            (3, 1, 1),
        ]
        assert {(s["environment"], s["num_nodes"], s["world_size"]) for s in seen} == {
            (job.environment, NODES, NODES * DEVICES)
        }


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
def test_two_stage_pipelines_stay_inside_a_node_and_train_like_ddp_and_plain(
    job: TwoNodeJob, plain: dict[str, torch.Tensor]
) -> None:
    seen = job.seen["pipelines-per-node"]
    assert [(s["node_rank"], s["replica"], s["stage"]) for s in seen] == [(0, 0, 1), (0, 0, 0), (1, 1, 1), (1, 1, 0)]
    assert_same_parameters(job.models["pipelines-per-node"], job.models["ddp"])
    assert_same_parameters(job.models["pipelines-per-node"], plain)


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
def test_a_four_stage_pipeline_spans_both_nodes_and_trains_like_plain(
    job: TwoNodeJob, plain: dict[str, torch.Tensor]
) -> None:
    seen = job.seen["pipeline-across-nodes"]
    # Stages 3 and 2 on node 0, stages 1 and 0 on node 1: the boundary between stages 1 and 2 crosses the network.
    assert [(s["node_rank"], s["replica"], s["stage"]) for s in seen] == [(0, 0, 3), (0, 0, 2), (1, 0, 1), (1, 0, 0)]
    assert_same_parameters(job.models["pipeline-across-nodes"], plain)
