"""Both checkpoint formats on real files, against plain Lightning: saved at K = 4, consolidated by Lightning's tool,
resumed at K = 2 (one and two replicas, another schedule) and K = 1, kept by ``ModelCheckpoint``, and refused when
they do not fit, on every rank, with nothing overwritten."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers.checkpoint_job import AdamModule, fit, trainer_for
from helpers.jobs import run_job
from helpers.lightning_job import dataset
from helpers.runif import RunIf
from helpers.whole import whole_module
from test_strategy_equivalence import assert_same_parameters
from torch.utils.data import DataLoader

from lightning_gpipe import checkpoint_io
from lightning_gpipe.sharded_checkpoint import write_sharded
from lightning_gpipe.torch_file import TensorFile

STEPS = 2  # trained, then resumed for one step more
K4 = {"pipe_size": 4, "devices": 4, "steps": STEPS}
K2 = {"pipe_size": 2, "devices": 2, "steps": STEPS + 1}
JOB_TIMEOUT = 600


def _launch(root: Path, world_size: int, runs: list[dict[str, Any]]) -> list[Any]:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"runs": runs}))
    results = run_job("helpers.checkpoint_job", [str(root / "config.json")], world_size, timeout=JOB_TIMEOUT)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout[-4000:]}"
    return results


def _digest(path: Path) -> dict[str, str]:
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    return {str(f.relative_to(path.parent)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files if f.is_file()}


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 4-rank launch: two steps at K = 4 saved sharded (and kept by ModelCheckpoint every step), then saved full."""
    root = tmp_path_factory.mktemp("four")
    _launch(root, 4, [
        {**K4, "state_dict_type": "sharded", "save": str(root / "k4.sharded"), "checkpoints": str(root / "kept")},
        {**K4, "save": str(root / "k4.full")},
    ])  # fmt: skip
    return root


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Plain Lightning on one device: two steps saved, then resumed from its own checkpoint for one more."""
    root = tmp_path_factory.mktemp("plain")
    trained, _ = fit({"strategy": "auto", "steps": STEPS, "save": str(root / "plain.ckpt")}, root)
    resumed, trainer = fit({"strategy": "auto", "steps": STEPS + 1, "resume": str(root / "plain.ckpt")}, root)
    return {
        "trained": trained.state_dict(),
        "resumed": resumed.state_dict(),
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "checkpoint": root / "plain.ckpt",
    }


def _bad_inputs(four: Path, root: Path) -> list[dict[str, Any]]:
    """Runs that must fail on both ranks, with the files they meet; each writes ``error-N-rankR.txt``."""
    damaged = {}
    for name in ("missing", "truncated"):
        damaged[name] = root / f"{name}.sharded"
        shutil.copytree(four / "k4.sharded", damaged[name])
    (damaged["missing"] / "__2_0.distcp").unlink()
    with open(damaged["truncated"] / "__1_0.distcp", "r+b") as shard:
        shard.truncate(100)
    (root / "folder").mkdir()
    (root / "folder" / "epoch=0.ckpt").write_bytes(b"")
    shutil.copytree(four / "k4.sharded", root / "taken.sharded")
    shutil.copy(four / "k4.full", root / "taken.full")
    wide = {**K2, "model": "wide"}
    return [
        {**K2, "resume": str(root / "folder")},
        {**K2, "resume": str(damaged["missing"])},
        {**K2, "resume": str(damaged["truncated"])},
        {**K2, "model": "nested", "resume": str(four / "k4.sharded")},
        {**wide, "resume": str(four / "k4.sharded")},
        {**wide, "resume": str(four / "k4.full")},
        {**K2, "groups": 2, "resume": str(four / "k4.sharded")},
        {**K2, "resume": str(four / "k4.sharded" / "__0_0.distcp")},
        {**K2, "resume": str(four / "k4.sharded" / "meta.pt")},
        {**K2, "steps": 1, "save": str(root / "taken.sharded")},  # a full file where a sharded directory is
        {**K2, "steps": 1, "state_dict_type": "sharded", "save": str(root / "taken.full")},
    ]


BAD_INPUT_MESSAGES = [
    r"folder is a directory but not a sharded checkpoint: it has no torch.distributed.checkpoint index \(.metadata\) "
    r"\(it holds epoch=0.ckpt: pass one of those files\)",
    r"missing.sharded/__2_0.distcp is missing: this sharded checkpoint is incomplete; copy the whole directory again",
    r"truncated.sharded/__1_0.distcp is truncated \(100 of at least \d+ bytes\): this sharded checkpoint is incomplete",
    r"k4.sharded: the checkpoint does not match this model: missing \['layers.0.hidden.weight'.*Nothing was loaded",
    r"k4.sharded: the checkpoint does not match this model: 9 tensor\(s\) have another shape \(layers.0.weight: "
    r"\(12, 6\) in the checkpoint, \(16, 6\) in the model",
    r"k4.full: the checkpoint does not match this model: 9 tensor\(s\) have another shape",
    r"k4.sharded: the checkpoint's optimizer has 1 parameter groups, this one has 2; resume with the same groups",
    r"__0_0.distcp (holds no 'state_dict'|is not a checkpoint file).* sharded one.*k4.sharded",
    r"meta.pt holds no 'state_dict' \(.*\): not a trainer.save_checkpoint file; pass a sharded one's directory, "
    r".*k4.sharded",
    r"taken.sharded is a sharded checkpoint, and state_dict_type='full' writes one file there: choose another path .* "
    r"Nothing was written",
    r"taken.full is a file \(a full checkpoint\?\), and state_dict_type='sharded' writes a directory there: .* "
    r"Nothing was written",
]


@pytest.fixture(scope="module")
def two(four: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One 2-rank launch: K = 4's checkpoints resumed one step further at K = 2, as two replicas of K = 1, and under
    1F1B; then every bad input. The digests are of the files the bad inputs met, taken before the launch."""
    root = tmp_path_factory.mktemp("two")
    good = [
        {**K2, "resume": str(four / "k4.sharded")},
        {**K2, "resume": str(four / "k4.full")},
        {**K2, "pipe_size": 1, "resume": str(four / "k4.sharded")},  # two replicas of one stage
        {**K2, "schedule": "1f1b", "resume": str(four / "k4.sharded")},
        {**K2, "resume": str(four / "kept" / "last.ckpt")},
    ]
    bad = _bad_inputs(four, root)
    before = {path: _digest(path) for path in [four / "k4.sharded", four / "k4.full", root / "taken.sharded",
                                                root / "taken.full"]}  # fmt: skip
    _launch(root, 2, [*good, *[{**run, "expect_error": True} for run in bad]])
    return {"root": root, "good": len(good), "before": before}


