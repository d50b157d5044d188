"""`GPipeStrategy(plan="auto")`: planned on rank 0 for the loader's batch, agreed by every rank, trained as printed."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers.jobs import run_job
from helpers.plan_profiles import synthetic
from helpers.runif import RunIf
from torch import nn

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.plan import InfeasiblePlanError, plan


def test_plan_auto_is_refused_beside_the_settings_it_chooses() -> None:
    from lightning_gpipe.plan import AutoPlan

    with pytest.raises(
        ValueError,
        match=r"but chunks=4 was given as well: drop it, restrict the plan \(plan=AutoPlan\(chunks=\[4\]\)\)",
    ):
        GPipeStrategy(plan="auto", chunks=4)
    with pytest.raises(ValueError, match=r"but balance=\[2, 2\], schedule='1f1b' were given as well"):
        GPipeStrategy(plan=AutoPlan(memory_per_device="1GB"), balance=[2, 2], schedule="1f1b")
    with pytest.raises(ValueError, match=r"plan='fast' is not a plan; use plan='auto'"):
        GPipeStrategy(plan="fast")
    with pytest.raises(TypeError, match=r"plan=3 must be 'auto' or a lightning_gpipe.plan.AutoPlan"):
        GPipeStrategy(plan=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"AutoPlan\(chunks=4\) must be a non-empty list of ints"):
        AutoPlan(chunks=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"AutoPlan\(virtual_stages=\[1\]\) must be a non-empty list of ints >= 2"):
        AutoPlan(virtual_stages=[1])
    GPipeStrategy(plan="auto", checkpoint="except_last", schedule="gpipe")  # the defaults are no conflict


def test_plan_for_a_module_needs_a_sample_and_on_cpu_a_budget() -> None:
    from lightning_gpipe.plan import AutoPlan
    from lightning_gpipe.plan.auto import plan_for_module

    layers = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"needs a memory budget per device on 'cpu'.*AutoPlan\(memory_per_device="):
        plan_for_module(AutoPlan(), layers, torch.randn(4, 8), batch_size=4, devices=1, device=cpu)
    with pytest.raises(ValueError, match=r"set self.example_input_array.*AutoPlan\(sample=...\)"):
        plan_for_module(AutoPlan(memory_per_device="1MiB"), layers, None, batch_size=4, devices=1, device=cpu)
    result = plan_for_module(
        AutoPlan(memory_per_device="1MiB", chunks=[1, 2]), layers, torch.randn(4, 8), batch_size=6, devices=1,
        device=cpu,
    )  # fmt: skip
    assert (result.batch_size, result.per_pipeline_batch) == (6, True)  # the batch given, not the sample's 4 rows


def test_the_planned_batch_is_the_requests_else_the_loaders_never_the_samples_rows() -> None:
    from torch.utils.data import DataLoader, IterableDataset, TensorDataset

    from lightning_gpipe.plan.auto import AutoPlan, loader_batch_size, planned_batch

    data = TensorDataset(torch.randn(64, 8))
    assert planned_batch(AutoPlan(), lambda: DataLoader(data, batch_size=16)) == 16
    assert planned_batch(AutoPlan(batch_size=8), lambda: pytest.fail("a stated batch needs no loader")) == 8
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(data), batch_size=12, drop_last=True)
    assert loader_batch_size(DataLoader(data, batch_sampler=sampler)) == 12
    assert loader_batch_size([DataLoader(data, batch_size=4)]) == 4
    assert loader_batch_size({"a": DataLoader(data, batch_size=4), "b": DataLoader(data, batch_size=4)}) is None

    class Stream(IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield torch.randn(5, 8)

    for unknown in (None, DataLoader(Stream(), batch_size=None)):
        with pytest.raises(
            ValueError, match=r"cannot read the batch_size of the run's loader .*: pass plan=AutoPlan\(batch_size="
        ):
            planned_batch(AutoPlan(), lambda unknown=unknown: unknown)


class _Planned(L.LightningModule):
    """An MLP whose example_input_array has 2 rows (as a zoo model's, set for FLOPs), trained on batches of 16."""

    def __init__(self, loader_batch: int = 16) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        self.example_input_array = torch.randn(2, 8)
        self.loader_batch = loader_batch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
        return torch.utils.data.DataLoader(data, batch_size=self.loader_batch)


def _planned_trainer(request: Any) -> L.Trainer:
    return L.Trainer(
        strategy=GPipeStrategy(plan=request), accelerator="cpu", devices=1, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip


@pytest.mark.usefixtures("loopback_process_group")
def test_plan_auto_plans_for_the_loaders_batch_not_the_example_inputs_rows(caplog: pytest.LogCaptureFixture) -> None:
    # plan="auto" took example_input_array's 2 rows (a zoo model's, set for FLOPs) for
    # the batch and planned memory for 2 samples while the DataLoader gave 16.
    from lightning_gpipe import AutoPlan

    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        _planned_trainer(AutoPlan(memory_per_device="64MiB", chunks=[1, 2])).fit(_Planned(loader_batch=16))
    planned = [record.getMessage() for record in caplog.records if "GPipe plan" in record.getMessage()]
    assert len(planned) == 1
    assert "batch 16 per pipeline" in planned[0]


@pytest.mark.usefixtures("loopback_process_group")
def test_plan_auto_refuses_a_first_batch_of_another_size_than_planned() -> None:
    # Nothing checked the first real batch against the planned one, so a plan made for
    # another batch (here the one stated) trained on under-predicted memory without a word.
    from lightning_gpipe import AutoPlan

    refused = (
        r"planned for batches of 8 samples per pipeline, but the first training batch has 16: pass "
        r"plan=AutoPlan\(batch_size=16\), or DataLoader\(batch_size=8\)"
    )
    with pytest.raises(ValueError, match=refused):
        _planned_trainer(AutoPlan(memory_per_device="64MiB", batch_size=8, chunks=[1, 2])).fit(_Planned(16))


def test_rank_zero_plans_and_every_rank_gets_its_settings_or_its_error() -> None:
    from lightning_gpipe.plan.auto import agreed_settings

    sent: list[object] = []

    def from_rank_zero(obj: object) -> object:  # what a broadcast from rank 0 gives the rank calling it
        if obj is not None:
            sent.append(obj)
        return sent[-1]

    made = plan(nn.Sequential(*[nn.Identity()] * 8), None, devices=2, memory_per_device="40MiB", batch_size=32,
                profile=synthetic())  # fmt: skip
    reports: list[str] = []
    settings = agreed_settings(lambda: made, rank=0, broadcast=from_rank_zero, report=reports.append)
    assert settings == made.strategy_kwargs()
    assert agreed_settings(lambda: pytest.fail("only rank 0 plans"), rank=1, broadcast=from_rank_zero,
                           report=reports.append) == settings  # fmt: skip
    assert len(reports) == 1
    assert f"GPipeStrategy(pipe_size=2, chunks={made.chunks}, balance={made.balance}" in reports[0]

    def infeasible() -> Any:
        raise InfeasiblePlanError("nothing fits", min_devices=None, min_memory=None)

    with pytest.raises(InfeasiblePlanError, match="nothing fits"):
        agreed_settings(infeasible, rank=0, broadcast=from_rank_zero, report=reports.append)
    with pytest.raises(ValueError, match="global rank 0 could not plan .*InfeasiblePlanError: nothing fits"):
        agreed_settings(infeasible, rank=1, broadcast=from_rank_zero, report=reports.append)


@RunIf(multiprocess=True)
@pytest.mark.timeout(420)
def test_plan_auto_trains_like_the_settings_it_printed(tmp_path: Path) -> None:
    # Two ranks, plan="auto" restricted to K = 2 (the tiny MLP would otherwise run as two replicas); each planned fit
    # is followed, in the same processes, by one given the settings its plan chose explicitly. The second plan is
    # restricted to interleaved: two stages per process reach the strategy (virtual_stages, K·v stages of
    # balance) and train as the line it printed does.
    budget = {"memory_per_device": "1MiB", "pipe_sizes": [2], "optimizer_slots": 1}
    interleaved = {"memory_per_device": "1GB", "pipe_sizes": [2], "optimizer_slots": 1}
    interleaved |= {"schedules": ["interleaved"], "virtual_stages": [2]}
    runs = [
        {"devices": 2, "steps": 2, "plan": budget},
        {"devices": 2, "steps": 2, "settings_of": 0},
        {"devices": 2, "steps": 2, "plan": interleaved},
        {"devices": 2, "steps": 2, "settings_of": 2},
    ]
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"runs": runs}))
    results = run_job("helpers.lightning_job", [str(config)], 2, timeout=400)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank} failed:\n{result.stdout[-4000:]}"
    printed = results[0].stdout
    assert printed.count("GPipe plan (plan='auto')") == 2  # logged once per planned fit, on rank 0
    assert "GPipe plan" not in results[1].stdout
    settings = [json.loads((tmp_path / f"settings-{i}.json").read_text()) for i in (0, 2)]
    assert settings[0]["pipe_size"] == 2
    assert (settings[1]["schedule"], settings[1]["virtual_stages"], len(settings[1]["balance"])) == (
        "interleaved",
        2,
        4,
    )
    for planned_run, chosen in zip((0, 2), settings, strict=True):
        explicit = ", ".join(f"{name}={value!r}" for name, value in chosen.items())
        assert f"the same without planning: GPipeStrategy({explicit})" in printed
        planned, given = (
            torch.load(tmp_path / f"result-{i}.pt", weights_only=True) for i in (planned_run, planned_run + 1)
        )
        assert planned.keys() == given.keys()
        for key, value in given.items():
            assert torch.equal(planned[key], value), key
    planned, given = (torch.load(tmp_path / f"result-{i}.pt", weights_only=True) for i in range(2))
    assert planned.keys() == given.keys()
    for key, value in given.items():
        assert torch.equal(planned[key], value), key


