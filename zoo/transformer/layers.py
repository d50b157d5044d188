"""The building blocks of lingvo's GPipe Transformers: embeddings, attention, feed-forward and the softmax.

Shape legend: B batch, S source length, T target length, D model width (``d_model``), A heads, E channels per head
(``head_dim``, so the attention width is A·E, independent of D), F feed-forward width (``ff_dim``), V vocabulary.

Every module here initializes its own parameters in ``reset_parameters`` and holds no initialization logic for its
children, because ``GPipeStrategy`` materializes meta-device layers by calling ``reset_parameters`` on every
submodule, parents before children: a parent that re-initialized its children would be overwritten by them.

Residual blocks are pre-LayerNorm as in lingvo's ``TransformerAttentionLayer`` and ``TransformerFeedForwardLayer``:
``x + dropout(f(LayerNorm(x)))``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zoo.transformer.cache import AttentionCache

__all__ = [
    "FeedForward",
    "MultiHeadAttention",
    "PerDimScale",
    "Softmax",
    "TokenEmbedding",
    "XavierLinear",
    "fixup_scale",
    "sinusoidal_positions",
]


def fixup_scale(depth: int) -> float:
    """The init scale of lingvo's ``WeightInit.XavierWithFixupParams(depth=depth, layers_per_residual_block=1)``.

    ``depth ** -0.5``: with ``layers_per_residual_block=1`` lingvo scales by ``depth ** (-1 / (2 * 1))``.

    Why this rule: the paper only says the feed-forward init is scaled down "by the number of layers". lingvo's helper
    for it arrived in the same change as the GPipe stack's encoder normalization, so it is the closest public
    reading; the configs that set its arguments are not public. ``layers_per_residual_block=1`` is the helper's
    default, and its ``1/sqrt(L)`` keeps the summed variance of L residual branches constant in L, where a literal
    ``1/L`` would shrink the 64-layer models' feed-forward branches 64-fold.
    """
    if depth < 1:
        raise ValueError(f"depth={depth} must be a positive number of layers to scale the initialization by")
    return depth**-0.5


class XavierLinear(nn.Linear):
    """A linear layer initialized Xavier-uniform (lingvo's default ``WeightInit.Xavier``) times ``gain``, bias zero.

    The feed-forward layers use ``gain=fixup_scale(num_layers)`` to scale down their initialization by the depth, as
    the GPipe paper does to train deep Transformers (Section 5, following Fixup).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gain: float = 1.0) -> None:
        self.gain = gain  # read by reset_parameters, which nn.Linear.__init__ calls
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.weight, gain=self.gain)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gain={self.gain:.4g}"


class TokenEmbedding(nn.Embedding):
    """Token embedding scaled by √D on lookup, with N(0, 1/D) init so that scaled embeddings start at unit scale."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.embedding_dim**-0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, D]
        return super().forward(tokens) * math.sqrt(self.embedding_dim)


def sinusoidal_positions(length: int, dim: int, device: torch.device | None = None, start: int = 0) -> torch.Tensor:
    """Sinusoidal position signals [length, dim] of positions ``start, start + 1, ...`` (sines in the first half,
    cosines in the second, as lingvo and tensor2tensor). Computed on demand, so they hold no parameters and no
    buffers."""
    if dim % 2:
        raise ValueError(f"d_model={dim} must be even for sinusoidal positions (half sines, half cosines)")
    half = dim // 2
    increment = math.log(1.0e4) / max(half - 1, 1)
    inverse_timescales = torch.exp(torch.arange(half, device=device, dtype=torch.float32) * -increment)
    scaled = (
        torch.arange(start, start + length, device=device, dtype=torch.float32)[:, None] * inverse_timescales[None, :]
    )
    return torch.cat([scaled.sin(), scaled.cos()], dim=1)


class PerDimScale(nn.Module):
    """lingvo's ``per_dim_scale``: a learned scale per query channel, ``softplus(s) / (ln 2 · √E)``, 1/√E at init."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(head_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.scale)

    def forward(self, query: torch.Tensor) -> torch.Tensor:  # [B, A, T, E] -> same
        # softplus(0) = ln 2, so dividing by ln 2 makes the learned factor start at exactly 1.
        factor = F.softplus(self.scale) / (math.log(2.0) * math.sqrt(self.scale.numel()))
        return query * factor


