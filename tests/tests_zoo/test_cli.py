"""The zoo's command line: every shipped config parses, and pretrain -> fine-tune runs end to end with GPipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.runif import RunIf

from tools.launch import run_command
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
    return run_command([sys.executable, "-m", "zoo", *args], cwd=cwd, env=env, timeout=timeout)


def test_configs_exist_for_every_task() -> None:
    names = {path.relative_to(REPO / "configs").as_posix() for path in CONFIGS}
    assert {
        "amoebanet/pretrain_embedded.yaml",
        "amoebanet/finetune_embedded.yaml",
        "amoebanet/finetune_cifar10.yaml",
        "amoebanet/finetune_cifar100.yaml",
        "amoebanet/finetune_food101.yaml",
        "timm/resnet50_cifar10.yaml",
        "timm/resnet50_cifar100.yaml",
        "timm/convnext_tiny_food101.yaml",
        "timm/vit_small_cifar10.yaml",
        "causal_lm/finetune_local.yaml",
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
@pytest.mark.slow  # about 95 s; the same pretrain-then-fine-tune flow as `make demo`, whose test is slow too
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


@pytest.mark.slow  # two ranks starting timm, datasets and Lightning: about 30 s alone, minutes on a loaded machine
@RunIf(multiprocess=True)
@pytest.mark.timeout(900)
def test_a_timm_config_fine_tunes_from_a_local_weights_file_with_two_stages(tmp_path: Path) -> None:
    # The shipped ResNet-50 CIFAR-10 config as a user offline runs it (a local weights file in timm's format, a local
    # copy of the dataset), on CPU with a tiny ResNet-50 and 32 px images so it takes seconds.
    import datasets
    import numpy as np
    import timm
    from PIL import Image
    from safetensors.torch import save_file

    tiny = {"layers": [1, 1, 1, 1], "channels": [4, 8, 16, 32]}
    torch.manual_seed(0)
    original = timm.create_model("resnet50", pretrained=False, **tiny)
    save_file(original.state_dict(), tmp_path / "resnet50.safetensors")
    rng = np.random.default_rng(0)
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)})
    split = datasets.Dataset.from_dict(
        {
            "img": [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(32)],
            "label": [i % 10 for i in range(32)],
        },
        features=features,
    )
    datasets.DatasetDict(train=split, test=split).save_to_disk(str(tmp_path / "cifar10"))

    run = zoo_cli(
        "fit",
        "--config",
        str(REPO / "configs/timm/resnet50_cifar10.yaml"),
        "--trainer.accelerator=cpu",
        "--trainer.precision=32-true",
        "--trainer.max_epochs=1",
        "--trainer.strategy.init_args.chunks=2",
        "--model.init_args.pretrained=resnet50.safetensors",
        f"--model.init_args.model_kwargs={json.dumps(tiny)}",
        "--model.init_args.image_size=32",
        "--model.init_args.lr=0.0",  # every weight stays as loaded (a frozen backbone would leave stage 0 idle)
        "--data.init_args.source=cifar10",
        "--data.init_args.image_size=32",
        "--data.init_args.cutout=16",
        "--data.init_args.batch_size=8",
        "--data.init_args.num_workers=0",
        cwd=tmp_path,
    )

    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    (last,) = (tmp_path / "out/zoo/timm-resnet50_cifar10").rglob("last.ckpt")
    checkpoint = torch.load(last, weights_only=True)
    assert checkpoint["zoo_model"] == "timm"
    state = checkpoint["state_dict"]
    head = [key for key in state if key.endswith(".weight") and state[key].shape == (10, 128)]
    assert len(head) == 1  # the new classifier: 10 classes on ResNet-50's 4 x 32 pooled features
    # With lr = 0 the checkpoint's backbone weights are the file's, not a fresh initialization (the BatchNorm
    # statistics moved with training and are left out).
    prefix = head[0].rsplit(".", 1)[0] + "."
    weights = [value for key, value in state.items() if not key.startswith(prefix) and "running_" not in key]
    weights = [value for value in weights if value.is_floating_point()]
    expected = [value for key, value in original.named_parameters() if not key.startswith("fc.")]
    assert len(weights) == len(expected)
    assert sorted(w.sum().item() for w in weights) == pytest.approx(sorted(e.sum().item() for e in expected), abs=1e-5)


@RunIf(multiprocess=True)
@pytest.mark.timeout(900)
def test_the_language_model_config_fine_tunes_a_local_model_on_local_text_with_two_stages(tmp_path: Path) -> None:
    # `python -m zoo fit` had no language-model config or data module. The shipped config, as its comment says to run
    # it, on a local text file instead of the embedded corpus, for two steps.
    from zoo.hf.causal_lm_tiny import main as save_tiny

    source = save_tiny([str(tmp_path / "out/zoo/tiny-causal-lm"), "--layers", "2"])  # where the config reads it
    lines = [f"sentence number {index} is about {'cats' if index % 2 else 'dogs'}." for index in range(64)]
    (tmp_path / "train.txt").write_text("\n".join(lines), encoding="utf-8")
    run = zoo_cli(
        "fit",
        "--config",
        str(REPO / "configs/causal_lm/finetune_local.yaml"),
        "--trainer.max_steps=2",
        "--data.init_args.source=train.txt",
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    checkpoint = torch.load(tmp_path / "out/zoo/causal-lm-local/lm/last.ckpt", weights_only=True)
    assert checkpoint["zoo_model"] == "hf_causal_lm"
    assert checkpoint["global_step"] == 2
    assert checkpoint["hyper_parameters"]["name_or_path"] == "out/zoo/tiny-causal-lm"
    assert (source / "tokenizer.json").is_file()
