"""The zoo throughput benchmark: its plan, statistics, docs block and training steps, and a smoke run of the module."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch
from helpers.runif import RunIf

from benchmarks.engine_speed.results import Measurement, Results, headline
from benchmarks.engine_speed.worker import JobResult
from benchmarks.zoo_throughput.models import WORKLOADS, balance
from benchmarks.zoo_throughput.plan import FULL, QUICK, TINY, TINY_CHUNKS, ZooJob
from benchmarks.zoo_throughput.report import goal_lines, table_rows
from benchmarks.zoo_throughput.steps import CONFIGS, build_step
from tools.launch import run_module

REPO = pathlib.Path(__file__).resolve().parents[2]
BALANCES = {"transformer": (5, 5), "amoebanet": (8, 5), "tiny": (5, 5)}


def _measurement(
    workload: str, config: str, chunks: int, seconds: float, round_index: int = 0, *, clean: bool = True
) -> Measurement:
    result = JobResult([seconds] * 3, 1.0, 0.0 if clean else 1.0, 1.0, 10.0, [seconds])
    return Measurement(round_index, ZooJob(workload, config, chunks, 0, 3), 0, result, clean)


def test_round_puts_each_m_next_to_its_accumulation_reference() -> None:
    jobs = QUICK.round_jobs(BALANCES)
    transformer = [(j.config, j.chunks) for j in jobs if j.workload == "transformer"]
    assert transformer == [
        ("unpipelined", 1),
        ("two_threads", 1),
        ("ours_k1", 1),
        ("ours", 1),
        ("torch_pipelining", 1),
        ("torchgpipe", 1),
        ("accumulation", 8),
        ("ours_k1", 8),
        ("ours", 8),
        ("torch_pipelining", 8),
        ("torchgpipe", 8),
    ]
    tiny = [j for j in jobs if j.workload == TINY]
    assert sorted(j.config for j in tiny) == sorted(CONFIGS)
    assert {j.chunks for j in tiny if j.config not in ("unpipelined", "two_threads")} == {TINY_CHUNKS}
    assert all(j.balance == BALANCES[j.workload] for j in jobs)


def test_full_plan_covers_table_2_micro_batch_counts() -> None:
    assert FULL.chunks == (1, 4, 8, 32)
    assert {j.workload for j in FULL.round_jobs(BALANCES)} == {"transformer", "amoebanet", TINY}


@pytest.mark.parametrize(
    ("config", "processes", "threads"),
    [
        ("unpipelined", 1, 1),
        ("two_threads", 1, 2),
        ("ours_k1", 1, 1),
        ("ours", 2, 1),
        ("torch_pipelining", 2, 1),
        ("torchgpipe", 1, 1),
    ],
)
def test_processes_and_threads_of_each_configuration(config: str, processes: int, threads: int) -> None:
    job = ZooJob("tiny", config, 4, 0, 1, balance=(5, 5))
    assert (job.world_size, job.threads) == (processes, threads)


def test_table_normalizes_to_unpipelined_and_bounds_by_the_bubble() -> None:
    # Step times (s) of two rounds; the second round runs 20% slower throughout, which per-round ratios cancel.
    times = {("unpipelined", 1): 1.0, ("accumulation", 8): 1.25, ("ours", 8): 0.6, ("torch_pipelining", 8): 0.75}
    measurements = [
        _measurement("transformer", config, m, seconds * slowdown, round_index)
        for round_index, slowdown in enumerate((1.0, 1.2))
        for (config, m), seconds in times.items()
    ]
    results = Results(measurements)
    rows = table_rows(results, "transformer", [8])
    assert rows["unpipelined"][0].value == pytest.approx(1.0)
    assert rows["ours"][0].value == pytest.approx(1 / 0.6)
    assert rows["accumulation"][0].value == pytest.approx(0.8)
    assert rows["bubble_bound"][0].value == pytest.approx(0.8 * 2 * 8 / 9)
    assert rows["efficiency"][0].value == pytest.approx((1 / 0.6) / (0.8 * 16 / 9))
    assert rows["torchgpipe"][0].show() == "n/a"
    goals = headline(results, 8, 16, workloads=("transformer", TINY))
    assert goals.ratio_vs_torch.value == pytest.approx(0.75 / 0.6)
    assert goal_lines(goals) == [
        "ratio_vs_torch_pipelining=1.25",
        "small_stage_ratio_vs_torch_pipelining=n/a",
        "efficiency_vs_bubble_bound=1.17",
    ]


def test_loaded_windows_are_used_only_when_nothing_clean_exists_and_are_flagged() -> None:
    measurements = [
        _measurement("tiny", "unpipelined", 1, 1.0),
        _measurement("tiny", "ours", 16, 0.5, clean=False),
        _measurement("tiny", "torch_pipelining", 16, 1.0),
    ]
    goals = headline(Results(measurements), 8, 16, workloads=("transformer", "tiny"))
    assert goal_lines(goals)[1] == "small_stage_ratio_vs_torch_pipelining=2.00*"


def test_balance_splits_every_layer_into_two_stages() -> None:
    split = balance("tiny")
    assert len(split) == 2
    assert sum(split) == len(WORKLOADS["tiny"].build().layers)


def _trained(config: str, chunks: int) -> list[torch.Tensor]:
    # Without dropout, so that every configuration computes the same update.
    workload = dataclasses.replace(WORKLOADS["tiny"], options={**WORKLOADS["tiny"].options, "dropout": 0.0})
    model = workload.build()
    build_step(workload, config, chunks, balance("tiny"), model=model)()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(("config", "chunks"), [("accumulation", 4), ("ours_k1", 4), ("torchgpipe", 4)])
def test_in_process_configurations_train_like_the_unpipelined_step(config: str, chunks: int) -> None:
    untrained = [p.detach() for p in WORKLOADS["tiny"].build().parameters()]
    reference = _trained("unpipelined", 1)
    trained = _trained(config, chunks)
    assert any(not torch.equal(a, b) for a, b in zip(untrained, reference, strict=True))  # the step did something
    for expected, actual in zip(reference, trained, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-7)


def test_unknown_configuration_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown configuration 'ours_k3'; use one of unpipelined, accumulation"):
        build_step(WORKLOADS["tiny"], "ours_k3", 4, (5, 5))


@RunIf(multiprocess=True)
@pytest.mark.slow  # ~20 s on an idle 2-core machine (the worker server imports torch.distributed.pipelining, zoo,
# torchgpipe), minutes on a loaded one
@pytest.mark.timeout(300)
def test_smoke_run_prints_the_headlines_last() -> None:
    # Every configuration once, in fresh processes (two-process ones over gloo), through the real command line. Its own
    # session, so that on a timeout the whole process group goes (the worker server and the workers included).
    code, stdout, stderr = run_module("benchmarks.zoo_throughput.run", ["--smoke"], timeout=270, cwd=REPO)
    assert code == 0, stderr[-3000:]
    last = stdout.strip().splitlines()[-3:]
    assert [line.split("=")[0] for line in last] == [
        "ratio_vs_torch_pipelining",
        "small_stage_ratio_vs_torch_pipelining",
        "efficiency_vs_bubble_bound",
    ]
    assert last[1].split("=")[1] != "n/a"  # the tiny stages ran both pipelines