@RunIf(multiprocess=True)
@pytest.mark.timeout(2 * JOB_TIMEOUT)
def test_a_sharded_checkpoint_consolidated_by_lightnings_tool_is_plain_trainings(
    four: Path, plain: dict[str, Any], tmp_path: Path
) -> None:
    directory = four / "k4.sharded"
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
    assert_same_parameters(checkpoint["state_dict"], plain["trained"])
    assert_same_parameters(torch.load(four / "result-0.pt", weights_only=True), plain["trained"])
    full = torch.load(four / "k4.full", weights_only=True)
    assert_same_parameters(full["state_dict"], plain["trained"])
    names = [name for name, _ in AdamModule().named_parameters()]
    for saved in (checkpoint, full):  # Adam's moments by parameter name, the groups listing the whole model
        (optimizer,) = saved["optimizer_states"]
        assert optimizer["param_groups"][0]["params"] == names
        assert sorted(optimizer["state"]) == sorted(names)
        for name in names:
            expected = full["optimizer_states"][0]["state"][name]["exp_avg"]
            torch.testing.assert_close(optimizer["state"][name]["exp_avg"], expected)
    # Plain Lightning resumes the consolidated file as its own checkpoint.
    resumed, _ = fit({"strategy": "auto", "steps": STEPS + 1, "resume": str(consolidated)}, tmp_path)
    assert_same_parameters(resumed.state_dict(), plain["resumed"])


@RunIf(multiprocess=True)
@pytest.mark.timeout(3 * JOB_TIMEOUT)
def test_k4_checkpoints_resume_at_k2_replicas_and_1f1b_as_plain_lightning_resumes_its_own(
    two: dict[str, Any], plain: dict[str, Any]
) -> None:
    for index in range(two["good"]):
        assert_same_parameters(torch.load(two["root"] / f"result-{index}.pt", weights_only=True), plain["resumed"])
        seen = json.loads((two["root"] / f"seen-{index}.json").read_text())
        assert seen == {"lr": pytest.approx(plain["lr"]), "step": STEPS + 1}  # the schedule and the loops resumed


@RunIf(multiprocess=True)  # the checkpoints come from the 4-rank launch
@pytest.mark.timeout(3 * JOB_TIMEOUT)
@pytest.mark.parametrize("kind", ["sharded", "full"])
@pytest.mark.usefixtures("loopback_process_group")
def test_k4_checkpoints_resume_on_one_stage(four: Path, plain: dict[str, Any], tmp_path: Path, kind: str) -> None:
    resumed, trainer = fit({**K2, "pipe_size": 1, "devices": 1, "resume": str(four / f"k4.{kind}")}, tmp_path)
    whole = whole_module(resumed)
    assert whole is not None
    assert_same_parameters(whole.state_dict(), plain["resumed"])
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(plain["lr"])


