"""Batched greedy and beam-search decoding for a trained encoder-decoder :class:`~zoo.tasks.translation.Transformer`.

Shape legend: B batch, K beam size, S source length, T decoded length (at most ``max_len``), V vocabulary.

Decoding calls the model once per output token. On the whole model (after ``fit``) the encoder runs once per source
and the decoder re-reads the whole growing prefix at every step (no incremental key/value cache): O(T²) decoder work,
simple and exact, and fine for the sentence lengths of translation. Inside a step under ``GPipeStrategy`` (a
``validation_step`` or ``predict_step`` that decodes), where ``model.layers`` is the pipelined sequence, every step
calls the whole sequence on ``(source, prefix)`` instead, the encoder included: the strategy runs each such call
through the stages (see :mod:`lightning_gpipe.engine.relay`), and the tokens equal the whole model's. Padding and
``<s>`` are never generated (their logits are masked before the softmax), the same in every function here, so the scores
they report are comparable.

Outputs are the generated tokens without the leading ``<s>``: each row ends with ``</s>`` followed by padding, or
holds ``max_len`` tokens when no ``</s>`` came in time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "BeamSearchResult",
    "PrefixScorer",
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


def holds_all_layers(layers: nn.Module) -> bool:
    """Whether ``layers`` holds every layer of the model's sequence, so that the model may call its parts one by one.

    A stand-in that holds some of them and runs each call of the whole sequence elsewhere (the sequence a pipeline
    strategy gives each stage) says ``holds_all_layers = False``; the model then calls the whole sequence instead.
    """
    return bool(getattr(layers, "holds_all_layers", True))


class BeamSearchResult(NamedTuple):
    """The best hypothesis of each source: ``tokens`` [B, T] and its length-penalized log-probability ``scores`` [B]."""

    tokens: torch.Tensor
    scores: torch.Tensor


def gnmt_length_penalty(length: torch.Tensor | int, alpha: float) -> torch.Tensor:
    """GNMT's length penalty ``((5 + length) / 6) ** alpha`` (Wu et al. 2016); hypotheses score ``log p / penalty``."""
    return ((5.0 + torch.as_tensor(length, dtype=torch.float32)) / 6.0) ** alpha


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


class PrefixScorer:
    """Logits [N, V] of the token after a prefix [N, t], for sources [B, S] each repeated ``repeats`` times (N = B·R).

    On the whole model the encoder runs here, once, and every :meth:`logits` runs the decoder. When ``model.layers``
    is the pipelined sequence of a ``GPipeStrategy`` step, every :meth:`logits` calls the whole sequence on
    ``(source, prefix)``: the strategy runs each call through the stages. Works for every zoo model with ``layers``,
    ``encode`` and ``decode`` (:class:`~zoo.tasks.translation.Transformer`, the Hugging Face translators).
    """

    def __init__(self, model: Any, source: torch.Tensor, repeats: int = 1) -> None:
        self.model = model
        self.pipelined = not holds_all_layers(model.layers)
        if self.pipelined:
            self.source = source.repeat_interleave(repeats, dim=0)  # [N, S]
        else:
            memory, mask = model.encode(source)
            self.memory, self.mask = memory.repeat_interleave(repeats, dim=0), mask.repeat_interleave(repeats, dim=0)

    def logits(self, prefix: torch.Tensor) -> torch.Tensor:
        """Float logits [N, V] of the next token after ``prefix`` [N, t]."""
        if self.pipelined:
            return self.model.layers((self.source, prefix))[:, -1].float()
        return self.model.decode(self.memory, self.mask, prefix)[:, -1].float()


def _next_log_probs(scorer: PrefixScorer, prefix: torch.Tensor) -> torch.Tensor:
    """Log-probabilities [N, V] of the token after ``prefix`` [N, t], with padding and ``<s>`` excluded."""
    logits = scorer.logits(prefix)
    logits[:, [PAD_ID, BOS_ID]] = float("-inf")
    return logits.log_softmax(dim=-1)


def _check(source: torch.Tensor, max_len: int) -> None:
    if source.dim() != 2 or source.dtype != torch.long:
        raise ValueError(f"source must be a LongTensor [B, S] of token ids, got {source.dtype} {tuple(source.shape)}")
    if max_len < 1:
        raise ValueError(f"max_len={max_len} must be at least 1 (the number of tokens to generate, </s> included)")


