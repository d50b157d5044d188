"""Each rank keeps only its own stage after fit, and reads and writes only its own state; the whole module comes back
only when asked for (``gather_module``), or by itself to a notebook's process under the fork launcher. Each with stages
held whole (``data_parallel="ddp"``, two ranks) and sharded over two replicas (``"fsdp"``, four ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.fork_job import STEPS
from helpers.jobs import launch, run_job
from helpers.kept_stages_job import calls
from helpers.lightning_job import SequentialModule, dataset, trainer_for
from helpers.runif import RunIf
from test_strategy_equivalence import assert_same_parameters, plain
from torch.utils.data import DataLoader

from lightning_gpipe import GPipeStrategy

MIB = 2**20


WORLDS = {"ddp": 2, "fsdp": 4}  # K = 2: one pipeline, or two whose replicas shard each stage


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("data_parallel", list(WORLDS))
def test_later_calls_of_the_trainer_reuse_the_kept_stages_and_gather_module_gives_the_whole_back(
    tmp_path: Path, data_parallel: str
) -> None:
    world = WORLDS[data_parallel]
    results = run_job("helpers.kept_stages_job", [str(tmp_path), data_parallel], world, timeout=500)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout[-4000:]}"
    seen = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(world)]
    reference = calls({"strategy": "auto", "devices": 1, "limit_val_batches": 2}, tmp_path / "plain")
    whole = sum(p.numel() for p in SequentialModule().parameters())
    for rank in range(world):
        for call in ("after_fit", "after_predict", "after_second_fit", "after_validate_after_gather"):
            assert seen[rank][call]["sequence"] == "PipelinedSequential", (rank, call)  # still cut: one stage each
        for value in ("validate", "predict", "validate_after_gather"):
            assert seen[rank][value] == pytest.approx(reference[value], rel=1e-5), (rank, value)
        if rank > 0:  # each keeps its own layers, whole
            stage = seen[rank]["after_fit"]["parameters"]
            assert seen[rank]["after_gather"] == {"sequence": "Sequential", "parameters": stage}, rank
    assert seen[0]["after_fit"]["parameters"] + seen[1]["after_fit"]["parameters"] == whole
    assert seen[0]["after_gather"] == {"sequence": "Sequential", "parameters": whole}
    assert_same_parameters(torch.load(tmp_path / "whole.pt", weights_only=True), reference["whole"])
    assert_same_parameters(torch.load(tmp_path / "whole-again.pt", weights_only=True), reference["whole"])


@pytest.fixture(scope="module")
def memory(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, int]]:
    root = tmp_path_factory.mktemp("memory")
    results = run_job("helpers.state_memory_job", [str(root)], 2, timeout=500)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout[-4000:]}"
    return [json.loads((root / f"memory-rank{rank}.json").read_text()) for rank in range(2)]


def _report(seen: list[dict[str, int]]) -> str:
    return "; ".join(
        f"rank {r}: " + ", ".join(f"{k} {v / MIB:.0f} MiB" for k, v in s.items()) for r, s in enumerate(seen)
    )


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
def test_no_rank_holds_the_whole_model_at_the_end_of_fit_and_gathering_takes_it_to_rank_zero_only(
    memory: list[dict[str, int]],
) -> None:
    # Teardown all-gathered every stage, pickled, onto every rank: each rank's peak rose by more than the whole model
    # (user trial 4, teardown_gathers_whole_model.py).
    for rank in range(2):
        assert memory[rank]["teardown"] < 0.1 * memory[rank]["whole"], _report(memory)
    assert memory[1]["gather"] < 0.25 * memory[1]["whole"], _report(memory)  # it sends its stage, a bucket at a time
    assert memory[0]["gather"] < 0.75 * memory[0]["whole"], _report(memory)  # it receives the other half


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
def test_saving_and_resuming_touch_only_the_ranks_own_stage(memory: list[dict[str, int]]) -> None:
    # Saving gathered every stage's state pickled on rank 0 (more than plain Lightning's save of the whole model in
    # one process) and resuming read the whole file on every rank (user trial 4, checkpoint_host_memory.py).
    assert memory[0]["full_save"] < 0.5 * memory[0]["plain_save"], _report(memory)
    for rank in range(2):
        # A stage's state (weights and Adam) is 1.5x the whole model's weights here; the allocator's noise, up to a
        # quarter of them, sits under the bound.
        assert memory[rank]["full_save"] < 0.5 * memory[rank]["whole"], _report(memory)
        assert memory[rank]["sharded_save"] < 0.5 * memory[rank]["whole"], _report(memory)
        # Its stage's Adam moments are a third of the file; the rest it does not read.
        assert memory[rank]["full_resume"] < 0.5 * memory[rank]["file"], _report(memory)
        assert memory[rank]["sharded_resume"] < 0.5 * memory[rank]["file"], _report(memory)


@RunIf(multiprocess=True)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("data_parallel", list(WORLDS))
def test_the_fork_launcher_gives_the_launching_process_the_whole_trained_module(
    tmp_path: Path, data_parallel: str
) -> None:
    # Lightning's launcher loads global rank 0's state dict into the launching process's module: one stage, now that
    # each rank keeps its own; every rank of the first pipeline hands over its stage instead (a sharded stage gathered
    # whole by its replicas: a pickled DTensor would not load with weights_only=True).
    result, _seconds, leftovers = launch("helpers.fork_job", [str(tmp_path), data_parallel], timeout=500)
    assert result.returncode == 0, result.stdout[-4000:]
    assert leftovers == 0
    launched = torch.load(tmp_path / "launched.pt", weights_only=True)
    assert_same_parameters(launched, plain(tmp_path / "plain", steps=STEPS))


@pytest.mark.usefixtures("loopback_process_group")
def test_another_trainer_cutting_alike_takes_the_stages_over_and_one_cutting_otherwise_is_refused(
    tmp_path: Path,
) -> None:
    run = {"pipe_size": 1, "devices": 1, "chunks": 2, "steps": 2, "limit_val_batches": 1}
    module, loader = SequentialModule(), DataLoader(dataset(), batch_size=16)
    first = trainer_for(run, tmp_path)
    first.fit(module, loader)
    trained = {key: value.clone() for key, value in module.state_dict().items()}
    second = trainer_for({**run, "chunks": 4}, tmp_path)  # the same stages, other settings: it takes them over
    assert second.validate(module, loader, verbose=False)[0]["val_loss"] > 0
    assert_same_parameters(module.state_dict(), trained)  # nothing moved
    assert isinstance(first.strategy, GPipeStrategy)
    refused = r"SequentialModule.layers holds one stage only, cut by another Trainer"
    with pytest.raises(ValueError, match=refused + r".*call that Trainer's strategy.gather_module\(\)"):
        first.strategy.gather_module()  # the first no longer holds them
    interleaved = {**run, "options": {"schedule": "interleaved", "virtual_stages": 2}}
    with pytest.raises(ValueError, match=refused + r".* \(1 stages, this rank holding \(0,\); this Trainer's: 2, "):
        trainer_for(interleaved, tmp_path).validate(module, loader, verbose=False)
    assert isinstance(second.strategy, GPipeStrategy)
    assert second.strategy.gather_module() is module
    assert isinstance(module.layers, torch.nn.Sequential)
    assert_same_parameters(module.state_dict(), trained)
