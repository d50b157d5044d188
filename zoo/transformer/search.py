"""Greedy and beam-search decoding of encoder-decoders as decoding calls in rounds, with their decoder layers' caches.

Shape legend: B sources, b a part's sources, K beam size (1: greedy), N = b·K rows, S source length, t0 start tokens,
V vocabulary.

A call (:class:`Seq2SeqDecoding`, :mod:`zoo.decoding`'s shape) serves the zoo's
:class:`~zoo.tasks.translation.Transformer` and the Hugging Face translators alike; their layers say what a round does
with them (``decoding_role``):

- round 0 reads ``(source, start)``: the encoder runs once; where the decoder begins (the ``"decoder_embedding"``
  entry) its stream is repeated for the K hypotheses of each source; the decoder layers fill their caches (the
  cross-attention's from the encoder output, the self-attention's from the start tokens); the ``"head"`` (final norm,
  projection) sees the last position only;
- every later round feeds each row's last token: the ``"encoder"`` entries are skipped, and the encoder stream is made
  directly (a zero-width memory [N, S, 0], which only gives the cross-attention its source length, the source mask, the
  tokens), so one token's hidden state crosses each stage boundary.

The last stage chooses, from the logits of the last position only: the arg-max for greedy decoding, the K best
extensions of each source's hypotheses for beam search (GNMT's length penalty, as
:func:`~zoo.transformer.decoding.beam_search` documents). Its control is the tokens chosen and, for beams, each row's
parent row, by which every stage reorders its self-attention cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zoo.decoding import attached

__all__ = ["Seq2SeqDecoding", "gnmt_length_penalty"]


def gnmt_length_penalty(length: torch.Tensor | int, alpha: float) -> torch.Tensor:
    """GNMT's length penalty ``((5 + length) / 6) ** alpha`` (Wu et al. 2016); hypotheses score ``log p / penalty``."""
    return ((5.0 + torch.as_tensor(length, dtype=torch.float32)) / 6.0) ** alpha


@dataclass
class Seq2SeqDecoding:
    """One decoding of ``source`` [B, S] by an encoder-decoder whose entries have ``decoding_role``s (see the module).

    The decoder starts from the ``start`` tokens, never generates the ``banned`` ones (their logits are ``-inf``),
    generates ``forced_eos`` at its last step where given (Marian's ``</s>``), stops a row at ``eos`` and pads it with
    ``pad`` after. Without ``beam_size`` it decodes greedily; with one it searches that many beams with
    ``length_penalty`` (GNMT's alpha). Results: greedy, the tokens [B, t0 + n] (the start included); beams, the best
    hypotheses' generated tokens [B, n] and their penalized log-probabilities [B].
    """

    source: torch.Tensor
    start: tuple[int, ...]
    eos: int
    pad: int
    max_new_tokens: int
    banned: tuple[int, ...] = ()
    forced_eos: int | None = None
    beam_size: int | None = None
    length_penalty: float = 0.6

    def __post_init__(self) -> None:
        if self.source.dim() != 2 or self.source.dtype != torch.long:
            raise ValueError(
                f"source must be a LongTensor [B, S] of token ids, got {self.source.dtype} {tuple(self.source.shape)}"
            )
        if self.max_new_tokens < 1:
            raise ValueError(
                f"max_len={self.max_new_tokens} must be at least 1 (the tokens to generate, </s> included)"
            )
        if self.beam_size is not None and self.beam_size < 1:
            raise ValueError(f"beam_size={self.beam_size} must be at least 1 (1 is greedy decoding)")

    @property
    def rows(self) -> int:
        """The number of sources."""
        return int(self.source.shape[0])

    def part(self, rows: slice) -> _Part:
        """The sources ``rows`` on one stage."""
        return _Part(self, rows) if self.beam_size is None else _BeamPart(self, rows)

    def join(self, results: list[Any]) -> Any:
        """The parts' results as the whole call's (see the class), the shorter padded."""
        if self.beam_size is None:
            return _padded_cat(results, self.pad)
        return _padded_cat([tokens for tokens, _ in results], self.pad), torch.cat([scores for _, scores in results])

    def cache_bytes(self, cell: nn.Module, rows: int) -> int:
        """The bytes the caches of ``cell``'s decoder layers hold at the end of the call, for ``rows`` sources: each
        keeps, per row, its cross-attention's source positions and its self-attention's target positions."""
        positions = self.source.shape[1] + len(self.start) + self.max_new_tokens
        per_token = sum(getattr(layer, "cache_bytes_per_token", 0) for layer in cell.children())
        return per_token * rows * (self.beam_size or 1) * positions


