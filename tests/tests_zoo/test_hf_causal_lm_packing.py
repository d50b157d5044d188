"""Packed batches (``DataCollatorWithFlattening``) through the zoo's language models, the library's forward on the same
batch the oracle.

Regression: a packed batch (``position_ids``, no ``attention_mask``) was accepted and its ``position_ids`` ignored, so
positions ran on across the packed sequences and attention crossed them, where the library's forward restarts both.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zoo

transformers = pytest.importorskip("transformers")

from zoo.hf.causal_lm_tiny import CAUSAL_FAMILIES, save_tiny_causal_lm  # noqa: E402

LENGTHS = [5, 7, 3, 6]  # longer than the tiny models' sliding window (4 tokens)


@pytest.fixture(scope="module", params=CAUSAL_FAMILIES)
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_causal_lm(tmp_path_factory.mktemp(request.param), request.param, init_std=0.3)


def packed(lengths: list[int] = LENGTHS) -> dict[str, torch.Tensor]:
    """One row of sequences of ``lengths`` tokens, as ``DataCollatorWithFlattening`` packs them."""
    generator = torch.Generator().manual_seed(0)
    features = [{"input_ids": torch.randint(3, 96, (length,), generator=generator).tolist()} for length in lengths]
    return transformers.DataCollatorWithFlattening()(features)


def test_a_packed_batch_gives_the_library_s_logits_and_loss(saved: Path) -> None:
    model = zoo.load_pretrained(saved).eval()
    library = transformers.AutoModelForCausalLM.from_pretrained(saved).eval()
    batch = packed()
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    # use_cache=False: given none, the library's forward makes a key/value cache (its config's use_cache), and with a
    # cache its mask functions do not look for packed sequences, so attention would cross them there.
    expected = library(**batch, use_cache=False)
    with torch.no_grad():
        logits = model(batch["input_ids"], position_ids=batch["position_ids"])
        torch.testing.assert_close(logits, expected.logits, atol=1e-4, rtol=0)
        model.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
        torch.testing.assert_close(model.training_step(batch, 0), expected.loss, atol=1e-5, rtol=0)
        # Attention stays within each sequence, and positions restart: each one's logits are its own, alone.
        start = 0
        for length in LENGTHS:
            alone = model(batch["input_ids"][:, start : start + length])
            torch.testing.assert_close(logits[:, start : start + length], alone, atol=1e-4, rtol=0)
            start += length


def test_a_packed_batch_without_labels_learns_no_token_across_sequences(saved: Path) -> None:
    # The last token of a sequence does not learn the first of the next one, as with the collator's labels.
    model = zoo.load_pretrained(saved).eval()
    model.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    batch = packed()
    unlabelled = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    assert (
        int(model.batch_loss_weight(unlabelled)) == int(model.batch_loss_weight(batch)) == sum(LENGTHS) - len(LENGTHS)
    )
    with torch.no_grad():
        torch.testing.assert_close(model.training_step(unlabelled, 0), model.training_step(batch, 0))
