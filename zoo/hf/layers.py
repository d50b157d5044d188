"""The entries of a Hugging Face encoder-decoder as a flat layer sequence: wrappers around its own modules.

Shape legend: B batch, S source length, T target length, D ``d_model``, V vocabulary.

Each entry holds the ``transformers`` modules it runs (``M2M100EncoderLayer``, ``MarianDecoderLayer``, the shared
embedding, ...) and repeats only the glue of the library's ``forward`` between them: embedding scale, positions,
dropout, the attention masks (built with the library's own ``create_bidirectional_mask``/``create_causal_mask``, so
every attention implementation gets the mask it expects) and layer drop. The arithmetic is the library's, so the
sequence reproduces its forward exactly, and the parameters are the library model's own tensors. The values between
entries are tensors or tuples of tensors, so that any entry can be a pipeline stage boundary:

- encoder stream ``(x [B, S, D], source_mask [B, S] bool, target_in [B, T] long)``: the decoder's input tokens ride
  along untouched until the decoder embedding needs them;
- decoder stream ``(memory [B, S, D], source_mask [B, S] bool, y [B, T, D])``.

``source_mask`` is True at real (non-padding) source tokens, the tokenizer's ``attention_mask``.

While decoding (:mod:`zoo.transformer.search`) each entry's ``decoding_role`` says what a round does with it: the
encoder's entries run in the first round only, the decoder embedding numbers its tokens from ``position_offset``, the
decoder layers keep their keys and values in ``cache`` (the library's ``EncoderDecoderCache``), and the head needs the
last position only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, EncoderDecoderCache, PretrainedConfig
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.models.m2m_100.modeling_m2m_100 import M2M100SinusoidalPositionalEmbedding

__all__ = [
    "DecoderEmbedding",
    "DecoderLayer",
    "DecoderNorm",
    "EncoderLayer",
    "EncoderNorm",
    "OutputProjection",
    "SourceEmbedding",
]

EncoderStream = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
DecoderStream = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class _Embedding(nn.Module):
    """Token embedding times ``scale``, plus the library's positions, then dropout: the start of its encoder/decoder.

    ``position_offset`` is the number of tokens a decoding has cached before these (the library's cache length).
    """

    position_offset = 0

    def __init__(self, tokens: nn.Embedding, positions: nn.Module, scale: float, dropout: float, pad_id: int) -> None:
        super().__init__()
        self.tokens = tokens
        self.positions = positions
        self.scale = scale
        self.dropout = dropout
        self.pad_id = pad_id

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [B, L] long -> [B, L, D]
        x = self.tokens(ids) * self.scale
        if isinstance(self.positions, M2M100SinusoidalPositionalEmbedding):
            # M2M-100 (and NLLB) number the positions from the padding id and skip padding tokens, as fairseq does.
            positions = self.positions(ids, x, self.position_offset)
        else:  # Marian: a fixed sinusoidal table indexed 0, 1, 2, ...
            positions = self.positions(x.shape[:-1], self.position_offset)
        x = x + positions.to(x.device)
        return nn.functional.dropout(x, p=self.dropout, training=self.training)


class SourceEmbedding(_Embedding):
    """First entry: ``(source [B, S], target_in [B, T])`` -> encoder stream; the mask marks non-padding sources."""

    decoding_role = "encoder"

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> EncoderStream:
        source, target_in = inputs
        return self.embed(source), source != self.pad_id, target_in


class DecoderEmbedding(_Embedding):
    """Encoder stream -> decoder stream: embeds ``target_in`` with the decoder's table (usually the shared one)."""

    decoding_role = "decoder_embedding"

    def forward(self, stream: EncoderStream) -> DecoderStream:
        memory, source_mask, target_in = stream
        return memory, source_mask, self.embed(target_in)


class _Dropped(nn.Module):
    """A library layer with its layer drop: skipped with probability ``layerdrop`` in training, as the library does."""

    def __init__(self, layer: nn.Module, config: PretrainedConfig, layerdrop: float) -> None:
        super().__init__()
        self.layer = layer
        self.config = config  # not a module: which attention implementation the masks are built for
        self.layerdrop = layerdrop

    def dropped(self) -> bool:
        # The library draws torch.rand([]) only in training with a positive layer drop; so does this, to keep the
        # random stream (and so every dropout mask after it) identical.
        return self.training and self.layerdrop > 0.0 and bool(torch.rand([]) < self.layerdrop)


class EncoderLayer(_Dropped):
    """Encoder stream -> encoder stream through one library encoder layer (``M2M100EncoderLayer``, ...)."""

    decoding_role = "encoder"

    def forward(self, stream: EncoderStream) -> EncoderStream:
        x, source_mask, target_in = stream
        if self.dropped():
            return stream
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=x, attention_mask=source_mask)
        return self.layer(x, mask), source_mask, target_in


