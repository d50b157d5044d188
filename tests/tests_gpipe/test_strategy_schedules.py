"""GPipeStrategy's ``schedule="1f1b"`` trains exactly as ``"gpipe"``, in every Lightning flow, with real processes.

Each job runs every configuration under both schedules in one set of processes, so the comparison costs one launch.
1F1B runs the backward passes that come before a stage's last forward inside Lightning's ``training_step`` and holds
their gradients past ``zero_grad``; these fits check that the parameters, the logged loss and the checkpoint come out
as under fill-drain, which runs every backward in Lightning's ``backward``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.runif import RunIf
from test_strategy_equivalence import run_fits

TOLERANCE = 1e-6  # the schedules differ only in the order micro-batch gradients are summed


def both_schedules(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every run under "gpipe" then "1f1b", in pairs; a run's ``save`` path gets the schedule's name."""
    paired = []
    for run in runs:
        for schedule in ("gpipe", "1f1b"):
            named = {**run, "options": {**run.get("options", {}), "schedule": schedule}}
            for key in ("save", "resume"):
                if key in run:
                    named[key] = f"{run[key]}.{schedule}"
            paired.append(named)
    return paired


def assert_close(actual: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for key, value in expected.items():
        if isinstance(value, dict):
            assert_close(actual[key], value, f"{what}[{key!r}]")
        elif isinstance(value, torch.Tensor):
            difference = (actual[key].double() - value.double()).abs().max().item() if value.numel() else 0.0
            assert difference <= TOLERANCE, f"{what}[{key!r}]: max abs difference {difference:.2e}"
        elif isinstance(value, list):
            assert len(actual[key]) == len(value), what
            for index, (a, b) in enumerate(zip(actual[key], value, strict=True)):
                assert_close({index: a}, {index: b}, f"{what}[{key!r}]")
        else:
            assert actual[key] == value, f"{what}[{key!r}]"


def check_pairs(tmp_path: Path, world_size: int, runs: list[dict[str, Any]], timeout: float) -> None:
    paired = both_schedules(runs)
    results = run_fits(tmp_path, world_size, paired, timeout=timeout)
    for index, run in enumerate(runs):
        what = f"run {run}"
        gpipe, one_f_one_b = results[2 * index], results[2 * index + 1]
        assert_close(one_f_one_b, gpipe, f"parameters of {what}")
        logged = [torch.load(tmp_path / f"metrics-{2 * index + k}.pt", weights_only=True) for k in (0, 1)]
        assert "train_loss" in logged[0]
        assert_close(logged[1], logged[0], f"logged values of {what}")
        if "save" in run:
            saved = [torch.load(paired[2 * index + k]["save"], weights_only=True) for k in (0, 1)]
            assert_close(saved[1]["state_dict"], saved[0]["state_dict"], f"checkpoint of {what}")
            states = [s["optimizer_states"][0]["state"] for s in saved]
            assert_close(states[1], states[0], f"optimizer state in the checkpoint of {what}")


@RunIf(multiprocess=True)
@pytest.mark.timeout(900)
def test_1f1b_trains_like_gpipe_in_every_flow(tmp_path: Path) -> None:
    # One 4-process job: K=4 with logging synced over the world between the phases, with accumulation and clipping;
    # K=2 as two data-parallel replicas, saving a checkpoint; K=1 as four replicas (every backward but the last runs
    # inside training_step there). The whole K x M matrix is the slow test below.
    ckpt = str(tmp_path / "k2.ckpt")
    runs = [
        {"pipe_size": 4, "chunks": 8, "steps": 2, "sync_dist": True},
        {"pipe_size": 4, "chunks": 5, "steps": 2, "accumulate": 2, "clip": 0.05},
        {"pipe_size": 2, "chunks": 4, "steps": 2, "save": ckpt},
        {"pipe_size": 1, "chunks": 4, "steps": 2},
    ]
    check_pairs(tmp_path, 4, [{**run, "devices": 4} for run in runs], timeout=800)


@RunIf(multiprocess=True)
@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_1f1b_trains_like_gpipe_for_every_stages_and_chunks(tmp_path: Path, stages: int) -> None:
    # One job per K, looping over M; each M also runs a flow (accumulation, clipping, synced logging, a checkpoint
    # saved and resumed), so every flow meets 1F1B with more and fewer micro-batches than stages.
    ckpt = str(tmp_path / "saved.ckpt")
    flows: dict[int, dict[str, Any]] = {
        1: {"save": ckpt},
        4: {"accumulate": 2},
        5: {"clip": 0.05},
        8: {"sync_dist": True},
    }
    runs = [{"pipe_size": stages, "devices": stages, "chunks": m, "steps": 3, **flow} for m, flow in flows.items()]
    runs.append({"pipe_size": stages, "devices": stages, "chunks": 4, "steps": 5, "resume": ckpt})
    check_pairs(tmp_path, stages, runs, timeout=1400)
