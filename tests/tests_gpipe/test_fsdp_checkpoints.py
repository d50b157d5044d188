"""Checkpoints of sharded stages (``data_parallel="fsdp"``) on real files: two pipelines of two stages on 4 gloo ranks
save both formats, Lightning's tool consolidates the sharded directory into ``"ddp"``'s weights, and either format
resumes under ``"ddp"``, under ``"fsdp"`` at another K (other shards), at K = 1, and the reverse, as the uninterrupted
run goes on; a sharded save holds no more than the rank's shard, and ``gather_module`` no more than the whole model on
global rank 0 and a stage elsewhere."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.checkpoint_job import AdamModule, fit
from helpers.jobs import run_job
from helpers.runif import RunIf
from helpers.state_memory_job import DEPTH, WIDTH
from helpers.whole import whole_module
from test_strategy_equivalence import assert_same_parameters

STEPS = 2  # one epoch of two steps, saved at its end; resumed for one step more, the uninterrupted run's third
PAIR = {"pipe_size": 2, "devices": 4, "samples": 32}
JOB_TIMEOUT = 600


def _fsdp(**run: Any) -> dict[str, Any]:
    return {**PAIR, "data_parallel": "fsdp", **run}


def _ddp(**run: Any) -> dict[str, Any]:
    return {**PAIR, "data_parallel": "ddp", **run}


def _launch(root: Path, runs: list[dict[str, Any]]) -> None:
    (root / "config.json").write_text(json.dumps({"runs": runs}))
    results = run_job("helpers.checkpoint_job", [str(root / "config.json")], 4, timeout=JOB_TIMEOUT)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout[-4000:]}"


SAVED = {"fsdp sharded": 0, "fsdp full": 1, "ddp sharded": 2, "ddp full": 3}
UNINTERRUPTED = 4
RESUMED = {  # what resumed, from which checkpoint: the run's index in the launch
    "ddp from fsdp sharded": 5,
    "ddp from fsdp full": 6,
    "fsdp from ddp sharded": 7,
    "fsdp from ddp full": 8,
    "fsdp K=1 x 4 from fsdp sharded": 9,  # four shards of what two wrote
    "fsdp K=1 x 4 from fsdp full": 10,
    "fsdp from ModelCheckpoint's last": 11,
}


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 4-rank launch: the saves of :data:`SAVED`, the uninterrupted run, then the resumptions of :data:`RESUMED`."""
    root = tmp_path_factory.mktemp("fsdp-checkpoints")
    saves = [
        _fsdp(steps=STEPS, state_dict_type="sharded", save=str(root / "fsdp.sharded"), checkpoints=str(root / "kept")),
        _fsdp(steps=STEPS, save=str(root / "fsdp.full")),
        _ddp(steps=STEPS, state_dict_type="sharded", save=str(root / "ddp.sharded")),
        _ddp(steps=STEPS, save=str(root / "ddp.full")),
    ]
    more = STEPS + 1
    resumptions = [
        _ddp(steps=more, resume=str(root / "fsdp.sharded")),
        _ddp(steps=more, resume=str(root / "fsdp.full")),
        _fsdp(steps=more, resume=str(root / "ddp.sharded")),
        _fsdp(steps=more, resume=str(root / "ddp.full")),
        _fsdp(steps=more, pipe_size=1, resume=str(root / "fsdp.sharded")),
        _fsdp(steps=more, pipe_size=1, resume=str(root / "fsdp.full")),
        _fsdp(steps=more, resume=str(root / "kept" / "last.ckpt")),
    ]
    _launch(root, [*saves, _fsdp(steps=more), *resumptions])
    return root


def _result(root: Path, index: int) -> dict[str, torch.Tensor]:
    return torch.load(root / f"result-{index}.pt", weights_only=True)