@RunIf(multiprocess=True)
@pytest.mark.timeout(2 * JOB_TIMEOUT)
def test_model_checkpoint_keeps_the_best_and_the_last_directory_and_removes_the_others(four: Path) -> None:
    kept = four / "kept"
    # Every step saved a directory; top-1 removed the earlier best; nothing half-written stayed behind.
    names = sorted(p.name for p in kept.iterdir())
    assert len(names) == 2, names
    assert "last.ckpt" in names
    for name in names:
        assert (kept / name / ".metadata").is_file()
        assert (kept / name / "meta.pt").is_file()
    meta = torch.load(kept / "last.ckpt" / "meta.pt", weights_only=True)
    assert meta["global_step"] == STEPS


@RunIf(multiprocess=True)
@pytest.mark.timeout(3 * JOB_TIMEOUT)
@pytest.mark.parametrize("bad", range(len(BAD_INPUT_MESSAGES)))
def test_a_checkpoint_that_does_not_fit_is_refused_on_every_rank_naming_the_path_and_the_fix(
    two: dict[str, Any], bad: int
) -> None:
    run = two["good"] + bad
    for rank in range(2):
        error = (two["root"] / f"error-{run}-rank{rank}.txt").read_text()
        assert error.startswith("ValueError: ")
        assert re.search(BAD_INPUT_MESSAGES[bad], error), error
    for path, digest in two["before"].items():
        assert _digest(path) == digest, f"{path} changed"


@pytest.mark.usefixtures("loopback_process_group")
@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_a_save_that_fails_midway_leaves_the_previous_checkpoint_loadable(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "last.ckpt"
    one = {"pipe_size": 1, "devices": 1, "state_dict_type": kind}
    fit({**one, "steps": 1, "save": str(path)}, tmp_path)
    before = _digest(path)

    def failing(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full (a writer that fails midway)")

    def shards_then_failing(state: Any, rest: Any, directory: Path, group: Any) -> None:
        write_sharded(state, None, directory, group)
        failing()

    if kind == "sharded":  # the shards are written, meta.pt is not
        monkeypatch.setattr(checkpoint_io, "write_sharded", shards_then_failing)
    else:  # the layout is written, its first tensor is not
        monkeypatch.setattr(TensorFile, "write", failing)
    with pytest.raises(OSError, match="disk full"):
        fit({**one, "steps": 2, "save": str(path)}, tmp_path)
    monkeypatch.undo()
    assert _digest(path) == before
    resumed, trainer = fit({**one, "steps": 2, "resume": str(path)}, tmp_path)
    assert trainer.global_step == 2
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert leftovers == ([".last.ckpt.partial"] if kind == "sharded" else []), leftovers
    fit({**one, "steps": 1, "save": str(path)}, tmp_path)  # the next save clears what the failed one left
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    del resumed


def test_state_dict_type_is_checked_when_the_strategy_is_built() -> None:
    from lightning_gpipe import GPipeStrategy

    with pytest.raises(ValueError, match=r"state_dict_type='sharding' is not a checkpoint format; use 'full'"):
        GPipeStrategy(state_dict_type="sharding")  # type: ignore[arg-type]
    assert GPipeStrategy().config.state_dict_type == "full"
    assert L.Trainer(strategy=GPipeStrategy(state_dict_type="sharded"), accelerator="cpu", devices=1).strategy


@pytest.mark.usefixtures("loopback_process_group")
@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_a_refused_checkpoint_leaves_the_stages_weights_untouched(tmp_path: Path, kind: str) -> None:
    # Weights are read straight into the stage's parameters: every check, the optimizers' groups included, comes first.
    one = {"pipe_size": 1, "devices": 1, "state_dict_type": kind}
    path = tmp_path / "one.ckpt"
    fit({**one, "steps": 1, "save": str(path)}, tmp_path)
    L.seed_everything(1, verbose=False)
    module = AdamModule(groups=2)  # other initial weights, and two parameter groups
    before = {key: value.clone() for key, value in module.state_dict().items()}
    trainer = trainer_for({**one, "steps": 2}, tmp_path, [])
    with pytest.raises(
        ValueError, match=r"one.ckpt: the checkpoint's optimizer has 1 parameter groups, this one has 2"
    ):
        trainer.fit(module, DataLoader(dataset(), batch_size=16), ckpt_path=str(path))
    assert_same_parameters(module.state_dict(), before)
