"""The entries of a Transformer's flat layer sequence: each takes one value and returns one.

Shape legend: B batch, S source length, T target length, D model width, V vocabulary. The values between entries
(see :mod:`zoo.transformer.network` for the whole protocol) are tensors or tuples of tensors, so any entry can be a
pipeline stage boundary:

- encoder stream ``(x [B, S, D], source_mask [B, S] bool, target_in [B, T] long)``: the target tokens ride along
  untouched until the target embedding needs them;
- decoder stream ``(memory [B, S, D], source_mask [B, S] bool, y [B, T, D])``;
- language-model stream ``x [B, T, D]``.

``source_mask`` is True at real (non-padding) source tokens.

While decoding (:mod:`zoo.transformer.search`) each entry's ``decoding_role`` says what a round does with it: the
encoder's entries run in the first round only, the target embedding numbers its tokens from ``position_offset``, the
decoder layers keep their keys and values in ``cache`` (:class:`~zoo.transformer.cache.DecoderCache`), and the head
needs the last position only.
"""

from __future__ import annotations

import torch
from torch import nn

from zoo.transformer.cache import AttentionCache, DecoderCache
from zoo.transformer.layers import FeedForward, MultiHeadAttention, TokenEmbedding, sinusoidal_positions

__all__ = [
    "DecoderLayer",
    "DecoderNorm",
    "EncoderLayer",
    "EncoderNorm",
    "LanguageModelEmbedding",
    "LanguageModelLayer",
    "SourceEmbedding",
    "TargetEmbedding",
    "TransformerLayer",
]

EncoderStream = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
DecoderStream = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _causal_mask(length: int, device: torch.device) -> torch.Tensor:  # [T, T], True on and below the diagonal
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()


class _Embedding(nn.Module):
    """Tokens -> √D-scaled embedding plus sinusoidal positions, then dropout (lingvo's input dropout)."""

    def __init__(self, vocab_size: int, d_model: int, dropout: float) -> None:
        super().__init__()
        self.token = TokenEmbedding(vocab_size, d_model)
        self.dropout = nn.Dropout(dropout)

    def embed(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:  # [B, T] -> [B, T, D]
        x = self.token(tokens)
        return self.dropout(x + sinusoidal_positions(tokens.shape[1], x.shape[-1], x.device, start).to(x.dtype))


class SourceEmbedding(_Embedding):
    """First entry: ``(source [B, S], target_in [B, T])`` -> encoder stream; computes the source padding mask."""

    decoding_role = "encoder"

    def __init__(self, vocab_size: int, d_model: int, dropout: float, pad_id: int) -> None:
        super().__init__(vocab_size, d_model, dropout)
        self.pad_id = pad_id

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> EncoderStream:
        source, target_in = inputs
        return self.embed(source), source != self.pad_id, target_in


class TargetEmbedding(_Embedding):
    """Encoder stream -> decoder stream: embeds ``target_in`` (a separate table from the source's, as lingvo), its
    first token at position ``position_offset`` (the tokens a decoding cached before it)."""

    decoding_role = "decoder_embedding"
    position_offset = 0

    def forward(self, stream: EncoderStream) -> DecoderStream:
        memory, source_mask, target_in = stream
        return memory, source_mask, self.embed(target_in, self.position_offset)


class LanguageModelEmbedding(_Embedding):
    """First entry of the language model: tokens [B, T] -> x [B, T, D]."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)


class _AttentionBlock(nn.Module):
    """Pre-LN residual attention: ``x + dropout(attention(LN(x), memory or LN(x), mask))``."""

    def __init__(self, d_model: int, attention: MultiHeadAttention, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.body = attention
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        memory: torch.Tensor | None = None,
        cache: AttentionCache | None = None,
    ) -> torch.Tensor:
        normed = self.norm(x)
        return x + self.dropout(self.body(normed, normed if memory is None else memory, mask, cache))


class _FeedForwardBlock(nn.Module):
    """Pre-LN residual feed-forward: ``x + dropout(feed_forward(LN(x)))``."""

    def __init__(self, d_model: int, feed_forward: FeedForward, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.body = feed_forward
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.body(self.norm(x)))


class TransformerLayer(nn.Module):
    """One lingvo ``TransformerLayer``: self-attention, optional cross-attention, feed-forward, each pre-LN residual.

    ``ff_gain`` scales the feed-forward initialization (the Fixup-style depth scaling, see ``fixup_scale``).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        head_dim: int,
        ff_dim: int,
        dropout: float,
        *,
        cross_attention: bool = False,
        per_dim_scale: bool = False,
        ff_gain: float = 1.0,
    ) -> None:
        super().__init__()

        def attention() -> MultiHeadAttention:
            return MultiHeadAttention(d_model, num_heads, head_dim, dropout, per_dim_scale=per_dim_scale)

        self.self_attention = _AttentionBlock(d_model, attention(), dropout)
        self.cross_attention = _AttentionBlock(d_model, attention(), dropout) if cross_attention else None
        self.feed_forward = _FeedForwardBlock(d_model, FeedForward(d_model, ff_dim, dropout, gain=ff_gain), dropout)

    def forward(
        self,
        x: torch.Tensor,
        self_mask: torch.Tensor,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        caches: tuple[AttentionCache, AttentionCache] | None = None,
    ) -> torch.Tensor:
        """``x`` [B, T, D]; masks broadcastable to [B, A, T, C + T] and [B, A, T, S] (True = may attend); ``caches``
        the self- and cross-attention's while decoding (the memory is then read in the first round only)."""
        own, cross = caches if caches is not None else (None, None)
        x = self.self_attention(x, self_mask, cache=own)
        if self.cross_attention is not None:
            if memory is None or memory_mask is None:
                raise ValueError("a decoder layer with cross-attention needs the encoder memory and its mask")
            x = self.cross_attention(x, memory_mask, memory, cross)
        return self.feed_forward(x)


