"""The language-model data module: local text encoded with the model's own tokenizer, batched as the collators do.

Nothing downloads: the texts are local files, a ``save_to_disk`` directory or the embedded corpus, and the tokenizer is
a tiny model's, trained on a few sentences and saved in the hub's format.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

import zoo

pytest.importorskip("transformers")

from zoo.hf.causal_lm_tiny import save_tiny_causal_lm  # noqa: E402
from zoo.hf.data import PretrainedCausalLMDataModule  # noqa: E402

TEXTS = ["the cat sat on the mat.", "a dog runs in the park, far away from home.", "hello world."]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_causal_lm(tmp_path_factory.mktemp("tiny-llama"), "llama", TEXTS, init_std=0.3)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_texts_are_encoded_with_the_tokenizer_and_padded_as_the_collators_do(source: Path, tmp_path: Path) -> None:
    text = write_lines(tmp_path / "train.txt", [*TEXTS, "", "   "])  # blank lines are no texts
    data = PretrainedCausalLMDataModule(str(text), tokenizer=str(source), max_length=12, batch_size=3)
    data.setup("fit")
    tokenizer = data.library_tokenizer
    assert tokenizer is not None
    batch = next(iter(data.train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    lengths = batch["attention_mask"].sum(-1).tolist()
    assert sorted(lengths) == sorted(min(len(tokenizer(t)["input_ids"]) + 1, 12) for t in TEXTS)
    for row, length in zip(batch["input_ids"], lengths, strict=True):
        ends = row[length - 1] == tokenizer.eos_token_id
        assert ends or length == 12, "a text that fits ends with the end-of-sequence token, a longer one is cut"
        assert (row[length:] == tokenizer.pad_token_id).all()  # right padding
    assert torch.equal(batch["labels"], batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100))
    assert data.val_dataloader() == []  # one file: training text only
    model = zoo.load_pretrained(source)
    model.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    assert torch.isfinite(model.training_step(batch, 0))
    assert model.tokenizer is not None
    assert model.tokenizer.padding_side == "left", "the model's own tokenizer keeps its side (generation)"


def test_packed_batches_are_the_flattening_collator_s(source: Path, tmp_path: Path) -> None:
    text = write_lines(tmp_path / "train.txt", TEXTS)
    data = PretrainedCausalLMDataModule(str(text), tokenizer=str(source), batch_size=3, packed=True)
    data.setup("fit")
    batch = data.collate(data._split("train"))
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    lengths = [len(row) for row in data._split("train")]
    assert batch["input_ids"].shape == (1, sum(lengths))
    starts = torch.tensor([sum(lengths[:index]) for index in range(len(lengths))])
    assert (batch["position_ids"][0, starts] == 0).all()
    assert (batch["labels"][0, starts] == -100).all()


def test_splits_come_from_a_directory_of_text_files_or_a_saved_dataset(source: Path, tmp_path: Path) -> None:
    import datasets

    files = tmp_path / "files"
    files.mkdir()
    for split, lines in {"train": TEXTS, "validation": TEXTS[:2], "test": TEXTS[:1]}.items():
        write_lines(files / f"{split}.txt", lines)
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {
            split: datasets.Dataset.from_dict({"content": TEXTS[:n]})
            for split, n in zip(("train", "validation", "test"), (3, 2, 1), strict=True)
        }
    ).save_to_disk(str(saved))
    for folder, column in ((files, "text"), (saved, "content")):
        data = PretrainedCausalLMDataModule(str(folder), tokenizer=str(source), text_column=column, batch_size=2)
        data.setup("fit")
        assert [len(data._split(split)) for split in ("train", "validation", "test")] == [3, 2, 1]
        assert next(iter(data.val_dataloader()))["input_ids"].shape[0] == 2


def test_the_embedded_corpus_gives_english_sentences(source: Path) -> None:
    data = PretrainedCausalLMDataModule("embedded", tokenizer=str(source), limit=40)
    data.setup("fit")
    assert len(data._split("train")) == 40
    assert len(data._split("validation")) > 0


def test_the_tokenizer_is_the_fitted_model_s_by_default(source: Path, tmp_path: Path) -> None:
    data = PretrainedCausalLMDataModule(str(write_lines(tmp_path / "train.txt", TEXTS)), batch_size=3)
    with pytest.raises(ValueError, match=r"has no tokenizer: pass tokenizer=<hub id or directory>, or fit it with"):
        data.setup("fit")  # neither given nor fitted
    model = zoo.load_pretrained(source, lr=1e-2)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    assert data.library_tokenizer is not None
    assert data.library_tokenizer.get_vocab() == model.tokenizer.get_vocab()
    assert data.library_tokenizer is not model.tokenizer, "a copy: the model's keeps its padding side"
    assert trainer.global_step == 1