class _Part:
    """Sources ``rows`` of a :class:`Seq2SeqDecoding` decoded greedily on one stage: the stage's cache, the rows'
    tokens so far (K = 1)."""

    def __init__(self, decoding: Seq2SeqDecoding, rows: slice) -> None:
        self.decoding = decoding
        self.source = decoding.source[rows]  # [b, S]
        self.K = decoding.beam_size or 1
        device = self.source.device
        self.tokens = torch.tensor(decoding.start, device=device).repeat(self.source.shape[0] * self.K, 1)  # [N, t]
        self.done = torch.zeros(self.tokens.shape[0], dtype=torch.bool, device=device)
        self.cache: Any = None
        self.round = 0
        self.memory_dtype = torch.get_default_dtype()  # the encoder output's, once stage 0 has run the encoder

    @property
    def new_tokens(self) -> int:
        return self.tokens.shape[1] - len(self.decoding.start)

    def first(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.source, self.tokens[: self.source.shape[0]]  # the start tokens, before the beams are made

    def next(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mask = (self.source != self.decoding.pad).repeat_interleave(self.K, dim=0)  # as the source embedding makes it
        # The cross-attention reads only its length (and, for the mask, its dtype): no bytes.
        memory = torch.zeros(mask.shape[0], mask.shape[1], 0, dtype=self.memory_dtype, device=mask.device)
        return memory, mask, self.tokens[:, -1:]

    def run(self, cell: nn.Module, value: Any) -> Any:
        """``cell``'s entries on ``value`` with this part's cache, as this round runs them (see the module)."""
        layers = list(cell.children())
        if self.cache is None:
            holder: Any = next((layer for layer in layers if hasattr(layer, "new_cache")), None)
            self.cache = holder.new_cache() if holder is not None else None
        offset = 0 if self.round == 0 else self.tokens.shape[1] - 1
        sliced = False
        with attached(layers, cache=self.cache, position_offset=offset):
            for layer in layers:
                role = getattr(layer, "decoding_role", None)
                if role == "encoder" and self.round > 0:
                    continue
                if role == "decoder_embedding" and self.round == 0 and self.K > 1:
                    value = tuple(part.repeat_interleave(self.K, dim=0) for part in value)
                if role == "head" and not sliced:
                    value, sliced = _last_position(value), True
                value = layer(value)
                if role == "encoder" and self.round == 0:
                    self.memory_dtype = value[0].dtype
        return value

    def choose(self, output: torch.Tensor) -> tuple[Any, bool]:
        logits = self._logits(output)
        step = logits.argmax(dim=-1)
        step = torch.where(self.done, self.decoding.pad, step)
        done = self.done | (step == self.decoding.eos)
        return step, bool(done.all()) or self.new_tokens + 1 == self.decoding.max_new_tokens

    def _logits(self, output: torch.Tensor) -> torch.Tensor:
        """The last position's float logits [N, V], banned tokens at ``-inf``, only ``forced_eos`` at the last step."""
        decoding = self.decoding
        logits = output[:, -1].float()
        logits[:, list(decoding.banned)] = float("-inf")
        if decoding.forced_eos is not None and self.new_tokens + 1 == decoding.max_new_tokens:
            forced = torch.full_like(logits, float("-inf"))
            forced[:, decoding.forced_eos] = 0.0
            logits = forced
        return logits

    def follow(self, control: Any) -> None:
        self.tokens = torch.cat([self.tokens, control[:, None]], dim=1)
        self.done |= control == self.decoding.eos
        self.round += 1

    def result(self) -> Any:
        return self.tokens


class _BeamPart(_Part):
    """Sources ``rows`` searched with K beams on one stage; the last stage keeps the search (see
    :func:`~zoo.transformer.decoding.beam_search` for its rules)."""

    def __init__(self, decoding: Seq2SeqDecoding, rows: slice) -> None:
        super().__init__(decoding, rows)
        b, K, device = self.source.shape[0], self.K, self.source.device
        self.alive_log_p = torch.full((b, K), float("-inf"), device=device)
        self.alive_log_p[:, 0] = 0.0  # K copies of the start would fill the beam with duplicates: start from one
        self.best_scores = torch.full((b,), float("-inf"), device=device)
        self.best_tokens = torch.full((b, decoding.max_new_tokens), decoding.pad, dtype=torch.long, device=device)
        self.searched = torch.zeros(b, dtype=torch.bool, device=device)  # no hypothesis can beat the best found
        self.final_penalty = gnmt_length_penalty(decoding.max_new_tokens, decoding.length_penalty).item()

    def choose(self, output: torch.Tensor) -> tuple[Any, bool]:
        decoding, K = self.decoding, self.K
        b, step, device = self.source.shape[0], self.new_tokens, self.source.device
        sources = torch.arange(b, device=device)
        log_p = self._logits(output).log_softmax(dim=-1).view(b, K, -1)  # [b, K, V]
        V = log_p.shape[-1]
        values, flat = (self.alive_log_p[:, :, None] + log_p).view(b, K * V).topk(min(2 * K, K * V), dim=1)
        beams, words = flat // V, flat % V  # [b, 2K], best first
        is_eos = words == decoding.eos
        alive = self.tokens.view(b, K, -1)[:, :, len(decoding.start) :]  # [b, K, step]

        # Finish the </s> extensions that rank among the first K.
        finishing = is_eos & (torch.arange(values.shape[1], device=device) < K) & ~self.searched[:, None]
        penalty = gnmt_length_penalty(step + 1, decoding.length_penalty)
        score, position = torch.where(finishing, values / penalty, float("-inf")).max(dim=1)
        improved = score > self.best_scores
        if improved.any():
            prefix = alive[sources, beams[sources, position]]  # [b, step]
            eos = torch.full((b, 1), decoding.eos, dtype=torch.long, device=device)
            self.best_tokens[improved] = decoding.pad
            self.best_tokens[improved, : step + 1] = torch.cat([prefix, eos], dim=1)[improved]
            self.best_scores = torch.where(improved, score, self.best_scores)

        # The K best other extensions live on.
        self.alive_log_p, keep = values.masked_fill(is_eos, float("-inf")).topk(K, dim=1)  # [b, K]
        parents, new_words = beams.gather(1, keep), words.gather(1, keep)
        finished = step + 1 == decoding.max_new_tokens
        if decoding.length_penalty >= 0:  # log p only falls and the penalty only grows, up to its value at max_len
            self.searched |= self.best_scores >= self.alive_log_p.max(dim=1).values / self.final_penalty
            finished = finished or bool(self.searched.all())
        if step + 1 == decoding.max_new_tokens and not bool(self.searched.all()):
            # max_len reached: unfinished hypotheses compete too
            continued = torch.cat([alive[sources[:, None], parents], new_words[..., None]], dim=2)  # [b, K, step + 1]
            score, position = (self.alive_log_p / self.final_penalty).max(dim=1)
            improved = (score > self.best_scores) & ~self.searched
            self.best_tokens[improved] = continued[sources, position][improved]
            self.best_scores = torch.where(improved, score, self.best_scores)
        rows = (sources[:, None] * K + parents).flatten()  # each row's parent row, [N]
        return torch.stack([new_words.flatten(), rows]), finished

    def follow(self, control: Any) -> None:
        words, rows = control[0], control[1]
        if self.cache is not None:
            _reorder(self.cache, rows)
        self.tokens = torch.cat([self.tokens[rows], words[:, None]], dim=1)
        self.round += 1

    def result(self) -> Any:
        lengths = (self.best_tokens != self.decoding.pad).sum(dim=1)
        return self.best_tokens[:, : max(int(lengths.max()), 1)], self.best_scores


def _reorder(cache: Any, rows: torch.Tensor) -> None:
    """Row ``i`` of ``cache``'s self-attention takes row ``rows[i]``'s entries (a ``transformers`` encoder-decoder
    cache reorders its self-attention part alone: a source's hypotheses share their cross-attention entries)."""
    own = getattr(cache, "self_attention_cache", cache)
    own.reorder_cache(rows)


def _last_position(value: Any) -> Any:
    """A decoder stream ``(memory, mask, y)``, or ``y``, with ``y`` [N, T, D] cut to its last position."""
    if isinstance(value, tuple):
        return (*value[:-1], value[-1][:, -1:])
    return value[:, -1:]


def _padded_cat(tensors: list[torch.Tensor], pad: int) -> torch.Tensor:
    width = max(tensor.shape[1] for tensor in tensors)
    return torch.cat([nn.functional.pad(t, (0, width - t.shape[1]), value=pad) for t in tensors])
