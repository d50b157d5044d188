"""The entries of a Hugging Face decoder-only language model as a flat layer sequence: wrappers around its own modules.

Shape legend: B batch, T sequence length, C cached tokens, D hidden size, V vocabulary, H rotary width (the attention
head size).

Each entry holds the ``transformers`` modules it runs (the token embedding, a ``LlamaDecoderLayer`` or ``GPT2Block``,
the final norm, ``lm_head``) and repeats only the glue of the library's ``forward`` between them: position ids, the
rotary table (computed once by the model's own rotary module, as the library does), the attention masks (built once
per forward by the library's ``create_causal_mask``/``create_sliding_window_causal_mask``, as the library does, so
every attention implementation gets the mask it expects) and GPT-2's learned positions and embedding dropout. The
values between entries are tensors (or ``None``) or tuples of them, so any entry can be a pipeline stage boundary:

- input ``(input_ids [B, T] long, attention_mask [B, T] long)``, 1 at real tokens (either padding side), or
  ``input_ids`` alone (no padding), or ``(input_ids, attention_mask or None, position_ids [B, T] long)``: packed
  sequences (``DataCollatorWithFlattening``: positions restart at 0 with each sequence, no ``attention_mask``);
  ``attention_mask`` is [B, C + T] when a key/value cache holds ``C`` earlier tokens;
- stream ``(x [B, T, D], full, sliding, positions [B, T] long, *rotary)``: ``full`` and ``sliding`` are the masks of
  the full-attention and the sliding-window layers in the attention implementation's format ([B, 1, T, C + T] for
  SDPA and eager attention), ``None`` where the model has no such layer or the implementation needs none (SDPA's
  causal kernel, nothing padded); ``rotary`` holds one ``(cos [B, T, H], sin [B, T, H])`` pair per rotary table (one
  for most models; Gemma 3 and OLMo 3 have one per layer type, the full-attention and the sliding-window layers'),
  empty for GPT-2;
- after the final norm, ``x [B, T, D]``; after the head, logits [B, T, V].

Positions are the ``position_ids`` given, else count the real tokens (``attention_mask.cumsum(-1) - 1``, 0 at
padding), as ``generate`` numbers them: with right padding or none they are ``0, 1, 2, ...`` at every real token, as
in the library's forward. Given ``position_ids`` and no ``attention_mask``, the library's mask functions find the
packed sequences from the positions (a new sequence wherever they do not go up by one) and keep attention within each,
as the library's forward does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

__all__ = ["CausalDecoderLayer", "FinalNorm", "LanguageModelHead", "TokenEmbedding"]

Stream = tuple[Any, ...]  # tensors, and None for a mask not needed


class TokenEmbedding(nn.Module):
    """First entry: ``(input_ids, attention_mask[, position_ids])`` -> stream. Runs the model's token embedding
    (Gemma's scales itself), GPT-2's learned positions and embedding dropout where given, the rotary module where given
    (once per table: ``rotary_types`` names the layer types of a module with one table each, empty for one table), and
    builds the masks of the decoder layers' kinds (``full``, ``sliding``) for the attention implementation of
    ``config``.

    ``cache``, set for the duration of a decoding round (:mod:`zoo.hf.causal_lm_generation`), is the library's
    key/value cache, whose lengths the masks cover (read before any layer extends it, as the library does).
    """

    cache: Any = None

    def __init__(
        self,
        tokens: nn.Embedding,
        config: PretrainedConfig,
        full: bool = True,
        sliding: bool = False,
        rotary: nn.Module | None = None,
        positions: nn.Embedding | None = None,
        dropout: nn.Module | None = None,
        rotary_types: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self.tokens = tokens
        self.config = config  # not a module: which attention implementation the masks are built for
        self.full = full
        self.sliding = sliding
        self.rotary = rotary
        self.positions = positions
        self.dropout = dropout
        self.rotary_types = rotary_types

    def forward(self, inputs: torch.Tensor | tuple[Any, ...]) -> Stream:
        # input_ids alone (no padding) is what a profiler or planner feeds the first layer from a sample shape.
        ids: torch.Tensor = inputs if isinstance(inputs, torch.Tensor) else inputs[0]
        mask, given = (None, None) if isinstance(inputs, torch.Tensor) else (*inputs[1:], None)[:2]
        if given is None:  # mask [B, C + T]: it also covers the C tokens of a key/value cache
            mask = torch.ones_like(ids) if mask is None else mask
            positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, -ids.shape[1] :]  # [B, T]
        else:
            positions = given  # packed sequences (no mask) or the caller's own positions
        x = self.tokens(ids)  # [B, T, D]
        if self.positions is not None:
            x = x + self.positions(positions)
        if self.dropout is not None:
            x = self.dropout(x)
        if self.rotary is None:
            rotary: tuple[torch.Tensor, ...] = ()
        elif self.rotary_types:  # one table per layer type, in the order the layers index them
            rotary = tuple(part for kind in self.rotary_types for part in self.rotary(x, positions, kind))
        else:
            rotary = tuple(self.rotary(x, positions))
        # Once per forward, not per layer: SDPA's "is anything padded?" check reads the mask's values (a host sync).
        # The fourth argument (the cache) goes by position: transformers renamed it past_key_values -> cache.
        # On the meta device (sizing a model, planning it) there are no values to read: build the masks unpadded.
        padding, order = (None, None) if ids.is_meta else (mask, positions)
        arguments = (self.config, x, padding, self.cache, order)
        full = create_causal_mask(*arguments) if self.full else None
        sliding = create_sliding_window_causal_mask(*arguments) if self.sliding else None
        return (x, full, sliding, positions, *rotary)


class CausalDecoderLayer(nn.Module):
    """Stream -> stream through one library decoder layer, with the stream's causal (or sliding-window) mask and its
    rotary table ``table`` (0 but for models with one table per layer type).

    ``cache``, set for the duration of a decoding round (:mod:`zoo.hf.causal_lm_generation`), is the library's
    key/value cache that the layer reads and extends; the stream then holds the new tokens only.
    """

    cache: Any = None

    def __init__(self, layer: nn.Module, sliding: bool, table: int = 0) -> None:
        super().__init__()
        self.layer = layer
        self.sliding = sliding
        self.table = table

    def forward(self, stream: Stream) -> Stream:
        x, full, sliding, positions, *rotary = stream
        pair = tuple(rotary[2 * self.table : 2 * self.table + 2])
        extra: dict[str, Any] = {"position_embeddings": pair} if pair else {}
        if self.cache is not None:
            extra.update(cache=self.cache, use_cache=True)
        x = self.layer(x, attention_mask=sliding if self.sliding else full, position_ids=positions, **extra)
        return (x, full, sliding, positions, *rotary)

    @property
    def attention(self) -> nn.Module:
        """The library layer's self-attention: its ``config``, and its ``layer_idx``, the layer's slot in a cache."""
        layer: Any = self.layer
        attention: nn.Module = getattr(layer, "self_attn", None) or layer.attn  # GPT-2's is `attn`
        return attention

    @property
    def cache_bytes_per_token(self) -> int:
        """The bytes of one token's keys and values in this layer's cache, per sequence."""
        attention: Any = self.attention
        config = attention.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        itemsize = next(attention.parameters()).dtype.itemsize
        return 2 * heads * attention.head_dim * itemsize


class FinalNorm(nn.Module):
    """Stream -> x [B, T, D] through the model's final norm (``norm``; GPT-2's ``ln_f``)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, stream: Stream) -> torch.Tensor:
        return self.norm(stream[0])


class LanguageModelHead(nn.Module):
    """x [B, T, D] -> logits [B, T, V]: the library's ``lm_head`` (the embedding's own ``nn.Parameter`` when tied)."""

    def __init__(self, lm_head: nn.Linear) -> None:
        super().__init__()
        self.lm_head = lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(x)
