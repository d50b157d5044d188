"""The entries of a Transformer's flat layer sequence: each takes one value and returns one.

Shape legend: B batch, S source length, T target length, D model width, V vocabulary. The values between entries
(see :mod:`zoo.transformer.network` for the whole protocol) are tensors or tuples of tensors, so any entry can be a
pipeline stage boundary:

- encoder stream ``(x [B, S, D], source_mask [B, S] bool, target_in [B, T] long)``: the target tokens ride along
  untouched until the target embedding needs them;
- decoder stream ``(memory [B, S, D], source_mask [B, S] bool, y [B, T, D])``;
- language-model stream ``x [B, T, D]``.

``source_mask`` is True at real (non-padding) source tokens.
"""

from __future__ import annotations

import torch
from torch import nn

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

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, D]
        x = self.token(tokens)
        return self.dropout(x + sinusoidal_positions(tokens.shape[1], x.shape[-1], x.device).to(x.dtype))


class SourceEmbedding(_Embedding):
    """First entry: ``(source [B, S], target_in [B, T])`` -> encoder stream; computes the source padding mask."""

    def __init__(self, vocab_size: int, d_model: int, dropout: float, pad_id: int) -> None:
        super().__init__(vocab_size, d_model, dropout)
        self.pad_id = pad_id

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> EncoderStream:
        source, target_in = inputs
        return self.embed(source), source != self.pad_id, target_in


class TargetEmbedding(_Embedding):
    """Encoder stream -> decoder stream: embeds ``target_in`` (a separate table from the source's, as lingvo)."""

    def forward(self, stream: EncoderStream) -> DecoderStream:
        memory, source_mask, target_in = stream
        return memory, source_mask, self.embed(target_in)


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

    def forward(self, x: torch.Tensor, mask: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        normed = self.norm(x)
        return x + self.dropout(self.body(normed, normed if memory is None else memory, mask))


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
    ) -> torch.Tensor:
        """``x`` [B, T, D]; masks broadcastable to [B, A, T, T] and [B, A, T, S] (True = may attend)."""
        x = self.self_attention(x, self_mask)
        if self.cross_attention is not None:
            if memory is None or memory_mask is None:
                raise ValueError("a decoder layer with cross-attention needs the encoder memory and its mask")
            x = self.cross_attention(x, memory_mask, memory)
        return self.feed_forward(x)


class EncoderLayer(TransformerLayer):
    """Encoder stream -> encoder stream: unmasked self-attention over the non-padding source tokens, feed-forward."""

    def forward(self, stream: EncoderStream) -> EncoderStream:  # type: ignore[override]
        x, source_mask, target_in = stream
        return super().forward(x, source_mask[:, None, None, :]), source_mask, target_in


class DecoderLayer(TransformerLayer):
    """Decoder stream -> decoder stream: causal self-attention, attention to the memory, feed-forward."""

    def __init__(
        self, d_model: int, num_heads: int, head_dim: int, ff_dim: int, dropout: float, *, ff_gain: float = 1.0
    ) -> None:
        super().__init__(d_model, num_heads, head_dim, ff_dim, dropout, cross_attention=True, ff_gain=ff_gain)

    def forward(self, stream: DecoderStream) -> DecoderStream:  # type: ignore[override]
        memory, source_mask, y = stream
        causal = _causal_mask(y.shape[1], y.device)
        return memory, source_mask, super().forward(y, causal, memory, source_mask[:, None, None, :])


class LanguageModelLayer(TransformerLayer):
    """x [B, T, D] -> x: causal self-attention and feed-forward (no cross-attention)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x, _causal_mask(x.shape[1], x.device))


class EncoderNorm(nn.LayerNorm):
    """Encoder stream -> encoder stream with the final LayerNorm on x (lingvo's ``normalize_encoder``)."""

    def forward(self, stream: EncoderStream) -> EncoderStream:  # type: ignore[override]
        x, source_mask, target_in = stream
        return super().forward(x), source_mask, target_in


class DecoderNorm(nn.LayerNorm):
    """Decoder stream -> y [B, T, D] with the final decoder LayerNorm; the memory is no longer needed."""

    def forward(self, stream: DecoderStream) -> torch.Tensor:  # type: ignore[override]
        return super().forward(stream[2])
