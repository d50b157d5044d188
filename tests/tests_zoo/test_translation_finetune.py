"""Fine-tuning a Transformer on a new language pair: backbone bit for bit, fresh softmax, frozen stays frozen.

The documented path (``docs/zoo/transformer.md``): pretrain on en-xa, then ``zoo.load_pretrained(path)`` and train on
xa-en, a direction the pretrained tokenizer already knows, with the checkpoint's tokenizer restored into the new data
module through its ``load_state_dict``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

import zoo
from zoo.backbone import read_checkpoint
from zoo.data.translation import TranslationDataModule
from zoo.tasks.language_model import TransformerLM
from zoo.tasks.translation import Transformer

TINY = {"num_layers": 2, "ff_dim": 32, "num_heads": 2, "d_model": 16, "head_dim": 8, "dropout": 0.0}
SIZES = {"xa": 200}
HEAD = "layers.8."  # the softmax of a 2-layer T: entry 2L + 4


def fit(model: L.LightningModule, datamodule: L.LightningDataModule, steps: int = 3) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=datamodule)
    return trainer


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    datamodule = TranslationDataModule(pairs=["en-xa"], embedded_sizes=SIZES, vocab_size=300, batch_size=8)
    datamodule.setup("fit")
    assert datamodule.tokenizer is not None
    torch.manual_seed(0)
    model = Transformer(**TINY, vocab_size=datamodule.tokenizer.vocab_size, lr=1e-2, warmup_steps=1)
    trainer = fit(model, datamodule)
    path = tmp_path_factory.mktemp("pretrained") / "last.ckpt"
    trainer.save_checkpoint(path)
    return path


def new_pair_data(checkpoint: dict[str, Any], pair: str) -> TranslationDataModule:
    datamodule = TranslationDataModule(pairs=[pair], embedded_sizes=SIZES, batch_size=8)
    datamodule.load_state_dict(checkpoint["TranslationDataModule"])  # the pretrained tokenizer, not a new one
    datamodule.setup("fit")
    return datamodule


def test_frozen_fine_tuning_on_a_new_pair_trains_only_the_fresh_softmax(pretrained: Path) -> None:
    checkpoint = read_checkpoint(pretrained)
    saved = checkpoint["state_dict"]
    model = zoo.load_pretrained(pretrained, freeze_backbone=True, architecture="transformer", lr=1e-2)
    assert isinstance(model, Transformer)
    heads = {key for key in model.state_dict() if key.startswith(HEAD)}
    assert heads == {HEAD + "projection.weight", HEAD + "projection.bias"}
    assert set(model.load_report.fresh) == heads
    assert set(model.load_report.skipped) == heads
    assert not torch.equal(model.state_dict()[HEAD + "projection.weight"], saved[HEAD + "projection.weight"])
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    assert trainable == heads

    datamodule = new_pair_data(checkpoint, "xa-en")
    fresh_head = model.state_dict()[HEAD + "projection.weight"].clone()
    fit(model, datamodule)
    after = model.state_dict()
    for key in set(after) - heads:
        assert torch.equal(after[key], saved[key]), key  # bit-identical before and after fine-tuning
    assert not torch.equal(after[HEAD + "projection.weight"], fresh_head)


def test_unfrozen_fine_tuning_trains_the_whole_model_from_the_pretrained_weights(pretrained: Path) -> None:
    checkpoint = read_checkpoint(pretrained)
    saved = checkpoint["state_dict"]
    model = zoo.load_pretrained(pretrained, lr=1e-2)
    assert all(parameter.requires_grad for parameter in model.parameters())
    for key, value in model.state_dict().items():
        if not key.startswith(HEAD):
            assert torch.equal(value, saved[key]), key
    fit(model, new_pair_data(checkpoint, "xa-en"))
    embedding = next(key for key in saved if key.startswith("layers.0."))
    assert not torch.equal(model.state_dict()[embedding], saved[embedding])


def test_a_pair_whose_language_the_pretrained_tokenizer_lacks_is_refused(pretrained: Path) -> None:
    with pytest.raises(ValueError, match="Language 'xb' has no <2xb> token"):
        new_pair_data(read_checkpoint(pretrained), "en-xb")


def test_the_language_model_freezes_all_but_its_softmax(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TransformerLM(num_layers=2, d_model=16, ff_dim=32, num_heads=2, vocab_size=50)
    path = tmp_path / "lm.ckpt"
    torch.save(
        {"state_dict": model.state_dict(), "zoo_model": "transformer_lm", "hyper_parameters": dict(model.hparams)}, path
    )
    tuned = zoo.load_pretrained(path, freeze_backbone=True)
    assert isinstance(tuned, TransformerLM)
    trainable = {name for name, parameter in tuned.named_parameters() if parameter.requires_grad}
    assert trainable == {"layers.3.projection.weight", "layers.3.projection.bias"}
    optimizer = tuned.configure_optimizers()["optimizer"]
    assert {id(p) for group in optimizer.param_groups for p in group["params"]} == {
        id(p) for p in tuned.parameters() if p.requires_grad
    }
