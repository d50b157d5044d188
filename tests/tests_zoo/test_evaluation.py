"""Evaluation of the Transformers: batched translation, BLEU per pair, perplexity, and the checkpoint command line."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from torchmetrics.text import Perplexity

from zoo.data.language_model import LanguageModelDataModule
from zoo.data.translation import TranslationDataModule
from zoo.evaluation import (
    evaluate_perplexity,
    evaluate_translation,
    load_for_evaluation,
    main,
    translate,
    translate_ids,
)
from zoo.tasks.language_model import TransformerLM
from zoo.tasks.translation import Transformer
from zoo.transformer.decoding import EOS_ID, greedy_decode

PAIRS = ["en-xa", "en-xb"]
TINY = {"num_layers": 1, "ff_dim": 32, "num_heads": 2, "d_model": 16, "head_dim": 8, "dropout": 0.0}


@pytest.fixture(scope="module")
def translation_data() -> TranslationDataModule:
    datamodule = TranslationDataModule(
        pairs=PAIRS, embedded_sizes={"xa": 200, "xb": 100}, vocab_size=300, batch_size=8, max_length=40
    )
    datamodule.setup("fit")
    return datamodule


@pytest.fixture(scope="module")
def translation_model(translation_data: TranslationDataModule) -> Transformer:
    torch.manual_seed(0)
    assert translation_data.tokenizer is not None
    return Transformer(**TINY, vocab_size=translation_data.tokenizer.vocab_size)


def fit_briefly(model: L.LightningModule, datamodule: L.LightningDataModule, root: Path) -> Path:
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(model, datamodule=datamodule)
    trainer.save_checkpoint(root / "last.ckpt")
    return root / "last.ckpt"


def test_batched_translation_keeps_the_order_and_decodes_each_source_as_alone(
    translation_model: Transformer, translation_data: TranslationDataModule
) -> None:
    sources = translation_data.encode_sources("en-xa")[:6]
    batched = translate_ids(translation_model, sources, beam_size=1, max_len=6, batch_size=4)
    for row, ids in enumerate(batched):
        alone = sources[row : row + 1, : int((sources[row] != 0).sum())]
        expected = greedy_decode(translation_model, alone, 6)[0].tolist()
        assert ids == (expected[: expected.index(EOS_ID)] if EOS_ID in expected else expected)


def test_raw_sentences_translate_as_the_encoded_test_sources(
    translation_model: Transformer, translation_data: TranslationDataModule
) -> None:
    tokenizer = translation_data.tokenizer
    assert tokenizer is not None
    sentences = translation_data.sources("en-xb")[:5]
    ids = translate_ids(translation_model, translation_data.encode_sources("en-xb")[:5], beam_size=2, max_len=6)
    assert translate(translation_model, tokenizer, sentences, "xb", beam_size=2, max_len=6) == tokenizer.decode_batch(
        ids
    )
    with pytest.raises(TypeError, match="not one string"):
        translate(translation_model, tokenizer, "The dog sees a cat.", "xb")


def test_bleu_is_reported_per_directed_pair_with_their_mean(
    translation_model: Transformer, translation_data: TranslationDataModule
) -> None:
    scores = evaluate_translation(translation_model, translation_data, "validation", beam_size=1, max_len=4, limit=5)
    assert list(scores) == [*PAIRS, "mean"]
    assert scores["mean"] == pytest.approx(sum(scores[pair] for pair in PAIRS) / 2)
    only = evaluate_translation(translation_model, translation_data, beam_size=1, max_len=4, limit=5, pairs=["en-xb"])
    assert list(only) == ["en-xb", "mean"]
    with pytest.raises(ValueError, match="split='dev' must be one of"):
        evaluate_translation(translation_model, translation_data, "dev")
    with pytest.raises(ValueError, match="limit=0 must be at least 1"):
        evaluate_translation(translation_model, translation_data, limit=0)
    with pytest.raises(ValueError, match="beam_size=0 must be at least 1"):
        evaluate_translation(translation_model, translation_data, beam_size=0)


def test_the_command_line_rebuilds_model_and_tokenizer_from_a_checkpoint(
    translation_model: Transformer, translation_data: TranslationDataModule, tmp_path: Path
) -> None:
    path = fit_briefly(translation_model, translation_data, tmp_path)
    model, datamodule = load_for_evaluation(path)
    assert isinstance(model, Transformer)
    assert isinstance(datamodule, TranslationDataModule)
    assert datamodule.tokenizer is not None
    assert translation_data.tokenizer is not None
    assert datamodule.tokenizer.to_json() == translation_data.tokenizer.to_json()
    for key, value in translation_model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    # Regression: LightningCLI saves "_class_path" and "_instantiator" among the hyper-parameters.
    from_cli = torch.load(path, weights_only=True)
    for key in ("hyper_parameters", "datamodule_hyper_parameters"):
        from_cli[key] |= {"_class_path": "zoo.Transformer", "_instantiator": "lightning.pytorch.cli.instantiate_module"}
    torch.save(from_cli, tmp_path / "cli.ckpt")
    assert isinstance(load_for_evaluation(tmp_path / "cli.ckpt")[0], Transformer)
    printed = main(["--checkpoint", str(path), "--beam-size", "2", "--max-len", "5", "--limit", "4"])
    assert printed == evaluate_translation(translation_model, translation_data, beam_size=2, max_len=5, limit=4)


def test_a_checkpoint_without_a_tokenizer_is_refused(translation_model: Transformer, tmp_path: Path) -> None:
    path = tmp_path / "bare.ckpt"
    torch.save({"state_dict": translation_model.state_dict(), "zoo_model": "transformer"}, path)
    with pytest.raises(ValueError, match="holds no tokenizer"):
        load_for_evaluation(path)


def test_perplexity_is_the_exponential_of_the_mean_token_nll_over_the_split(tmp_path: Path) -> None:
    datamodule = LanguageModelDataModule(languages=["xa"], embedded_sizes={"xa": 100}, vocab_size=300, batch_size=16)
    datamodule.setup("fit")
    assert datamodule.tokenizer is not None
    torch.manual_seed(0)
    model = TransformerLM(**TINY, vocab_size=datamodule.tokenizer.vocab_size)
    path = fit_briefly(model, datamodule, tmp_path)
    reference = Perplexity(ignore_index=0)
    model.eval()
    with torch.no_grad():
        for batch in datamodule.test_dataloader():
            reference.update(model(batch[:, :-1]), batch[:, 1:])
    ppl = evaluate_perplexity(model, datamodule, "test")
    assert ppl == pytest.approx(float(reference.compute()), rel=1e-4)
    assert 1.0 < ppl < 2 * datamodule.tokenizer.vocab_size
    assert math.isclose(main(["--checkpoint", str(path)])["perplexity"], ppl, rel_tol=1e-5)


def test_validation_reports_loss_and_token_accuracy_for_each_pair(
    translation_model: Transformer, translation_data: TranslationDataModule
) -> None:
    # Regression: validation_step had no dataloader_idx, and Lightning refuses a data module with one validation
    # loader per pair without it.
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.validate(translation_model, datamodule=translation_data, verbose=False)
    metrics = trainer.callback_metrics
    translation_model.eval()
    for index, pair in enumerate(PAIRS):
        correct, tokens = 0, 0
        with torch.no_grad():
            for source, target in translation_data.val_dataloader()[index]:
                predicted = translation_model(source, target[:, :-1]).argmax(dim=-1)
                mask = target[:, 1:] != 0
                correct += int(((predicted == target[:, 1:]) & mask).sum())
                tokens += int(mask.sum())
        assert metrics[f"val_acc/dataloader_idx_{index}"].item() == pytest.approx(correct / tokens, rel=1e-5), pair
        assert metrics[f"val_loss/dataloader_idx_{index}"].item() > 0
