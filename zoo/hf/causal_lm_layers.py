"""The entries of a Hugging Face decoder-only language model as a flat layer sequence: wrappers around its own modules.

Shape legend: B batch, T sequence length, D hidden size, V vocabulary, H rotary width (the attention head size).

Each entry holds the ``transformers`` modules it runs (the token embedding, a ``LlamaDecoderLayer`` or ``GPT2Block``,
the final norm, ``lm_head``) and repeats only the glue of the library's ``forward`` between them: position ids, the
rotary table (computed once by the model's own rotary module, as the library does), the attention mask (built per
layer with the library's ``create_causal_mask``/``create_sliding_window_causal_mask``, so every attention
implementation gets the mask it expects) and GPT-2's learned positions and embedding dropout. The values between
entries are tensors or tuples of tensors, so any entry can be a pipeline stage boundary:

- input ``(input_ids [B, T] long, attention_mask [B, T] long)``, 1 at real tokens (either padding side), or
  ``input_ids`` alone (no padding);
  ``attention_mask`` is [B, C + T] when a key/value cache holds ``C`` earlier tokens;
- stream ``(x [B, T, D], attention_mask [B, T], positions [B, T] long, *rotary)`` with ``rotary = (cos [B, T, H],
  sin [B, T, H])`` for models with rotary embeddings, empty for GPT-2;
- after the final norm, ``x [B, T, D]``; after the head, logits [B, T, V].

Positions count the real tokens (``attention_mask.cumsum(-1) - 1``, 0 at padding), as ``generate`` numbers them: with
right padding or none they are ``0, 1, 2, ...`` at every real token, as in the library's forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

__all__ = ["CausalDecoderLayer", "FinalNorm", "LanguageModelHead", "TokenEmbedding"]

Stream = tuple[torch.Tensor, ...]


class TokenEmbedding(nn.Module):
    """First entry: ``(input_ids, attention_mask)`` -> stream. Runs the model's token embedding (Gemma's scales
    itself), GPT-2's learned positions and embedding dropout where given, and the rotary module where given."""

    def __init__(
        self,
        tokens: nn.Embedding,
        rotary: nn.Module | None = None,
        positions: nn.Embedding | None = None,
        dropout: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.tokens = tokens
        self.rotary = rotary
        self.positions = positions
        self.dropout = dropout

    def forward(self, inputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> Stream:
        # input_ids alone (no padding) is what a profiler or planner feeds the first layer from a sample shape.
        ids, mask = (inputs, torch.ones_like(inputs)) if isinstance(inputs, torch.Tensor) else inputs
        # mask [B, C + T]: it also covers the C tokens of a key/value cache
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, -ids.shape[1] :]  # [B, T]
        x = self.tokens(ids)  # [B, T, D]
        if self.positions is not None:
            x = x + self.positions(positions)
        if self.dropout is not None:
            x = self.dropout(x)
        rotary = tuple(self.rotary(x, positions)) if self.rotary is not None else ()
        return (x, mask, positions, *rotary)


class CausalDecoderLayer(nn.Module):
    """Stream -> stream through one library decoder layer, with the causal (or sliding-window) mask of its type.

    ``cache``, set for the duration of a decoding on the whole model (:mod:`zoo.hf.causal_lm_generation`), is the
    library's key/value cache that the layer reads and extends; the stream then holds the new tokens only.
    """

    cache: Any = None

    def __init__(self, layer: nn.Module, config: PretrainedConfig, index: int, sliding: bool) -> None:
        super().__init__()
        self.layer = layer
        self.config = config  # not a module: which attention implementation the masks are built for
        self.index = index  # the library's layer_idx: which entry of the cache is this layer's
        self.sliding = sliding

    def forward(self, stream: Stream) -> Stream:
        x, mask, positions, *rotary = stream
        build = create_sliding_window_causal_mask if self.sliding else create_causal_mask
        # The fourth argument (the cache) goes by position: transformers renamed it past_key_values -> cache. The
        # cached length is this layer's own, read before the layer extends it (the library reads it before any layer).
        # On the meta device (sizing a model, planning it) there are no values to read: build the mask unpadded.
        padding, order = (None, None) if mask.is_meta else (mask, positions)
        attention = build(self.config, x, padding, self.cache, order, layer_idx=self.index)
        extra: dict[str, Any] = {"position_embeddings": tuple(rotary)} if rotary else {}
        if self.cache is not None:
            extra.update(cache=self.cache, use_cache=True)
        x = self.layer(x, attention_mask=attention, position_ids=positions, **extra)
        return (x, mask, positions, *rotary)


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
