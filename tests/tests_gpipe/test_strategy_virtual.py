"""Several stages per process under Lightning: ``schedule="interleaved"`` (``virtual_stages=2``) and ``"zbv"`` train
exactly like plain Lightning, with real processes over gloo.

K = 2 processes hold 4 stages: interleaved puts stages 0, 2 on one process and 1, 3 on the other, ZB-V puts 0, 3 and
1, 2 (two of its links stay inside a process). One job of two processes runs every two-process fit (the plain
model's, a tied language model's, and one whose boundaries vary in shape per micro-batch and carry an ``Unbatched``
value); one job of four processes runs K = 4 and two replicas of K = 2. The plain references run in the test's process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import tied_job, virtual_job
from helpers.jobs import run_scripts
from helpers.lightning_job import SequentialModule
from helpers.lightning_job import fit as fit_plain_model
from helpers.runif import RunIf
from test_strategy_equivalence import assert_same_parameters, plain

INTERLEAVED = {"schedule": "interleaved", "virtual_stages": 2}
ZBV = {"schedule": "zbv"}
K2 = {"pipe_size": 2, "devices": 2}
FLOWS = {"steps": 4, "accumulate": 2, "clip": 0.05, "limit_val_batches": 2, "val_check_interval": 2}
BN = {"steps": 1, "chunks": 4, "batch_norm": True, "deferred_batch_norm": True, "balance": [2, 1, 1, 2]}
ONE_EPOCH = {"chunks": 4, "epochs": 1, "steps": -1}  # 4 steps
TWO_EPOCHS = {"chunks": 4, "epochs": 2, "steps": -1}
REPLICAS = {"steps": 3, "chunks": 4, "distributed_sampler": True, "shuffle": True}
PLAN_INTERLEAVED = {"memory_per_device": "1MiB", "pipe_sizes": [2], "schedules": ["interleaved"], "virtual_stages": [2]}
BN_STATS = ["layers.3.running_mean", "layers.3.running_var", "layers.3.num_batches_tracked"]


def _with(schedule: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    return {**run, "options": {**run.get("options", {}), **schedule}}


def two_process_fits(root: Path) -> dict[str, dict[str, Any]]:
    """job -> name -> run, for the two-process job; every checkpoint mode appears under each schedule."""
    checkpoint = str(root / "interleaved.ckpt")
    return {
        "helpers.lightning_job": {
            # One epoch of 4 steps, saved at its end (a checkpoint that resumes at the next epoch).
            "interleaved-m4-save": _with(
                INTERLEAVED, {**K2, "chunks": 4, "epochs": 1, "steps": -1, "save": checkpoint}
            ),
            "interleaved-m2-never": _with(INTERLEAVED, {**K2, "chunks": 2, "steps": 4, "checkpoint": "never"}),
            "interleaved-flows": _with(INTERLEAVED, {**K2, **FLOWS, "chunks": 6, "checkpoint": "always"}),
            "interleaved-selective": _with(INTERLEAVED, {**K2, "chunks": 4, "steps": 4, "checkpoint": "selective"}),
            "interleaved-bn": _with(INTERLEAVED, {**K2, **BN}),
            "zbv-m4-never": _with(ZBV, {**K2, "chunks": 4, "steps": 4, "checkpoint": "never"}),
            "zbv-flows": _with(ZBV, {**K2, **FLOWS, "chunks": 5, "checkpoint": "always"}),
            "zbv-m8-selective": _with(ZBV, {**K2, "chunks": 8, "steps": 4, "checkpoint": "selective"}),
            "zbv-bn": _with(ZBV, {**K2, **BN}),
            "ddp": {**REPLICAS, "strategy": "ddp", "devices": 2},
            # plan="auto" restricted to interleaved: every rank follows rank 0's K * v stages.
            "planned-interleaved": {"devices": 2, "steps": 4, "plan": PLAN_INTERLEAVED},
            # The interleaved checkpoint resumed by ZB-V: each process loads its stages' weights and optimizer state.
            "zbv-resumed": _with(ZBV, {**K2, **TWO_EPOCHS, "resume": checkpoint}),
        },
        # The embedding (layer 0) and the head (layer 7) share one weight: under ZB-V both sit on process 0, as stages
        # 0 and 3; interleaved puts stage 3 on the other process. Clipping counts the tied weight once.
        "helpers.tied_job": {
            "tied-zbv": _with(ZBV, {**K2, "steps": 3, "chunks": 4, "clip": 0.3, "balance": [2, 2, 2, 2]}),
            "tied-zbv-meta": _with(ZBV, {**K2, "steps": 3, "chunks": 4, "balance": [2, 2, 2, 2], "meta": True}),
            "tied-interleaved": _with(INTERLEAVED, {**K2, "steps": 3, "chunks": 4, "clip": 0.3, "balance": [2] * 4}),
        },
        "helpers.virtual_job": {
            "ragged-zbv": _with(ZBV, {**K2, "steps": 2, "chunks": 4}),
            "ragged-interleaved": _with(INTERLEAVED, {**K2, "steps": 2, "chunks": 4}),
        },
    }


K4 = {"pipe_size": 4, "devices": 4}
FOUR_PROCESS_FITS = {  # K = 4 (8 stages of one layer each), and 2 processes x 2 replicas
    "helpers.lightning_job": {
        "zbv-k4": _with(ZBV, {**K4, "chunks": 5, "steps": 4, "accumulate": 2, "clip": 0.05}),
        "interleaved-replicas": _with(INTERLEAVED, {**REPLICAS, "pipe_size": 2, "devices": 4}),
        "zbv-replicas": _with(ZBV, {**REPLICAS, "pipe_size": 2, "devices": 4}),
    },
    # Interleaved over 4 processes puts the MLP's two Tanh layers (1 and 5) on one process, which would have no
    # parameters to optimize (refused with the fix): the ragged model has a trainable layer on every process.
    "helpers.virtual_job": {"ragged-interleaved-k4": _with(INTERLEAVED, {**K4, "chunks": 8, "steps": 2})},
}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """The two-process job, launched once for the tests that read it: (fits by name, the jobs' runs, its folder)."""
    root = tmp_path_factory.mktemp("virtual")
    jobs = two_process_fits(root)
    return launch(root / "two", 2, jobs), jobs, root / "two"


def launch(folder: Path, world_size: int, jobs: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Run each job's fits in one set of ``world_size`` processes; every fit's final state dict, by name."""
    scripts = []
    for job, runs in jobs.items():
        (folder / job).mkdir(parents=True)
        config = folder / job / "config.json"
        config.write_text(json.dumps({"runs": list(runs.values())}))
        scripts.append([job, str(config)])
    results = run_scripts(scripts, world_size, timeout=1000)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank} failed:\n{result.stdout[-4000:]}"
    return {
        name: torch.load(folder / job / f"result-{index}.pt", weights_only=True)
        for job, runs in jobs.items()
        for index, name in enumerate(runs)
    }


@RunIf(multiprocess=True)
@pytest.mark.timeout(1200)
@pytest.mark.usefixtures("loopback_process_group")  # the single-stage resume runs in this process
def test_two_processes_of_two_stages_train_like_plain_lightning(
    two_processes: tuple[dict[str, Any], dict[str, Any], Path], tmp_path: Path
) -> None:
    fits, jobs, _ = two_processes
    steps4 = plain(tmp_path, steps=4)
    with_flows = fit_plain_model({**FLOWS, "chunks": 4, "strategy": "auto", "devices": 1}, tmp_path / "flows")
    flows = with_flows.state_dict()
    for name in (
        "interleaved-m4-save",
        "interleaved-m2-never",
        "planned-interleaved",
        "interleaved-selective",
        "zbv-m4-never",
        "zbv-m8-selective",
    ):
        assert_same_parameters(fits[name], steps4)
    assert_same_parameters(fits["interleaved-flows"], flows)
    assert_same_parameters(fits["zbv-flows"], flows)
    planned = list(jobs["helpers.lightning_job"]).index("planned-interleaved")
    settings = json.loads((two_processes[2] / "helpers.lightning_job" / f"settings-{planned}.json").read_text())
    assert (settings["schedule"], len(settings["balance"])) == ("interleaved", 4)
    # What rank 0 logged (it holds the last stage; under ZB-V also stage 0, whose input a first run of the step up to
    # the sequence gives, its logs dropped): the plain step's loss and validation loss.
    expected = {key: with_flows.trainer.callback_metrics[key] for key in ("train_loss", "val_loss")}
    names = list(jobs["helpers.lightning_job"])
    for name in ("interleaved-flows", "zbv-flows"):
        folder = two_processes[2] / "helpers.lightning_job"
        logged = torch.load(folder / f"metrics-{names.index(name)}.pt", weights_only=True)
        assert_same_parameters({key: logged[key] for key in expected}, expected)
    # Deferred BatchNorm (layer 3: stage 2, on the other process than stage 0 under ZB-V, on stage 0's under
    # interleaved): the running statistics of the whole batch, counted once however often the layer is replayed.
    batch_norm = plain(tmp_path, steps=1, batch_norm=True)
    for name in ("interleaved-bn", "zbv-bn"):
        assert_same_parameters({k: fits[name][k] for k in BN_STATS}, {k: batch_norm[k] for k in BN_STATS})

    tied = tied_job.fit({"steps": 3, "chunks": 4, "clip": 0.3, "strategy": "auto", "devices": 1}, tmp_path / "tied")
    assert_same_parameters(fits["tied-zbv"], tied.state_dict())
    assert_same_parameters(fits["tied-interleaved"], tied.state_dict())
    meta = tied_job.fit({"steps": 3, "chunks": 4, "pipe_size": 1, "devices": 1, "meta": True}, tmp_path / "meta")
    assert_same_parameters(fits["tied-zbv-meta"], meta.state_dict())  # meta-built: the same start on any layout
    for name in ("tied-zbv", "tied-zbv-meta", "tied-interleaved"):
        assert fits[name]["layers.0.weight"].equal(fits[name]["layers.7.weight"])

    ragged, predicted = virtual_job.fit({"steps": 2, "strategy": "auto", "devices": 1}, tmp_path / "ragged")
    names = list(jobs["helpers.virtual_job"])
    for name in names:
        assert_same_parameters(fits[name], ragged.state_dict())
        # trainer.predict after the fit, gathered on rank 0 (ZB-V: its call stage is the last, stage 0 fed).
        folder = two_processes[2] / "helpers.virtual_job"
        predictions = torch.load(folder / f"predictions-{names.index(name)}.pt", weights_only=True)
        assert_same_parameters({"predictions": predictions}, {"predictions": predicted})

    # Checkpoints stay portable: written by two processes of two stages, the plain module loads it strictly, and a
    # single-stage pipeline (and ZB-V, in the job) resumes it to the plain model's second epoch.
    saved = jobs["helpers.lightning_job"]["interleaved-m4-save"]["save"]
    SequentialModule().load_state_dict(torch.load(saved, weights_only=True)["state_dict"], strict=True)
    resumed = fit_plain_model({**TWO_EPOCHS, "pipe_size": 1, "devices": 1, "resume": saved}, tmp_path / "resumed")
    two_epochs = plain(tmp_path, **TWO_EPOCHS)
    assert_same_parameters(resumed.state_dict(), two_epochs)
    assert_same_parameters(fits["zbv-resumed"], two_epochs)


@RunIf(multiprocess=True)
@pytest.mark.timeout(1200)
def test_four_processes_and_replicas_train_like_plain_lightning_and_ddp(
    two_processes: tuple[dict[str, Any], dict[str, Any], Path], tmp_path: Path
) -> None:
    fits = launch(tmp_path / "four", 4, FOUR_PROCESS_FITS)
    ragged = virtual_job.fit({"steps": 2, "strategy": "auto", "devices": 1}, tmp_path / "ragged")[0].state_dict()
    assert_same_parameters(fits["ragged-interleaved-k4"], ragged)
    assert_same_parameters(fits["zbv-k4"], plain(tmp_path, steps=4, accumulate=2, clip=0.05))
    ddp = two_processes[0]["ddp"]  # data parallelism over two processes, in the two-process job
    assert_same_parameters(fits["interleaved-replicas"], ddp)
    assert_same_parameters(fits["zbv-replicas"], ddp)