def test_auto_plan_is_exported_by_the_package() -> None:
    # `from lightning_gpipe import AutoPlan` failed; it lived in lightning_gpipe.plan only.
    import lightning_gpipe
    from lightning_gpipe.plan import AutoPlan

    assert lightning_gpipe.AutoPlan is AutoPlan
    assert "AutoPlan" in lightning_gpipe.__all__


def test_plan_auto_is_refused_beside_an_explicit_data_parallel_and_checks_its_own() -> None:
    from lightning_gpipe.plan import AutoPlan

    with pytest.raises(ValueError, match=r"data_parallel='fsdp' was given as well: .*plan=AutoPlan\(data_parallel="):
        GPipeStrategy(plan="auto", data_parallel="fsdp")
    with pytest.raises(ValueError, match=r"data_parallel='zero' is not a way to plan the replicas"):
        AutoPlan(data_parallel="zero")  # type: ignore[arg-type]
    assert AutoPlan().data_parallel == "auto"
    GPipeStrategy(plan=AutoPlan(data_parallel="fsdp"))  # the plan's own restriction


def test_a_planned_data_parallel_takes_the_place_of_the_strategys() -> None:
    from lightning_gpipe.partition.config import BuildConfig

    resolved = BuildConfig().resolve(4, 0, {"pipe_size": 2, "chunks": 2, "data_parallel": "fsdp"})
    assert resolved.data_parallel == "fsdp"
    assert BuildConfig().resolve(4, 0, {"pipe_size": 2, "chunks": 2}).data_parallel == "ddp"