class DecoderLayer(_Dropped):
    """Decoder stream -> decoder stream through one library decoder layer: causal self-attention, cross-attention.

    ``cache``, set for the duration of a decoding round, is the library's ``EncoderDecoderCache`` (:meth:`new_cache`):
    the stream then holds the round's new tokens, and the memory (read in the first round) may be a placeholder of
    the source's length.
    """

    decoding_role = "decoder"
    cache: EncoderDecoderCache | None = None

    def forward(self, stream: DecoderStream) -> DecoderStream:
        memory, source_mask, y = stream
        if self.dropped():
            return stream
        B, T = y.shape[:2]
        # The library's decoder, given no decoder attention mask, builds the causal mask from an all-ones one (as long
        # as the cache and the new tokens). The fourth argument (the cache) goes by position: transformers renamed it.
        own, index = (None, None) if self.cache is None else (self.cache.self_attention_cache, self.layer_index)
        seen = 0 if own is None or index is None else own.get_seq_length(index)
        causal = create_causal_mask(self.config, y, torch.ones(B, seen + T, device=y.device), own, layer_idx=index)
        cross = create_bidirectional_mask(
            config=self.config, inputs_embeds=y, attention_mask=source_mask, encoder_hidden_states=memory
        )
        cached = {"cache": self.cache} if self.cache is not None else {}
        y = self.layer(y, causal, memory, encoder_attention_mask=cross, use_cache=self.cache is not None, **cached)
        return memory, source_mask, y

    @property
    def layer_index(self) -> int:
        """The library layer's index: its slot in a cache."""
        attention: Any = self.layer.self_attn
        return int(attention.layer_idx)

    def new_cache(self) -> EncoderDecoderCache:
        """An empty cache for the decoder layers of a stage (the library's, as its ``generate`` makes it)."""
        return EncoderDecoderCache(DynamicCache(config=self.config), DynamicCache(config=self.config))

    @property
    def cache_bytes_per_token(self) -> int:
        """The bytes of one position's keys and values in each of the layer's attentions, per sequence (a target
        token's in its self-attention, a source token's in its cross-attention)."""
        attention: Any = self.layer.self_attn
        return 2 * attention.num_heads * attention.head_dim * attention.k_proj.weight.dtype.itemsize


class EncoderNorm(nn.Module):
    """Encoder stream -> encoder stream with the encoder's final LayerNorm on x (pre-LN models: M2M-100, NLLB)."""

    decoding_role = "encoder"

    def __init__(self, norm: nn.LayerNorm) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, stream: EncoderStream) -> EncoderStream:
        x, source_mask, target_in = stream
        return self.norm(x), source_mask, target_in


class DecoderNorm(nn.Module):
    """Decoder stream -> decoder stream with the decoder's final LayerNorm on y."""

    decoding_role = "head"

    def __init__(self, norm: nn.LayerNorm) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, stream: DecoderStream) -> DecoderStream:
        memory, source_mask, y = stream
        return memory, source_mask, self.norm(y)


class OutputProjection(nn.Module):
    """Decoder stream -> logits [B, T, V]: the library's ``lm_head`` (its weight is the shared embedding's own
    ``nn.Parameter`` when the model ties them) plus Marian's ``final_logits_bias``."""

    decoding_role = "head"

    final_logits_bias: torch.Tensor | None

    def __init__(self, lm_head: nn.Linear, final_logits_bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.lm_head = lm_head
        self.register_buffer("final_logits_bias", final_logits_bias)

    def forward(self, stream: DecoderStream) -> torch.Tensor:
        logits = self.lm_head(stream[2])
        return logits if self.final_logits_bias is None else logits + self.final_logits_bias
