"""Greedy and sampled decoding for a :class:`~zoo.tasks.causal_lm.PretrainedCausalLM`, on the whole model or inside a
step under ``GPipeStrategy``.

Shape legend: B batch, P prompt length (left-padded), n generated tokens, V vocabulary.

It reproduces ``transformers``' ``generate``: positions count each row's real tokens, so left padding changes nothing;
greedy takes the arg-max; sampling applies temperature, then top-k, then top-p (nucleus) as its logits warpers do, and
draws from a ``torch.Generator`` seeded with ``seed`` (``torch.manual_seed(seed)`` before ``generate`` draws the same
tokens on the CPU); a row stops after an end-of-sequence token and is padded after it.

On the whole model (after ``fit``) the decoder layers keep the library's key/value cache (``DynamicCache``): the
prompt is read once, then each step feeds one token. Inside a ``validation_step`` or ``predict_step`` under
``GPipeStrategy``, where ``model.layers`` is the pipelined sequence, every token is one call of the whole sequence on
the whole prefix, which the strategy relays through the stages (:mod:`lightning_gpipe.engine.relay`): a call there is a
step of its own, after which a stage keeps nothing, so there is no cache and each step re-reads the prefix (O(n²) work).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from zoo.hf.causal_lm_layers import CausalDecoderLayer, TokenEmbedding
from zoo.transformer.decoding import holds_all_layers

__all__ = ["MAX_NEW_TOKENS", "generate", "warp_logits"]

MAX_NEW_TOKENS = 32
"""How many tokens :func:`generate` adds to each prompt unless told otherwise."""


def warp_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """``logits`` [B, V] divided by ``temperature``, with the tokens outside the ``top_k`` best and outside the
    smallest set whose probability reaches ``top_p`` set to ``-inf`` (0 and 1.0 turn either filter off)."""
    if temperature != 1.0:
        logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = logits.sort(dim=-1)
        # Drop the least likely tokens while what they hold together stays within 1 - top_p; the best one stays.
        drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop[:, -1] = False
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits


@contextmanager
def _cached(layers: nn.Module) -> Iterator[bool]:
    """A fresh key/value cache in the embedding and every decoder layer of ``layers`` for the duration (True), or
    none (False) when ``layers`` is the pipelined sequence."""
    holders = [] if not holds_all_layers(layers) else [
        layer for layer in layers.children() if isinstance(layer, TokenEmbedding | CausalDecoderLayer)
    ]  # fmt: skip
    if holders:
        assert isinstance(holders[0], TokenEmbedding), type(holders[0])
        cache = DynamicCache(config=holders[0].config)
        for layer in holders:
            layer.cache = cache
    try:
        yield bool(holders)
    finally:
        for layer in holders:
            layer.cache = None


def generate(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = MAX_NEW_TOKENS,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_token_id: int | Sequence[int] = (),
    pad_token_id: int = 0,
) -> torch.Tensor:
    """The prompts ``input_ids`` [B, P] (left-padded; ``attention_mask`` 0 at padding) followed by up to
    ``max_new_tokens`` tokens each, [B, P + n], as ``generate`` returns them; rows that ended with an
    ``eos_token_id`` are padded with ``pad_token_id``. ``model`` is a
    :class:`~zoo.tasks.causal_lm.PretrainedCausalLM` (any module whose ``layers`` take ``(input_ids,
    attention_mask)`` to logits).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
    if do_sample and not (temperature > 0 and top_k >= 0 and 0 < top_p <= 1):
        raise ValueError(
            f"temperature={temperature}, top_k={top_k}, top_p={top_p}: sampling needs temperature > 0, top_k >= 0 "
            "(0: off) and 0 < top_p <= 1 (1: off)"
        )
    if attention_mask is not None and bool((attention_mask[:, -1] == 0).any()):
        raise ValueError(
            "a prompt ends with padding (attention_mask[:, -1] == 0): decoding continues every row from its last "
            "position, so pad prompts on the left (tokenizer.padding_side = 'left')"
        )
    eos = torch.as_tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), dtype=torch.long)
    eos = eos.to(input_ids.device)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
    generator = None
    if do_sample and seed is not None:
        generator = torch.Generator(input_ids.device).manual_seed(seed)
    was_training = model.training
    model.train(False)
    tokens = input_ids
    try:
        with torch.no_grad(), _cached(model.layers) as cached:
            done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
            fed = tokens
            for _ in range(max_new_tokens):
                logits = model.layers((fed, mask))[:, -1].float()  # [B, V]
                if do_sample:
                    probabilities = warp_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
                    step = torch.multinomial(probabilities, 1, generator=generator).squeeze(1)
                else:
                    step = logits.argmax(dim=-1)
                step = torch.where(done, pad_token_id, step)
                tokens = torch.cat([tokens, step[:, None]], dim=1)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                fed = step[:, None] if cached else tokens
                done |= torch.isin(step, eos)
                if bool(done.all()):
                    break
    finally:
        model.train(was_training)
    return tokens
