"""Fine-tuning semantics: the backbone loads bit for bit, heads are new and sized for the task, frozen stays frozen."""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.runif import RunIf
from helpers.zoo_job import Repeated, fit
from helpers.zoo_tiny import TINY, tiny_batch
from torch.utils.data import DataLoader

import zoo
from zoo.tasks.classification import AmoebaNetB, AmoebaNetD

NAME = "amoebanet_d"
NEW_CLASSES = 3


@pytest.fixture(scope="module")
def plain_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pretrained")
    fit(NAME, 1, "auto", 1, root)
    return root / f"{NAME}.ckpt"


def is_head(model: zoo.ZooModule, key: str) -> bool:
    return any(key.startswith(prefix + ".") for prefix in model.head_prefixes())


def check_backbone_loaded_and_heads_new(checkpoint: Path) -> None:
    saved = torch.load(checkpoint, weights_only=True)["state_dict"]
    model = zoo.load_pretrained(checkpoint, num_classes=NEW_CLASSES)
    assert isinstance(model, AmoebaNetD)
    state = model.state_dict()
    backbone = [key for key in state if not is_head(model, key)]
    heads = [key for key in state if is_head(model, key)]
    assert len(heads) == 4  # weight and bias of the classifier and of the aux classifier
    for key in backbone:
        assert torch.equal(state[key], saved[key]), key  # bit-identical
    for key in heads:
        assert state[key].shape[0] == NEW_CLASSES, key
        assert saved[key].shape[0] == TINY[NAME]["num_classes"]
    assert set(model.load_report.loaded) == set(backbone)
    assert set(model.load_report.fresh) == set(heads)
    assert set(model.load_report.skipped) == set(heads)
    assert model.hparams["num_classes"] == NEW_CLASSES
    logits = model.eval()(tiny_batch(NAME)[0])
    assert logits.shape == (8, NEW_CLASSES)


def test_a_plain_checkpoint_loads_its_backbone_bit_for_bit_with_new_heads(plain_checkpoint: Path) -> None:
    check_backbone_loaded_and_heads_new(plain_checkpoint)


@RunIf(multiprocess=True)
@pytest.mark.timeout(900)
def test_a_checkpoint_written_by_two_stages_loads_the_same_way(gpipe_runs: Path) -> None:
    check_backbone_loaded_and_heads_new(gpipe_runs / f"{NAME}.ckpt")


def test_new_heads_are_freshly_initialized_not_copied(plain_checkpoint: Path) -> None:
    saved = torch.load(plain_checkpoint, weights_only=True)["state_dict"]
    model = zoo.load_pretrained(plain_checkpoint)  # same number of classes: the heads are still new
    for key in model.load_report.fresh:
        assert not torch.equal(model.state_dict()[key], saved[key]) or key.endswith("bias"), key


def test_a_frozen_backbone_stays_frozen_through_training(plain_checkpoint: Path, tmp_path: Path) -> None:
    model = zoo.load_pretrained(plain_checkpoint, num_classes=NEW_CLASSES, freeze_backbone=True, lr=0.05)
    trainable = {key for key, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(model.load_report.fresh)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    images, labels = tiny_batch(NAME)
    trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(model, DataLoader(Repeated((images, labels % NEW_CLASSES), 3), batch_size=len(labels)))
    after = model.state_dict()
    for key, value in before.items():
        if key in model.load_report.fresh:
            continue
        assert torch.equal(after[key], value), f"{key} changed although the backbone is frozen"
    assert any(not torch.equal(after[key], before[key]) for key in model.load_report.fresh)


def test_the_pretrained_argument_loads_the_backbone_as_load_pretrained_does(plain_checkpoint: Path) -> None:
    by_argument = AmoebaNetD(**{**TINY[NAME], "num_classes": NEW_CLASSES}, pretrained=str(plain_checkpoint))
    by_function = zoo.load_pretrained(plain_checkpoint, num_classes=NEW_CLASSES)
    for key in by_function.load_report.loaded:
        assert torch.equal(by_argument.state_dict()[key], by_function.state_dict()[key]), key


def test_a_checkpoint_of_another_architecture_is_refused(plain_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match=r"holds a 'amoebanet_d' model, not the expected 'amoebanet_b'"):
        zoo.load_pretrained(plain_checkpoint, num_classes=NEW_CLASSES, architecture="amoebanet_b")
    with pytest.raises(ValueError, match=r"the checkpoint holds a 'amoebanet_d' model, not 'amoebanet_b'"):
        AmoebaNetB(**TINY["amoebanet_b"], pretrained=str(plain_checkpoint))
    wider = {**TINY[NAME], "num_filters": 16}
    with pytest.raises(
        ValueError, match=r"does not fit this 'amoebanet_d' model \(.*shape \(checkpoint vs model\): layers\.1\.base"
    ):
        AmoebaNetD(**wider, pretrained=str(plain_checkpoint))


def test_a_checkpoint_that_is_not_from_the_zoo_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {"layers.0.weight": torch.zeros(2)}}, path)
    with pytest.raises(ValueError, match=r"was not written by a zoo model \(no 'zoo_model' entry\)"):
        zoo.load_pretrained(path, num_classes=2)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at '.*missing.ckpt'"):
        zoo.load_pretrained(tmp_path / "missing.ckpt")


def test_a_missing_local_path_is_not_taken_for_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: every missing source without a checkpoint suffix went to the Hugging Face hub, so a mistyped
    # directory gave the hub's repo-id error (offline, a network error) naming neither the path nor what is accepted.
    from zoo.hf import is_hf_source

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for source in (str(tmp_path / "m2m100"), tmp_path / "m2m100", "./m2m100", "~/m2m100", "models/en-de/m2m100"):
        assert not is_hf_source(source), source
        named = str(tmp_path / "home" / "m2m100") if source == "~/m2m100" else str(source)
        message = (
            rf"no checkpoint at {re.escape(repr(named))}: no such file or directory\. zoo\.load_pretrained "
            r"takes a checkpoint file written by Trainer\.save_checkpoint, a save_pretrained directory, "
            r"'timm/<model name>', or a Hugging Face hub id 'org/name' \(e\.g\. 'facebook/m2m100_418M'\); a source "
            r"that starts with '\.', '/' or '~', has more than one '/' or is a Path is read as a local path"
        )
        with pytest.raises(FileNotFoundError, match=message):
            zoo.load_pretrained(source)
    assert is_hf_source("facebook/m2m100_418M")
    assert is_hf_source("t5-small")  # the hub's older ids have no organization
    # "~" is the home directory, as in a shell: this file is found and read (and refused, not being a zoo model's).
    (tmp_path / "home").mkdir()
    torch.save({"state_dict": {}}, tmp_path / "home" / "plain.ckpt")
    with pytest.raises(ValueError, match=r"home/plain\.ckpt' was not written by a zoo model"):
        zoo.load_pretrained("~/plain.ckpt")


class RunsCode:
    """Unpickling this object would create a file: a stand-in for a malicious checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, ...]]:
        return os.system, (f"touch {self.marker}",)


def test_a_file_whose_unpickling_would_run_code_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.ckpt"
    torch.save(
        {"state_dict": {}, "zoo_model": NAME, "payload": RunsCode(marker)},
        path,
        pickle_protocol=pickle.HIGHEST_PROTOCOL,
    )
    with pytest.raises(
        ValueError, match=r"refusing to load '.*evil.ckpt': it is not a checkpoint that loads with weights_only=True"
    ):
        zoo.load_pretrained(path, num_classes=2)
    assert not marker.exists()
