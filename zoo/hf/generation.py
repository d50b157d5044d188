"""Greedy translation and BLEU per language pair for a :class:`~zoo.tasks.pretrained_translation.PretrainedTranslator`.

Shape legend: B batch, S source length, T decoded length.

Decoding runs on the whole model after ``fit``, or inside a ``validation_step`` / ``predict_step`` under
``GPipeStrategy``, where every token calls the whole pipelined sequence
(:class:`~zoo.transformer.decoding.PrefixScorer`). On the whole model the encoder runs once; the decoder re-reads the
growing prefix at every step (no key/value cache), which is exact and fine at sentence lengths. It reproduces
``transformers``' ``generate(num_beams=1, do_sample=False, bad_words_ids=[[pad]])``: the decoder starts from
``decoder_start_token_id`` and the target-language ``prefix`` (M2M-100's forced ``__de__`` token), never emits
padding, forces the config's ``forced_eos_token_id`` (Marian's ``</s>``) at the last step, and each row stops at
``</s>``; finished rows are padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from zoo.bleu import bleu_by_pair
from zoo.transformer.decoding import PrefixScorer

if TYPE_CHECKING:  # zoo.tasks.pretrained_translation imports zoo.hf, whose package imports this module
    from zoo.tasks.pretrained_translation import PretrainedTranslator

__all__ = ["evaluate_pretrained_translation", "greedy_generate"]


def greedy_generate(
    model: PretrainedTranslator, source: torch.Tensor, prefix: Sequence[int] = (), max_new_tokens: int = 64
) -> torch.Tensor:
    """Tokens [B, 1 + len(prefix) + n] (the decoder start and ``prefix`` included) for ``source`` [B, S], with at
    most ``max_new_tokens`` generated after the prefix, as ``generate`` returns them."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
    was_training = model.training
    model.train(False)
    try:
        with torch.no_grad():
            scorer = PrefixScorer(model, source)
            start = [model.decoder_start_id, *prefix]
            tokens = torch.tensor(start, device=source.device).repeat(source.shape[0], 1)  # [B, t]
            done = torch.zeros(source.shape[0], dtype=torch.bool, device=source.device)
            forced_eos = model.hparams["config"].get("forced_eos_token_id")
            for index in range(max_new_tokens):
                logits = scorer.logits(tokens)  # [B, V]
                logits[:, model.pad_id] = float("-inf")
                step = logits.argmax(dim=-1)
                if forced_eos is not None and index == max_new_tokens - 1:
                    step = torch.full_like(step, int(forced_eos))
                step = torch.where(done, model.pad_id, step)
                tokens = torch.cat([tokens, step[:, None]], dim=1)
                done |= step == model.eos_id
                if bool(done.all()):
                    break
    finally:
        model.train(was_training)
    return tokens


def evaluate_pretrained_translation(
    model: PretrainedTranslator,
    datamodule: object,
    split: str = "test",
    *,
    limit: int | None = None,
    max_new_tokens: int | None = None,
    batch_size: int = 32,
) -> dict[str, float]:
    """sacrebleu BLEU of every directed pair of ``datamodule`` (a set-up
    :class:`~zoo.hf.data.PretrainedTranslationDataModule`) on ``split``, greedy, plus their unweighted ``"mean"``.

    ``limit`` scores the first sentences of each pair only; ``max_new_tokens`` defaults to the data module's
    ``max_length``. Hypotheses are detokenized by the model's tokenizer, references are the raw, untruncated text.
    """
    from zoo.hf.data import PretrainedTranslationDataModule

    if not isinstance(datamodule, PretrainedTranslationDataModule):
        raise TypeError(f"datamodule must be a PretrainedTranslationDataModule, not {type(datamodule).__name__}")
    tokenizer = datamodule._require_library_tokenizer()
    hypotheses: dict[str, list[str]] = {}
    references: dict[str, list[str]] = {}
    device = next(model.parameters()).device
    for pair in datamodule.directed_pairs:
        sources = datamodule.encode_sources(pair, split)[:limit]
        prefix = datamodule.target_prefix(pair)
        texts: list[str] = []
        for start in range(0, len(sources), batch_size):
            batch = sources[start : start + batch_size].to(device)
            length = int((batch != model.pad_id).sum(dim=1).max())
            out = greedy_generate(model, batch[:, :length], prefix, max_new_tokens or datamodule.max_length)
            texts += tokenizer.batch_decode(out.tolist(), skip_special_tokens=True)
        hypotheses[pair] = texts
        references[pair] = datamodule.references(pair, split)[:limit]
    scores = bleu_by_pair(hypotheses, references)
    scores["mean"] = sum(scores.values()) / len(scores)
    return scores
