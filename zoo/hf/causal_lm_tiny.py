"""Tiny random-initialized Hugging Face decoder-only language models, saved in the real on-disk format, for offline use.

One per supported family (:data:`CAUSAL_FAMILIES`), each a few thousand parameters, with an optional byte-pair
tokenizer trained on a handful of sentences: what the tests, the notebook and the docs load through
``zoo.load_pretrained(directory)``, the code path of a hub id. From the command line (a stand-in for a hub model,
its tokenizer trained on the embedded corpus's English sentences, for ``configs/causal_lm/finetune_local.yaml``)::

    python -m zoo.hf.causal_lm_tiny out/zoo/tiny-causal-lm --family qwen2
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from tokenizers import decoders as token_decoders

__all__ = ["CAUSAL_FAMILIES", "main", "save_tiny_causal_lm", "tiny_causal_config"]

CAUSAL_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text", "phi3", "olmo", "olmo3", "gpt2")
"""The ``model_type`` of every family :func:`save_tiny_causal_lm` writes."""
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0, 1, 2, 3


def tiny_causal_config(
    family: str = "llama", *, hidden_size: int = 32, layers: int = 2, vocab_size: int = 96, dropout: float = 0.0
) -> transformers.PretrainedConfig:
    """A tiny config of ``family``: 4 attention heads over 2 key/value heads (grouped-query attention), pad 0,
    ``<s>`` 1, ``</s>`` 2. Mistral attends within a window of 4 tokens, Qwen2 in its second layer only, Gemma 3 and
    OLMo 3 in every other layer from the first, so that sequences longer than that exercise the sliding-window masks;
    Gemma 3 and OLMo 3 give their sliding and full layers rotary tables of different bases (a layer given the other
    table would compute other logits); Qwen2, Gemma and Gemma 3 tie their embeddings, as GPT-2 does.
    """
    ids: dict[str, Any] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "vocab_size": vocab_size}
    if family == "gpt2":
        return transformers.GPT2Config(
            n_embd=hidden_size, n_layer=layers, n_head=4, n_positions=128, resid_pdrop=dropout,
            embd_pdrop=dropout, attn_pdrop=dropout, **ids,
        )  # fmt: skip
    common: dict[str, Any] = {
        **ids,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden_size // 4,
        "max_position_embeddings": 128,
        "attention_dropout": dropout,
    }
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=4)
    if family == "qwen2":
        return transformers.Qwen2Config(
            **common, tie_word_embeddings=True, use_sliding_window=True, sliding_window=4, max_window_layers=1
        )
    if family == "qwen3":
        return transformers.Qwen3Config(**common)
    if family == "gemma":
        return transformers.GemmaConfig(**common)
    alternating: dict[str, Any] = {
        "sliding_window": 4,
        "layer_types": ["sliding_attention" if index % 2 == 0 else "full_attention" for index in range(layers)],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
    }
    if family == "gemma3_text":
        return transformers.Gemma3TextConfig(**common, **alternating)
    if family == "olmo3":
        return transformers.Olmo3Config(**common, **alternating)
    if family == "phi3":
        return transformers.Phi3Config(**common, resid_pdrop=dropout, embd_pdrop=dropout)
    if family == "olmo":
        return transformers.OlmoConfig(**common)
    raise ValueError(f"family={family!r} is not one of the tiny families {', '.join(map(repr, CAUSAL_FAMILIES))}")


def _tokenizer(texts: Sequence[str], vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of ``texts`` with the special tokens first, padding on the left (for decoding)."""
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = token_decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(texts, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="left",
    )


def save_tiny_causal_lm(
    directory: str | Path,
    family: str = "llama",
    texts: Sequence[str] | None = None,
    *,
    hidden_size: int = 32,
    layers: int = 2,
    vocab_size: int = 96,
    dropout: float = 0.0,
    init_std: float = 0.02,
    seed: int = 0,
) -> Path:
    """Write a random-initialized ``family`` model (:func:`tiny_causal_config`) to ``directory``, with a tokenizer
    trained on ``texts`` when they are given (its vocabulary then sets the model's: the 256 byte symbols and the
    merges, at least ``vocab_size``). ``init_std`` is the standard deviation of the weight matrices (larger than the
    library's 0.02 gives a random model varied greedy outputs). Returns the directory."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(texts, vocab_size + 256) if texts else None
    size = len(tokenizer) if tokenizer is not None else vocab_size
    config = tiny_causal_config(family, hidden_size=hidden_size, layers=layers, vocab_size=size, dropout=dropout)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, init_std)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def main(argv: Sequence[str] | None = None) -> Path:
    """``python -m zoo.hf.causal_lm_tiny DIRECTORY [--family F] [--layers N] [--hidden-size D]``: a tiny model of
    family ``F`` with a tokenizer trained on the embedded corpus's English sentences; returns the directory."""
    from zoo.data import make_synthetic_corpus

    parser = argparse.ArgumentParser(prog="python -m zoo.hf.causal_lm_tiny", description=main.__doc__)
    parser.add_argument("directory")
    parser.add_argument("--family", default="qwen2", choices=CAUSAL_FAMILIES)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=64)
    args = parser.parse_args(argv)
    corpus = make_synthetic_corpus(seed=0, sizes={"xa": 2000})["en-xa"]["train"]
    texts = [row["en"] for row in corpus["translation"]]
    return save_tiny_causal_lm(
        args.directory, args.family, texts, hidden_size=args.hidden_size, layers=args.layers, init_std=0.3
    )


if __name__ == "__main__":
    print(main())