def greedy_decode(model: Translator, source: torch.Tensor, max_len: int) -> torch.Tensor:
    """The most likely next token at every step, for a batch of ``source`` [B, S]: LongTensor [B, T]."""
    _check(source, max_len)
    with _inference(model):
        scorer = PrefixScorer(model, source)
        tokens = torch.full((source.shape[0], 1), BOS_ID, dtype=torch.long, device=source.device)
        finished = torch.zeros(source.shape[0], dtype=torch.bool, device=source.device)
        for _ in range(max_len):
            word = _next_log_probs(scorer, tokens).argmax(dim=-1)
            word = word.masked_fill(finished, PAD_ID)
            tokens = torch.cat([tokens, word[:, None]], dim=1)
            finished |= word == EOS_ID
            if finished.all():
                break
    return tokens[:, 1:]


def sequence_log_prob(model: Translator, source: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability [B] of decoded ``tokens`` [B, T] (as returned here, without ``<s>``) given ``source``.

    Tokens after the first ``</s>`` do not count. Use with :func:`gnmt_length_penalty` to score a hypothesis the way
    :func:`beam_search` does.
    """
    _check(source, max(tokens.shape[1], 1))
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
    _check(source, max_len)
    if beam_size < 1:
        raise ValueError(f"beam_size={beam_size} must be at least 1 (1 is greedy decoding with length_penalty=0)")
    B, K, device = source.shape[0], beam_size, source.device
    rows = torch.arange(B, device=device)
    with _inference(model):
        scorer = PrefixScorer(model, source, repeats=K)  # [B·K, S, ...]
        alive = torch.full((B, K, 1), BOS_ID, dtype=torch.long, device=device)  # [B, K, t + 1] with <s>
        alive_log_p = torch.full((B, K), float("-inf"), device=device)
        alive_log_p[:, 0] = 0.0  # K copies of <s> would fill the beam with duplicates: start from one
        best_scores = torch.full((B,), float("-inf"), device=device)
        best_tokens = torch.full((B, max_len), PAD_ID, dtype=torch.long, device=device)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        final_penalty = gnmt_length_penalty(max_len, length_penalty).item()
        for step in range(max_len):
            log_p = _next_log_probs(scorer, alive.view(B * K, -1)).view(B, K, -1)  # [B, K, V]
            V = log_p.shape[-1]
            candidates = (alive_log_p[:, :, None] + log_p).view(B, K * V)
            values, flat = candidates.topk(min(2 * K, K * V), dim=1)  # [B, 2K], best first
            beams, words = flat // V, flat % V
            is_eos = words == EOS_ID

            # Finish the </s> extensions that rank among the first K.
            in_top_k = torch.arange(values.shape[1], device=device) < K
            finishing = is_eos & in_top_k & ~done[:, None]
            scores = torch.where(finishing, values / gnmt_length_penalty(step + 1, length_penalty), float("-inf"))
            score, position = scores.max(dim=1)
            improved = score > best_scores
            if improved.any():
                prefix = alive[rows, beams[rows, position], 1:]  # [B, step]
                eos = torch.full((B, 1), EOS_ID, dtype=torch.long, device=device)
                best_tokens[improved] = PAD_ID
                best_tokens[improved, : step + 1] = torch.cat([prefix, eos], dim=1)[improved]
                best_scores = torch.where(improved, score, best_scores)

            # The K best other extensions live on.
            alive_log_p, keep = values.masked_fill(is_eos, float("-inf")).topk(K, dim=1)  # [B, K]
            parents, new_words = beams.gather(1, keep), words.gather(1, keep)
            alive = torch.cat([alive[rows[:, None], parents], new_words[..., None]], dim=2)

            if length_penalty >= 0:  # log p only falls and the penalty only grows, up to its value at max_len
                done |= best_scores >= alive_log_p.max(dim=1).values / final_penalty
                if done.all():
                    break
        else:  # max_len reached: unfinished hypotheses compete too
            score, position = (alive_log_p / final_penalty).max(dim=1)
            improved = (score > best_scores) & ~done
            best_tokens[improved] = alive[rows, position, 1:][improved]
            best_scores = torch.where(improved, score, best_scores)
    lengths = (best_tokens != PAD_ID).sum(dim=1)
    return BeamSearchResult(best_tokens[:, : max(int(lengths.max()), 1)], best_scores)