class EncoderLayer(TransformerLayer):
    """Encoder stream -> encoder stream: unmasked self-attention over the non-padding source tokens, feed-forward."""

    decoding_role = "encoder"

    def forward(self, stream: EncoderStream) -> EncoderStream:  # type: ignore[override]
        x, source_mask, target_in = stream
        return super().forward(x, source_mask[:, None, None, :]), source_mask, target_in


class DecoderLayer(TransformerLayer):
    """Decoder stream -> decoder stream: causal self-attention, attention to the memory, feed-forward.

    ``cache``, set for the duration of a decoding round, keeps the layer's keys and values: the stream then holds the
    round's new tokens, and the memory (read in the first round) may be a placeholder.
    """

    decoding_role = "decoder"
    cache: DecoderCache | None = None

    def __init__(
        self, d_model: int, num_heads: int, head_dim: int, ff_dim: int, dropout: float, *, ff_gain: float = 1.0
    ) -> None:
        super().__init__(d_model, num_heads, head_dim, ff_dim, dropout, cross_attention=True, ff_gain=ff_gain)

    def forward(self, stream: DecoderStream) -> DecoderStream:  # type: ignore[override]
        memory, source_mask, y = stream
        if self.cache is None:
            causal = _causal_mask(y.shape[1], y.device)
            return memory, source_mask, super().forward(y, causal, memory, source_mask[:, None, None, :])
        caches = self.cache.of(self)
        T, C = y.shape[1], caches[0].length
        causal = torch.ones(T, C + T, dtype=torch.bool, device=y.device).tril(C)  # new tokens after the cached ones
        return memory, source_mask, super().forward(y, causal, memory, source_mask[:, None, None, :], caches)

    def new_cache(self) -> DecoderCache:
        """An empty cache for the decoder layers of a stage."""
        return DecoderCache()

    @property
    def cache_bytes_per_token(self) -> int:
        """The bytes of one position's keys and values in each of the layer's attentions, per sequence (a target
        token's in its self-attention, a source token's in its cross-attention)."""
        attention = self.self_attention.body
        assert isinstance(attention, MultiHeadAttention)
        width = attention.num_heads * attention.head_dim
        return 2 * width * attention.key.weight.dtype.itemsize


class LanguageModelLayer(TransformerLayer):
    """x [B, T, D] -> x: causal self-attention and feed-forward (no cross-attention)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x, _causal_mask(x.shape[1], x.device))


class EncoderNorm(nn.LayerNorm):
    """Encoder stream -> encoder stream with the final LayerNorm on x (lingvo's ``normalize_encoder``)."""

    decoding_role = "encoder"

    def forward(self, stream: EncoderStream) -> EncoderStream:  # type: ignore[override]
        x, source_mask, target_in = stream
        return super().forward(x), source_mask, target_in


class DecoderNorm(nn.LayerNorm):
    """Decoder stream -> y [B, T, D] with the final decoder LayerNorm; the memory is no longer needed."""

    decoding_role = "head"

    def forward(self, stream: DecoderStream) -> torch.Tensor:  # type: ignore[override]
        return super().forward(stream[2])