@RunIf(multiprocess=True)
@pytest.mark.timeout(2 * JOB_TIMEOUT)
def test_a_sharded_checkpoint_of_sharded_stages_consolidated_by_lightnings_tool_is_ddps(
    four: Path, tmp_path: Path
) -> None:
    directory = four / "fsdp.sharded"
    # Each replica wrote its own rows: a shard per rank, as under "ddp", where replicas wrote their stage once.
    assert sorted(p.name for p in directory.iterdir()) == [
        ".metadata",
        *[f"__{r}_0.distcp" for r in range(4)],
        "meta.pt",
    ]
    consolidated = tmp_path / "consolidated.ckpt"
    command = [sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint", str(directory)]
    subprocess.run([*command, "--output_file", str(consolidated)], check=True, timeout=300)
    checkpoint = torch.load(consolidated, weights_only=True)
    AdamModule().load_state_dict(checkpoint["state_dict"], strict=True)
    ddp = _result(four, SAVED["ddp sharded"])
    assert_same_parameters(checkpoint["state_dict"], ddp)
    assert_same_parameters(_result(four, SAVED["fsdp sharded"]), ddp)  # gather_module after fit
    full = torch.load(four / "fsdp.full", weights_only=True)  # gathered whole from the replicas
    assert_same_parameters(full["state_dict"], ddp)
    ddp_full = torch.load(four / "ddp.full", weights_only=True)
    names = [name for name, _ in AdamModule().named_parameters()]
    for saved in (checkpoint, full):  # Adam's moments, whole, by parameter name, as "ddp" saved them
        (optimizer,) = saved["optimizer_states"]
        assert optimizer["param_groups"][0]["params"] == names
        assert sorted(optimizer["state"]) == sorted(names)
        for name in names:
            for moment in ("exp_avg", "exp_avg_sq"):
                expected = ddp_full["optimizer_states"][0]["state"][name][moment]
                torch.testing.assert_close(optimizer["state"][name][moment], expected, atol=1e-5, rtol=0)


@RunIf(multiprocess=True)
@pytest.mark.timeout(2 * JOB_TIMEOUT)
@pytest.mark.parametrize("resumed", list(RESUMED))
def test_a_checkpoint_resumes_across_data_parallel_and_k_as_the_uninterrupted_run_goes_on(
    four: Path, resumed: str
) -> None:
    index = RESUMED[resumed]
    assert_same_parameters(_result(four, index), _result(four, UNINTERRUPTED))
    seen = json.loads((four / f"seen-{index}.json").read_text())
    expected = json.loads((four / f"seen-{UNINTERRUPTED}.json").read_text())
    assert seen == {"lr": pytest.approx(expected["lr"]), "step": STEPS + 1}  # the schedule and the loops resumed


@RunIf(multiprocess=True)  # the checkpoints come from the 4-rank launch
@pytest.mark.timeout(2 * JOB_TIMEOUT)
@pytest.mark.parametrize("kind", ["sharded", "full"])
@pytest.mark.usefixtures("loopback_process_group")
def test_a_checkpoint_of_sharded_stages_resumes_on_one_stage(four: Path, tmp_path: Path, kind: str) -> None:
    run = {"pipe_size": 1, "devices": 1, "samples": 32, "steps": STEPS + 1, "resume": str(four / f"fsdp.{kind}")}
    resumed, trainer = fit(run, tmp_path)
    whole = whole_module(resumed)
    assert whole is not None
    assert_same_parameters(whole.state_dict(), _result(four, UNINTERRUPTED))
    assert trainer.global_step == STEPS + 1


@RunIf(multiprocess=True)
@pytest.mark.timeout(2 * JOB_TIMEOUT)
def test_model_checkpoint_keeps_sharded_directories_of_sharded_stages(four: Path) -> None:
    names = sorted(p.name for p in (four / "kept").iterdir())
    assert len(names) == 2, names  # top-1 by train_loss, and last.ckpt
    assert "last.ckpt" in names
    for name in names:
        assert (four / "kept" / name / ".metadata").is_file()
        assert sorted(p.name for p in (four / "kept" / name).glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    assert torch.load(four / "kept" / "last.ckpt" / "meta.pt", weights_only=True)["global_step"] == STEPS


# ------------------------------------------------------------------ resident memory, 4 ranks, K = 2 x 2 replicas

MIB = 2**20


@pytest.fixture(scope="module")
def memory(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, int]]:
    root = tmp_path_factory.mktemp("fsdp-memory")
    results = run_job("helpers.state_memory_job", [str(root), "fsdp"], 4, timeout=JOB_TIMEOUT)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout[-4000:]}"
    return [json.loads((root / f"memory-rank{rank}.json").read_text()) for rank in range(4)]


def _report(seen: list[dict[str, int]]) -> str:
    return "; ".join(
        f"rank {r}: " + ", ".join(f"{k} {v / MIB:.0f} MiB" for k, v in s.items()) for r, s in enumerate(seen)
    )


WHOLE = DEPTH * (WIDTH + 1) * WIDTH * 4  # bytes of the model's weights in float32
SHARD = 3 * WHOLE // 2 // 2  # a rank's weights and Adam's two moments: its stage (half the model) over two replicas


@RunIf(multiprocess=True)
@pytest.mark.timeout(JOB_TIMEOUT)
def test_a_sharded_save_of_sharded_stages_holds_no_more_than_the_shard(memory: list[dict[str, int]]) -> None:
    for rank in range(4):
        # Each replica hands DCP its own rows as they are; gathering its stage whole would hold twice its shard.
        assert memory[rank]["sharded_save"] < 0.25 * SHARD, _report(memory)
        assert memory[rank]["full_save"] > SHARD, _report(memory)  # "full" gathers each stage whole, as documented
        # Resuming reads Adam's moments into shards: 2/3 of the shard (the weights go into the parameters), where the
        # stage's whole moments would be 4/3 of it.
        assert memory[rank]["sharded_resume"] < SHARD, _report(memory)
        assert memory[rank]["full_resume"] < SHARD, _report(memory)


@RunIf(multiprocess=True)
@pytest.mark.timeout(JOB_TIMEOUT)
def test_gathering_sharded_stages_holds_the_whole_model_on_rank_zero_only(memory: list[dict[str, int]]) -> None:
    # Global rank 0 makes its stage whole, then receives the other stage in buckets: the whole model's weights.
    assert memory[0]["gather"] < WHOLE + 16 * MIB, _report(memory)
    for rank in range(1, 4):  # the others make their stage whole: half the model
        assert memory[rank]["gather"] < WHOLE // 2 + 16 * MIB, _report(memory)
