"""The zoo's command line: every shipped config parses, and pretrain -> fine-tune runs end to end with GPipe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.runif import RunIf

from zoo.cli import main

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").rglob("*.yaml"))
# A tiny model and a few images, so the two fits take seconds; everything else is the shipped configs.
TINY = [
    "--trainer.max_epochs=1",
    "--trainer.limit_val_batches=1",
    "--model.init_args.num_layers=3",
    "--model.init_args.num_filters=8",
    "--data.init_args.num_train=64",
    "--data.init_args.num_val=32",
    "--data.init_args.batch_size=16",
]


def zoo_cli(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "zoo", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_configs_exist_for_every_task() -> None:
    names = {path.relative_to(REPO / "configs").as_posix() for path in CONFIGS}
    assert {
        "amoebanet/pretrain_embedded.yaml",
        "amoebanet/finetune_embedded.yaml",
        "amoebanet/finetune_cifar10.yaml",
        "amoebanet/finetune_cifar100.yaml",
        "amoebanet/finetune_food101.yaml",
    } <= names


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.relative_to(REPO / "configs").as_posix())
def test_every_config_parses_with_its_class_paths_and_arguments(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:  # --print_config validates the whole config, then exits
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    assert "class_path: zoo." in capsys.readouterr().out


@RunIf(multiprocess=True)
@pytest.mark.timeout(900)
def test_pretrain_then_finetune_from_the_command_line_with_two_stages(tmp_path: Path) -> None:
    pretrain = zoo_cli("fit", "--config", str(REPO / "configs/amoebanet/pretrain_embedded.yaml"), *TINY, cwd=tmp_path)
    assert pretrain.returncode == 0, pretrain.stdout[-2000:] + pretrain.stderr[-4000:]
    pretrained = tmp_path / "out/zoo/amoebanet-embedded/pretrain/last.ckpt"
    assert pretrained.is_file()
    finetune = zoo_cli("fit", "--config", str(REPO / "configs/amoebanet/finetune_embedded.yaml"), *TINY, cwd=tmp_path)
    assert finetune.returncode == 0, finetune.stdout[-2000:] + finetune.stderr[-4000:]
    finetuned = torch.load(tmp_path / "out/zoo/amoebanet-embedded/finetune/last.ckpt", weights_only=True)
    before = torch.load(pretrained, weights_only=True)
    assert finetuned["zoo_model"] == "amoebanet_d"
    assert finetuned["hyper_parameters"]["num_classes"] == 6
    heads = [key for key in before["state_dict"] if key.endswith(".fc.weight")]
    assert len(heads) == 2  # the classifier and the aux classifier
    for key in heads:
        assert before["state_dict"][key].shape[0] == 10
        assert finetuned["state_dict"][key].shape[0] == 6