class MultiHeadAttention(nn.Module):
    """Multi-head dot-product attention with biased Q, K, V and output projections (A·E wide inside).

    ``mask`` is boolean, True where a query may attend to a key, broadcastable to [B, A, T, S]. A query whose keys are
    all masked attends to all of them instead of producing NaN (only all-padding rows can be in that case). With a
    ``cache`` (decoding) the keys and values are kept: a self-attention's grow by this call's, a cross-attention's are
    computed from ``memory`` once and read after.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        head_dim: int,
        dropout: float = 0.0,
        per_dim_scale: bool = False,
    ) -> None:
        super().__init__()
        width = num_heads * head_dim
        self.num_heads, self.head_dim, self.dropout = num_heads, head_dim, dropout
        self.query = XavierLinear(d_model, width)
        self.key = XavierLinear(d_model, width)
        self.value = XavierLinear(d_model, width)
        self.output = XavierLinear(width, d_model)
        self.per_dim_scale = PerDimScale(head_dim) if per_dim_scale else None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, A·E] -> [B, A, T, E]
        B, T, _ = x.shape
        return x.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor, cache: AttentionCache | None = None
    ) -> torch.Tensor:
        """Attend from ``x`` [B, T, D] to ``memory`` [B, S, D] under ``mask``; returns [B, T, D]."""
        q = self._heads(self.query(x))
        if cache is not None and cache.filled and not cache.grow:
            k, v = cache.kept()
        else:
            k, v = self._heads(self.key(memory)), self._heads(self.value(memory))
            if cache is not None:
                k, v = cache.update(k, v)
        if self.per_dim_scale is not None:
            q, scale = self.per_dim_scale(q), 1.0
        else:
            scale = self.head_dim**-0.5
        mask = mask | ~mask.any(dim=-1, keepdim=True)
        context = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, scale=scale
        )  # [B, A, T, E]
        B, _, T, _ = context.shape
        return self.output(context.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class FeedForward(nn.Module):
    """The position-wise feed-forward block D -> F -> D with ReLU, biases and Fixup-scaled init (``gain``)."""

    def __init__(self, d_model: int, ff_dim: int, dropout: float = 0.0, gain: float = 1.0) -> None:
        super().__init__()
        self.inner = XavierLinear(d_model, ff_dim, gain=gain)
        self.outer = XavierLinear(ff_dim, d_model, gain=gain)
        self.dropout = nn.Dropout(dropout)  # lingvo's relu_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, T, D]
        return self.outer(self.dropout(F.relu(self.inner(x))))


class Softmax(nn.Module):
    """The output projection D -> V with bias (lingvo's ``SimpleFullSoftmax``), returning logits.

    With ``logits_abs_max`` set, training-mode logits are clamped to [-m, m] (lingvo's ``logits_abs_max``, the GPipe
    paper's logit clipping); the gradient of a clamped logit is zero. Eval mode (validation, decoding) sees the raw
    logits, as lingvo's inference graphs do.
    """

    decoding_role = "head"  # while decoding (zoo.transformer.search): the last position's logits only

    def __init__(self, d_model: int, vocab_size: int, logits_abs_max: float | None = None) -> None:
        super().__init__()
        if logits_abs_max is not None and not logits_abs_max > 0:
            raise ValueError(f"logits_abs_max={logits_abs_max} must be a positive bound, or None for no clipping")
        self.projection = XavierLinear(d_model, vocab_size)
        self.logits_abs_max = logits_abs_max

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, T, V]
        logits = self.projection(x)
        if self.logits_abs_max is not None and self.training:
            logits = logits.clamp(-self.logits_abs_max, self.logits_abs_max)
        return logits

    def extra_repr(self) -> str:
        return f"logits_abs_max={self.logits_abs_max}"