@RunIf(multiprocess=True)
@pytest.mark.timeout(420)
def test_plan_auto_shards_the_replicas_when_whole_ones_do_not_fit(tmp_path: Path) -> None:
    # Two pipelines of two stages on 4 ranks, 16 layers of 1 MiB and Adam: whole replicas need about 35 MiB per rank,
    # sharded ones about 30 (as the planner profiles them here); with 32 MiB, plan="auto" shards them, every rank
    # follows, and the fit equals the one given the printed settings explicitly.
    from helpers.fsdp_job import stack
    from helpers.models import IN

    restrict = {"pipe_sizes": [2], "chunks": [2], "checkpoints": ["never"], "schedules": ["gpipe"]}
    thriftiest = {}
    for data_parallel in ("ddp", "fsdp"):
        with pytest.raises(InfeasiblePlanError) as caught:
            plan(stack(), torch.randn(2, IN), devices=4, memory_per_device=1, batch_size=16, per_pipeline_batch=True,
                 data_parallel=data_parallel, **restrict)  # fmt: skip
        thriftiest[data_parallel] = caught.value.min_memory
    budget = 32 * 2**20
    assert thriftiest["fsdp"] < budget < thriftiest["ddp"]
    run = {"pipe_size": None, "devices": 4, "steps": 2, "model": "stack", "batch": 16, "clip": None}
    runs = [{**run, "plan": {"memory_per_device": budget, **restrict}}, {**run, "settings_of": 0}]
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"runs": runs}))
    results = run_job("helpers.fsdp_job", [str(config)], 4, timeout=400)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank} failed:\n{result.stdout[-4000:]}"
    settings = json.loads((tmp_path / "settings-0.json").read_text())
    assert (settings["pipe_size"], settings["data_parallel"]) == (2, "fsdp")
    assert "data_parallel='fsdp': nothing fits with whole replicas" in results[0].stdout
    explicit = ", ".join(f"{name}={value!r}" for name, value in settings.items() if name != "data_parallel")
    assert f"GPipeStrategy({explicit}, data_parallel='fsdp')" in results[0].stdout
    for rank in range(4):
        held = torch.load(tmp_path / f"held-0-rank{rank}.pt", weights_only=True)
        assert held["sharded"], f"rank {rank} holds no shard"
    planned, given = (torch.load(tmp_path / f"result-{i}.pt", weights_only=True) for i in range(2))
    assert planned.keys() == given.keys()
    for key, value in given.items():
        assert torch.equal(planned[key], value), key
