"""Translation quality: a short fit on the embedded corpus reaches a stated BLEU, far above an untrained model's.

Measured (also in ``docs/zoo/transformer_experiments.md``): after 300 steps (batch 32) of T(2, 256, 4) with d_model 64
on en-xa (3,000 training pairs), greedy BLEU on the first 100 test sentences was 86.8 / 80.4 / 85.0 for seeds
0 / 1 / 2 (mean 84.1), and 0.01-0.02 before training. The test asks for half the mean and 10 points over the
untrained model. It takes about 15 s on an idle core and up to 80 s on the loaded 2-core development machine.
"""

from __future__ import annotations

import lightning as L
import pytest

from zoo.data.translation import TranslationDataModule
from zoo.evaluation import evaluate_translation
from zoo.tasks.translation import Transformer

PAIR = "en-xa"
TRAIN_STEPS = 300
EVAL_SENTENCES = 100
MEASURED_BLEU = 84.1  # mean over seeds 0, 1, 2, see the module docstring
UNTRAINED_BLEU_MAX = 1.0


def tiny_setup(seed: int) -> tuple[Transformer, TranslationDataModule]:
    L.seed_everything(seed, verbose=False)
    datamodule = TranslationDataModule(
        pairs=[PAIR],
        embedded_sizes={"xa": 3000},
        vocab_size=600,
        batch_size=32,
        max_length=48,
        seed=seed,
        num_samples=TRAIN_STEPS * 32,
    )
    datamodule.setup("fit")
    assert datamodule.tokenizer is not None
    model = Transformer(
        num_layers=2,
        ff_dim=256,
        num_heads=4,
        d_model=64,
        head_dim=16,
        vocab_size=datamodule.tokenizer.vocab_size,
        dropout=0.0,
        lr=3e-3,
        warmup_steps=60,
    )
    return model, datamodule


def fit_tiny(model: Transformer, datamodule: TranslationDataModule) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=TRAIN_STEPS,
        max_epochs=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=datamodule)


def bleu(model: Transformer, datamodule: TranslationDataModule) -> float:
    return evaluate_translation(model, datamodule, beam_size=1, limit=EVAL_SENTENCES)[PAIR]


@pytest.mark.heavy  # a real training run: in make test, not in make test-fast
@pytest.mark.timeout(240)
def test_a_short_fit_on_the_embedded_corpus_reaches_the_stated_bleu() -> None:
    model, datamodule = tiny_setup(seed=0)
    untrained = bleu(model, datamodule)
    fit_tiny(model, datamodule)
    trained = bleu(model, datamodule)
    assert untrained < UNTRAINED_BLEU_MAX
    assert trained >= MEASURED_BLEU / 2, f"BLEU {trained:.2f} after {TRAIN_STEPS} steps; measured {MEASURED_BLEU}"
    assert trained >= untrained + 10, f"BLEU {trained:.2f} after {TRAIN_STEPS} steps, {untrained:.2f} before"
