"""The GPipe paper's Transformers as flat layer sequences: T(L, H, A) and the decoder-only Transformer-L.

Shape legend: B batch, S source length, T target length, D ``d_model``, V ``vocab_size``, L ``num_layers``.

Encoder-decoder T(L, H, A) (lingvo's ``GPipeTransformerStack``), ``2L + 5`` entries::

    index         entry              value in -> value out
    0             SourceEmbedding    (source [B, S] long, target_in [B, T] long) -> (x [B, S, D], mask [B, S] bool,
                                                                                   target_in [B, T] long)
    1 .. L        EncoderLayer       (x, mask, target_in) -> (x, mask, target_in)
    L + 1         EncoderNorm        (x, mask, target_in) -> (memory [B, S, D], mask, target_in)
    L + 2         TargetEmbedding    (memory, mask, target_in) -> (memory, mask, y [B, T, D])
    L + 3 .. 2L+2 DecoderLayer       (memory, mask, y) -> (memory, mask, y)
    2L + 3        DecoderNorm        (memory, mask, y) -> y [B, T, D]
    2L + 4        Softmax            y -> logits [B, T, V]

:func:`encoder_slice` and :func:`decoder_slice` cut it in two, so that decoding runs the encoder once.

Decoder-only Transformer-L (lingvo's ``GPipeTransformerLm``), ``L + 2`` entries (``L + 3`` with ``final_norm``)::

    0             LanguageModelEmbedding  tokens [B, T] long -> x [B, T, D]
    1 .. L        LanguageModelLayer      x -> x
    (L + 1        nn.LayerNorm            x -> x, only with final_norm=True)
    last          Softmax                 x -> logits [B, T, V]

Parameter counts (V·D per embedding table, D·V + V for the softmax; attention width A·E with E = ``head_dim``):

- encoder layer: self-attention 4·D·A·E + 3·A·E + D, its LayerNorm 2·D; feed-forward 2·D·H + H + D, LayerNorm 2·D;
- decoder layer: the same plus a cross-attention of the same size and its LayerNorm;
- T(L, H, A) = L·(encoder + decoder layer) + 2·2·D (final norms) + 3·V·D + V. With D = 1024, V = 64000, E = 64 this
  gives 473,745,920 / 1,304,955,392 / 1,304,771,072 / 3,151,596,032 / 6,106,515,968 for T(6, 8192, 16),
  T(24, 8192, 16), T(12, 16384, 32), T(32, 16384, 32), T(64, 16384, 32): the paper's 1.3B / 1.3B / 3B / 6B to
  +0.4 / +0.4 / +5.1 / +1.8 %, but +18.4 % over its "400M" for T(6, 8192, 16). No lingvo-style structure fits all
  five; the "400M" reads as the nominal size of the Transformer-Big baseline the paper compares with (an inference,
  see ``reference/zoo-facts.md`` 2.4). A shared source/target embedding would give 408M for that model but miss the
  1.3B ones by 4.7 %.
- Transformer-L: each layer adds lingvo's ``per_dim_scale`` (E parameters) to its self-attention, and there is no
  final LayerNorm (lingvo's ``normalize_encoder`` is off in ``GPipeTransformerLm``): 50,358,336·L + 131,104,000 for
  D = 2048, H = 8192, A = 32, V = 32000, which rounds to all five of the paper's Table 1 figures.
"""

from __future__ import annotations

from torch import nn

from zoo.transformer.blocks import (
    DecoderLayer,
    DecoderNorm,
    EncoderLayer,
    EncoderNorm,
    LanguageModelEmbedding,
    LanguageModelLayer,
    SourceEmbedding,
    TargetEmbedding,
)
from zoo.transformer.layers import Softmax, fixup_scale

__all__ = ["decoder_slice", "encoder_slice", "transformer_layers", "transformer_lm_layers"]


def _check(name: str, value: float, *, minimum: float, fix: str) -> None:
    if not value >= minimum:
        raise ValueError(f"{name}={value} must be at least {minimum}; {fix}")


def _check_common(num_layers: int, num_heads: int, head_dim: int, d_model: int, ff_dim: int, dropout: float) -> None:
    _check("num_layers", num_layers, minimum=1, fix="a Transformer needs at least one layer")
    _check("num_heads", num_heads, minimum=1, fix="use at least one attention head")
    _check("head_dim", head_dim, minimum=1, fix="the GPipe models use 64 channels per head")
    _check("ff_dim", ff_dim, minimum=1, fix="the feed-forward width H of T(L, H, A)")
    _check("d_model", d_model, minimum=2, fix="the model width, an even number")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout={dropout} must be a probability in [0, 1), e.g. 0.1")


