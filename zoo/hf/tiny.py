"""Tiny random-initialized Hugging Face translation models, saved in the real on-disk format, for offline use.

Tests and the notebook cannot download a hub model, so they make one: a SentencePiece model trained in well under a
second on the given sentences, the family's tokenizer files around it (``vocab.json`` plus ``sentencepiece.bpe.model``
for M2M-100, ``source.spm``/``target.spm`` plus ``vocab.json`` for Marian), and a ``transformers`` model of a few
thousand parameters written by ``save_pretrained`` (``config.json`` and ``model.safetensors``). The directory then
loads with ``AutoModelForSeq2SeqLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` exactly as a hub id does.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sentencepiece
import torch
from transformers import (
    M2M100Config,
    M2M100ForConditionalGeneration,
    M2M100Tokenizer,
    MarianConfig,
    MarianMTModel,
    MarianTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

__all__ = ["FAMILIES", "save_tiny_translation_model"]

FAMILIES = ("m2m_100", "marian")


def _train_sentencepiece(texts: Sequence[str], vocab_size: int) -> tuple[bytes, list[str]]:
    """A small unigram SentencePiece model of ``texts`` (serialized) and its pieces, controls left out."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="unigram",
        character_coverage=1.0,
        hard_vocab_limit=False,  # a handful of sentences may not support vocab_size pieces
        minloglevel=2,
    )
    processor = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    pieces = [
        processor.id_to_piece(i)
        for i in range(processor.get_piece_size())
        if not (processor.is_control(i) or processor.is_unknown(i))
    ]
    return model.getvalue(), pieces


def save_tiny_translation_model(
    directory: str | Path,
    texts: Sequence[str],
    family: str = "m2m_100",
    *,
    d_model: int = 16,
    layers: int = 2,
    heads: int = 2,
    ff_dim: int = 32,
    vocab_size: int = 64,
    dropout: float = 0.0,
    seed: int = 0,
) -> Path:
    """Write a random-initialized ``family`` model (``"m2m_100"`` or ``"marian"``) and its tokenizer to ``directory``.

    ``texts`` trains the SentencePiece vocabulary (about ``vocab_size`` pieces). The model has ``layers`` encoder and
    decoder layers of width ``d_model``; its vocabulary is the tokenizer's (M2M-100 adds its 100 language tokens and
    8 spare ones after the pieces). ``dropout`` sets every dropout and layer drop. Returns the directory.
    """
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not supported; use one of {', '.join(map(repr, FAMILIES))}")
    if not texts:
        raise ValueError("texts is empty: give a few sentences to train the tokenizer's vocabulary on")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    spm, pieces = _train_sentencepiece(texts, vocab_size)
    shape: dict[str, Any] = {
        "d_model": d_model,
        "encoder_layers": layers,
        "decoder_layers": layers,
        "encoder_attention_heads": heads,
        "decoder_attention_heads": heads,
        "encoder_ffn_dim": ff_dim,
        "decoder_ffn_dim": ff_dim,
        "max_position_embeddings": 128,
        "dropout": dropout,
        "attention_dropout": dropout,
        "activation_dropout": dropout,
        "encoder_layerdrop": dropout,
        "decoder_layerdrop": dropout,
    }
    torch.manual_seed(seed)
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    if family == "m2m_100":
        vocab = {token: index for index, token in enumerate(["<s>", "<pad>", "</s>", "<unk>", *pieces])}
        (out / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
        (out / "sentencepiece.bpe.model").write_bytes(spm)
        m2m_tokenizer = M2M100Tokenizer(str(out / "vocab.json"), str(out / "sentencepiece.bpe.model"))
        tokenizer = m2m_tokenizer
        m2m_config = M2M100Config(
            vocab_size=len(vocab) + len(m2m_tokenizer.lang_code_to_id) + m2m_tokenizer.num_madeup_words,
            bos_token_id=0,
            pad_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=2,
            **shape,
        )
        model = M2M100ForConditionalGeneration(m2m_config)
    else:
        vocab = {token: index for index, token in enumerate(["</s>", "<unk>", *pieces, "<pad>"])}
        (out / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
        for name in ("source.spm", "target.spm"):
            (out / name).write_bytes(spm)
        tokenizer = MarianTokenizer(str(out / "source.spm"), str(out / "target.spm"), str(out / "vocab.json"))
        pad = vocab["<pad>"]
        marian_config = MarianConfig(
            vocab_size=len(vocab),
            decoder_vocab_size=len(vocab),
            pad_token_id=pad,
            eos_token_id=0,
            decoder_start_token_id=pad,
            forced_eos_token_id=0,
            **shape,
        )
        model = MarianMTModel(marian_config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
