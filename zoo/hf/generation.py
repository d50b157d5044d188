"""Greedy and beam-search translation and BLEU per language pair for a
:class:`~zoo.tasks.pretrained_translation.PretrainedTranslator`.

Shape legend: B batch, S source length, T decoded length.

Decoding runs in rounds with the library's ``EncoderDecoderCache`` in each decoder layer
(:mod:`zoo.transformer.search`): the encoder runs once, then each round feeds one token per row. On the whole model
the rounds run here; inside a ``validation_step`` / ``predict_step`` under ``GPipeStrategy`` every stage runs them with
its own layers and caches, micro-batches in flight, with the same tokens. :func:`greedy_generate` reproduces
``transformers``' ``generate(num_beams=1, do_sample=False, bad_words_ids=[[pad]])``: the decoder starts from
``decoder_start_token_id`` and the target-language ``prefix`` (M2M-100's forced ``__de__`` token), never emits
padding, forces the config's ``forced_eos_token_id`` (Marian's ``</s>``) at the last step, and each row stops at
``</s>``; finished rows are padded. :func:`beam_generate` searches beams with GNMT's length penalty under the same
rules (:func:`~zoo.transformer.decoding.beam_search`'s algorithm, not ``generate``'s).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from zoo.bleu import bleu_by_pair
from zoo.decoding import run_decoding
from zoo.transformer.decoding import BeamSearchResult
from zoo.transformer.search import Seq2SeqDecoding

if TYPE_CHECKING:  # zoo.tasks.pretrained_translation imports zoo.hf, whose package imports this module
    from zoo.tasks.pretrained_translation import PretrainedTranslator

__all__ = ["beam_generate", "evaluate_pretrained_translation", "greedy_generate"]


def greedy_generate(
    model: PretrainedTranslator, source: torch.Tensor, prefix: Sequence[int] = (), max_new_tokens: int = 64
) -> torch.Tensor:
    """Tokens [B, 1 + len(prefix) + n] (the decoder start and ``prefix`` included) for ``source`` [B, S], with at
    most ``max_new_tokens`` generated after the prefix, as ``generate`` returns them."""
    tokens: torch.Tensor = _run(model, _decoding(model, source, prefix, max_new_tokens))
    return tokens


def beam_generate(
    model: PretrainedTranslator,
    source: torch.Tensor,
    prefix: Sequence[int] = (),
    beam_size: int = 4,
    max_new_tokens: int = 64,
    length_penalty: float = 0.6,
) -> BeamSearchResult:
    """The best of ``beam_size`` hypotheses for each of ``source`` [B, S] by GNMT's length-penalized log-probability:
    its tokens [B, 1 + len(prefix) + n] (the decoder start and ``prefix`` included, padded after ``</s>``) and
    scores [B]."""
    decoding = _decoding(model, source, prefix, max_new_tokens, beam_size, length_penalty)
    tokens, scores = _run(model, decoding)
    start = torch.tensor(decoding.start, device=tokens.device).repeat(tokens.shape[0], 1)
    return BeamSearchResult(torch.cat([start, tokens], dim=1), scores)


def _decoding(
    model: PretrainedTranslator,
    source: torch.Tensor,
    prefix: Sequence[int],
    max_new_tokens: int,
    beam_size: int | None = None,
    length_penalty: float = 0.6,
) -> Seq2SeqDecoding:
    """The decoding call of the library's rules (see the module)."""
    forced_eos = model.hparams["config"].get("forced_eos_token_id")
    return Seq2SeqDecoding(
        source, (model.decoder_start_id, *prefix), model.eos_id, model.pad_id, max_new_tokens, banned=(model.pad_id,),
        forced_eos=None if forced_eos is None else int(forced_eos), beam_size=beam_size, length_penalty=length_penalty,
    )  # fmt: skip


def _run(model: PretrainedTranslator, decoding: Seq2SeqDecoding) -> Any:
    was_training = model.training
    model.train(False)
    try:
        with torch.no_grad():
            return run_decoding(model.layers, decoding)
    finally:
        model.train(was_training)


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