def transformer_layers(
    num_layers: int,
    ff_dim: int,
    num_heads: int,
    *,
    d_model: int = 1024,
    vocab_size: int = 64000,
    head_dim: int = 64,
    dropout: float = 0.1,
    ff_init_scaling: bool = True,
    logits_abs_max: float | None = None,
    pad_id: int = 0,
) -> nn.Sequential:
    """The encoder-decoder T(L=``num_layers``, H=``ff_dim``, A=``num_heads``) as one flat ``nn.Sequential``.

    ``ff_init_scaling`` scales every feed-forward matrix's Xavier-uniform init by ``num_layers ** -0.5`` (lingvo's
    ``XavierWithFixupParams(depth=L, layers_per_residual_block=1)``; each stack has L layers). ``logits_abs_max``
    clips training logits to [-m, m]. ``dropout`` is every dropout of lingvo's stack at once: after the embeddings,
    on each residual branch, on the attention probabilities and on the feed-forward hidden layer. See the module
    docstring for the protocol between entries.
    """
    _check_common(num_layers, num_heads, head_dim, d_model, ff_dim, dropout)
    _check("vocab_size", vocab_size, minimum=pad_id + 1, fix=f"the vocabulary must contain pad_id={pad_id}")
    gain = fixup_scale(num_layers) if ff_init_scaling else 1.0
    shape = (d_model, num_heads, head_dim, ff_dim, dropout)
    return nn.Sequential(
        SourceEmbedding(vocab_size, d_model, dropout, pad_id),
        *[EncoderLayer(*shape, ff_gain=gain) for _ in range(num_layers)],
        EncoderNorm(d_model),
        TargetEmbedding(vocab_size, d_model, dropout),
        *[DecoderLayer(*shape, ff_gain=gain) for _ in range(num_layers)],
        DecoderNorm(d_model),
        Softmax(d_model, vocab_size, logits_abs_max),
    )


def encoder_slice(num_layers: int) -> slice:
    """The entries of :func:`transformer_layers` that turn ``(source, target_in)`` into ``(memory, mask, _)``."""
    return slice(0, num_layers + 2)


def decoder_slice(num_layers: int) -> slice:
    """The entries of :func:`transformer_layers` that turn ``(memory, mask, target_in)`` into logits."""
    return slice(num_layers + 2, 2 * num_layers + 5)


def transformer_lm_layers(
    num_layers: int,
    *,
    d_model: int = 2048,
    ff_dim: int = 8192,
    num_heads: int = 32,
    vocab_size: int = 32000,
    head_dim: int | None = None,
    dropout: float = 0.1,
    ff_init_scaling: bool = True,
    logits_abs_max: float | None = None,
    final_norm: bool = False,
) -> nn.Sequential:
    """The decoder-only Transformer-L of the GPipe paper's Table 1 as one flat ``nn.Sequential``.

    ``head_dim`` defaults to ``d_model // num_heads`` (lingvo's LM splits D among the heads). ``final_norm`` adds a
    LayerNorm before the softmax, which lingvo's ``GPipeTransformerLm`` does not have (so it is off by default to keep
    the paper's parameter counts). ``ff_init_scaling`` and ``logits_abs_max`` as in :func:`transformer_layers`.
    """
    if head_dim is None:
        if d_model % num_heads:
            raise ValueError(
                f"d_model={d_model} is not divisible by num_heads={num_heads}; pass head_dim or change num_heads"
            )
        head_dim = d_model // num_heads
    _check_common(num_layers, num_heads, head_dim, d_model, ff_dim, dropout)
    _check("vocab_size", vocab_size, minimum=1, fix="the vocabulary needs at least one token")
    gain = fixup_scale(num_layers) if ff_init_scaling else 1.0
    layers = [
        LanguageModelLayer(d_model, num_heads, head_dim, ff_dim, dropout, per_dim_scale=True, ff_gain=gain)
        for _ in range(num_layers)
    ]
    norm = [nn.LayerNorm(d_model)] if final_norm else []
    return nn.Sequential(
        LanguageModelEmbedding(vocab_size, d_model, dropout),
        *layers,
        *norm,
        Softmax(d_model, vocab_size, logits_abs_max),
    )
