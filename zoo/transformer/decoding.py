"""Batched greedy and beam-search decoding for a trained encoder-decoder :class:`~zoo.tasks.translation.Transformer`.

Shape legend: B batch, K beam size, S source length, T decoded length (at most ``max_len``), V vocabulary.

Decoding runs in rounds with each decoder layer's key/value cache (:mod:`zoo.transformer.search`): the encoder runs
once per source, then each round feeds one token per hypothesis. On the whole model (after ``fit``) the rounds run
here; inside a step under ``GPipeStrategy`` (a ``validation_step`` or ``predict_step`` that decodes), where
``model.layers`` is the pipelined sequence, every stage runs them with its own layers and caches, micro-batches in
flight, and the tokens equal the whole model's. Padding and ``<s>`` are never generated (their logits are masked before
the softmax), the same in every function here, so the scores they report are comparable.

Outputs are the generated tokens without the leading ``<s>``: each row ends with ``</s>`` followed by padding, or
holds ``max_len`` tokens when no ``</s>`` came in time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from zoo.decoding import holds_all_layers, run_decoding
from zoo.transformer.search import Seq2SeqDecoding, gnmt_length_penalty

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "BeamSearchResult",
    "Translator",
    "beam_search",
    "gnmt_length_penalty",
    "greedy_decode",
    "holds_all_layers",
    "sequence_log_prob",
]

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # the zoo's special tokens (unk is 3)


class Translator(Protocol):
    """What decoding reads of a model: its ``layers``, its ``encode`` and ``decode`` halves and its ``hparams``.

    :class:`~zoo.tasks.translation.Transformer` and the Hugging Face translators have them.
    """

    @property
    def layers(self) -> nn.Module: ...

    @property
    def hparams(self) -> Any: ...

    @property
    def training(self) -> bool: ...

    def train(self, mode: bool = True) -> Any: ...

    def encode(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def decode(self, memory: torch.Tensor, source_mask: torch.Tensor, target_in: torch.Tensor) -> torch.Tensor: ...


class BeamSearchResult(NamedTuple):
    """The best hypothesis of each source: ``tokens`` [B, T] and its length-penalized log-probability ``scores`` [B]."""

    tokens: torch.Tensor
    scores: torch.Tensor


@contextmanager
def _inference(model: Translator) -> Iterator[None]:
    """Eval mode without autograd for the duration, then the model's mode as it was."""
    if not isinstance(model.layers, nn.Sequential) and holds_all_layers(model.layers):
        raise TypeError(
            f"decoding needs the whole model, but model.layers is a {type(model.layers).__name__}: decode after "
            "trainer.fit returns, or inside a validation, test or predict step under GPipeStrategy"
        )
    if model.hparams.get("pad_id", PAD_ID) != PAD_ID:
        raise ValueError(
            f"decoding uses the zoo's special tokens (pad {PAD_ID}, <s> {BOS_ID}, </s> {EOS_ID}), but the model was "
            f"built with pad_id={model.hparams['pad_id']}; build it with pad_id={PAD_ID}"
        )
    was_training = model.training
    model.train(False)
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def greedy_decode(model: Translator, source: torch.Tensor, max_len: int) -> torch.Tensor:
    """The most likely next token at every step, for a batch of ``source`` [B, S]: LongTensor [B, T]."""
    decoding = _decoding(source, max_len)
    with _inference(model):
        tokens: torch.Tensor = run_decoding(model.layers, decoding)
    return tokens[:, 1:]


def sequence_log_prob(model: Translator, source: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability [B] of decoded ``tokens`` [B, T] (as returned here, without ``<s>``) given ``source``.

    Tokens after the first ``</s>`` do not count. Use with :func:`gnmt_length_penalty` to score a hypothesis the way
    :func:`beam_search` does.
    """
    _decoding(source, max(tokens.shape[1], 1))  # checks the arguments
    with _inference(model):
        memory, mask = model.encode(source)
        bos = torch.full((tokens.shape[0], 1), BOS_ID, dtype=torch.long, device=tokens.device)
        logits = model.decode(memory, mask, torch.cat([bos, tokens[:, :-1]], dim=1)).float()  # [B, T, V]
        logits[..., [PAD_ID, BOS_ID]] = float("-inf")
        picked = logits.log_softmax(dim=-1).gather(-1, tokens[..., None]).squeeze(-1)  # [B, T]
        # A position counts while no </s> came before it.
        before_eos = (tokens == EOS_ID).long().cumsum(dim=1) - (tokens == EOS_ID).long() == 0
        return picked.masked_fill(~before_eos, 0.0).sum(dim=1)


def beam_search(
    model: Translator, source: torch.Tensor, beam_size: int, max_len: int, length_penalty: float = 0.6
) -> BeamSearchResult:
    """Beam search with GNMT's length penalty: the hypothesis maximizing ``log p / ((5 + len) / 6) ** alpha``.

    At each step the 2K best extensions of the K live hypotheses are ranked; an extension ending in ``</s>`` is
    finished if it ranks among the first K (as fairseq does, so ``beam_size=1`` with ``length_penalty=0`` is exactly
    greedy decoding), and the K best other extensions live on. A source is done when no live hypothesis can beat its
    best finished one any more (valid for ``length_penalty >= 0``); at ``max_len`` the live hypotheses compete
    unfinished. ``len`` counts the generated tokens, ``</s>`` included.
    """
    decoding = _decoding(source, max_len, beam_size, length_penalty)
    with _inference(model):
        tokens, scores = run_decoding(model.layers, decoding)
    return BeamSearchResult(tokens, scores)


def _decoding(
    source: torch.Tensor, max_len: int, beam_size: int | None = None, length_penalty: float = 0.6
) -> Seq2SeqDecoding:
    """The decoding call of the zoo's special tokens: from ``<s>``, neither padding nor ``<s>`` generated."""
    return Seq2SeqDecoding(
        source, (BOS_ID,), EOS_ID, PAD_ID, max_len, banned=(PAD_ID, BOS_ID), beam_size=beam_size,
        length_penalty=length_penalty,
    )  # fmt: skip
