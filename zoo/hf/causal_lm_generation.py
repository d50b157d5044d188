"""Greedy and sampled decoding for a :class:`~zoo.tasks.causal_lm.PretrainedCausalLM`, on the whole model or inside a
step under ``GPipeStrategy``, with the library's key/value cache.

Shape legend: B batch, P prompt length (left-padded), n generated tokens, V vocabulary, b a micro-batch's rows.

It reproduces ``transformers``' ``generate``: positions count each row's real tokens, so left padding changes nothing;
the prompt is read once into a ``DynamicCache``, then each round feeds one token per row, and the logits of the last
position alone are computed; greedy takes the arg-max; sampling applies temperature, then top-k, then top-p (nucleus)
as its logits warpers do, and draws from a ``torch.Generator`` seeded with ``seed`` (``torch.manual_seed(seed)``
before ``generate`` draws the same tokens on the CPU); a row stops after an end-of-sequence token and is padded after
it.

A call is a decoding in rounds (:mod:`zoo.decoding`): on the whole model one part holds every row; under the pipeline
each stage keeps a cache of its own layers for each micro-batch of rows. A stage that receives the stream rebuilds its
masks from the rows' attention mask and its own cache (the library's mask functions, sized against a layer it holds),
so only the new tokens' hidden states, positions and rotary tables cross stages; the last stage sends back the chosen
tokens. Sampled tokens are drawn in the order the whole batch draws them (round by round, rows in order, the rows of
a finished micro-batch drawn and dropped while others decode), so a seeded call gives the whole model's tokens under
any number of stages and micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from zoo.decoding import attached, run_decoding
from zoo.hf.causal_lm_layers import CausalDecoderLayer, FinalNorm, TokenEmbedding

__all__ = ["MAX_NEW_TOKENS", "CausalLMDecoding", "generate", "warp_logits"]

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


@dataclass
class CausalLMDecoding:
    """One :func:`generate` call as a decoding call (:mod:`zoo.decoding`): the prompts ``input_ids`` [B, P]
    (left-padded; ``attention_mask`` 0 at padding) and the settings of :func:`generate`.

    ``max_positions`` is the model's number of learned positions (GPT-2's), which a prompt and its new tokens must fit;
    ``None`` where positions are computed (rotary). Bad settings are refused here, on every stage alike.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    max_new_tokens: int = MAX_NEW_TOKENS
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int = 0
    max_positions: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be at least 1")
        if self.do_sample and not (self.temperature > 0 and self.top_k >= 0 and 0 < self.top_p <= 1):
            raise ValueError(
                f"temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}: sampling needs "
                "temperature > 0, top_k >= 0 (0: off) and 0 < top_p <= 1 (1: off)"
            )
        if self.attention_mask.shape != self.input_ids.shape:
            raise ValueError(
                f"attention_mask of shape {tuple(self.attention_mask.shape)} for input_ids of shape "
                f"{tuple(self.input_ids.shape)}; give one mask value per token"
            )
        if bool((self.attention_mask[:, -1] == 0).any()):
            raise ValueError(
                "a prompt ends with padding (attention_mask[:, -1] == 0): decoding continues every row from its last "
                "position, so pad prompts on the left (tokenizer.padding_side = 'left')"
            )
        longest = int(self.attention_mask.sum(dim=1).max()) if self.rows else 0
        if self.max_positions is not None and longest + self.max_new_tokens - 1 > self.max_positions:
            raise ValueError(
                f"a prompt of {longest} tokens and max_new_tokens={self.max_new_tokens} need "
                f"{longest + self.max_new_tokens - 1} positions, but the model has {self.max_positions}; shorten the "
                "prompt or max_new_tokens"
            )
        self._draws = _Draws(self.seed)  # shared by the parts of one stage: only the last stage's draws

    @property
    def rows(self) -> int:
        """The number of prompts."""
        return int(self.input_ids.shape[0])

    def part(self, rows: slice) -> _CausalPart:
        """The prompts ``rows`` on one stage."""
        return _CausalPart(self, rows, self._draws.add(rows.stop - rows.start))

    def join(self, results: list[torch.Tensor]) -> torch.Tensor:
        """The parts' tokens [b, P + n_m] as one [B, P + n], the rows that stopped sooner padded."""
        width = max(tokens.shape[1] for tokens in results)
        return torch.cat([nn.functional.pad(t, (0, width - t.shape[1]), value=self.pad_token_id) for t in results])

    def cache_bytes(self, cell: nn.Module, rows: int) -> int:
        """The bytes the caches of ``cell``'s decoder layers hold at the end of the call, for ``rows`` prompts."""
        tokens = self.input_ids.shape[1] + self.max_new_tokens
        total = 0
        for layer in cell.children():
            if isinstance(layer, CausalDecoderLayer):
                window = getattr(layer.attention.config, "sliding_window", None) if layer.sliding else None
                total += layer.cache_bytes_per_token * rows * min(tokens, window or tokens)
        return total


class _Draws:
    """The sampled tokens of every part of a call, drawn from one generator in the order the whole batch draws them:
    round by round, the rows in order; a finished part's rows are drawn and dropped while another part decodes, as
    the whole batch draws for its finished rows until every row is done."""

    def __init__(self, seed: int | None) -> None:
        self.seed = seed
        self.generator: torch.Generator | None = None
        self.sizes: list[int] = []
        self.cursor = (0, 0)  # the next draw: (round, part)

    def add(self, size: int) -> int:
        """Register a part of ``size`` rows; its index."""
        self.sizes.append(size)
        return len(self.sizes) - 1

    def draw(self, part: int, round_: int, probabilities: torch.Tensor) -> torch.Tensor:
        """Part ``part``'s tokens [b] at round ``round_``, from ``probabilities`` [b, V]."""
        if self.generator is None and self.seed is not None:
            self.generator = torch.Generator(probabilities.device).manual_seed(self.seed)
        while self.cursor != (round_, part):  # parts finished before this round: the whole batch still draws theirs
            skipped = torch.ones(self.sizes[self.cursor[1]], probabilities.shape[1], device=probabilities.device)
            torch.multinomial(skipped, 1, generator=self.generator)
            self._advance()
        self._advance()
        return torch.multinomial(probabilities, 1, generator=self.generator).squeeze(1)

    def _advance(self) -> None:
        round_, part = self.cursor
        self.cursor = (round_, part + 1) if part + 1 < len(self.sizes) else (round_ + 1, 0)


class _CausalPart:
    """Prompts ``rows`` of a :class:`CausalLMDecoding` on one stage: the stage's cache, the mask so far, the tokens."""

    def __init__(self, decoding: CausalLMDecoding, rows: slice, index: int) -> None:
        self.decoding = decoding
        self.index = index
        self.ids = decoding.input_ids[rows]  # [b, P]
        self.mask = decoding.attention_mask[rows].long()  # [b, P + rounds so far]
        self.eos = torch.as_tensor(decoding.eos_token_id, dtype=torch.long, device=self.ids.device)
        self.cache: DynamicCache | None = None
        self.tokens: list[torch.Tensor] = []  # each round's chosen tokens [b]
        self.done = torch.zeros(self.ids.shape[0], dtype=torch.bool, device=self.ids.device)

    def first(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids, self.mask

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[-1][:, None], self.mask

    def run(self, cell: nn.Module, value: Any) -> Any:
        """``cell``'s layers on ``value`` with this part's cache; a stream without its masks (the next stage rebuilds
        them), or the last position's logits [b, 1, V]."""
        layers = list(cell.children())
        if self.cache is None:
            self.cache = DynamicCache(config=_library_config(layers))
        with attached(layers, cache=self.cache):
            masked = isinstance(layers[0], TokenEmbedding)  # the embedding builds the masks of its own stage
            for layer in layers:
                if isinstance(layer, CausalDecoderLayer) and not masked:
                    value, masked = self._with_masks(value, layers), True
                if isinstance(layer, FinalNorm):
                    value = (value[0][:, -1:], *value[1:])  # only the last position's logits are needed
                value = layer(value)
        if isinstance(value, tuple):
            x, _full, _sliding, positions, *rotary = value
            return (x, None, None, positions, *rotary)
        return value

    def _with_masks(self, stream: tuple[Any, ...], layers: list[nn.Module]) -> tuple[Any, ...]:
        """The received ``stream`` with the masks of this stage's layers, sized against the first it holds of each
        kind (``layers``' others hold nothing in this stage's cache)."""
        x, _full, _sliding, positions, *rotary = stream
        held = [layer for layer in layers if isinstance(layer, CausalDecoderLayer)]
        config: Any = held[0].attention.config
        masks: dict[bool, Any] = {}
        for sliding, build in ((False, create_causal_mask), (True, create_sliding_window_causal_mask)):
            first = next((layer for layer in held if layer.sliding == sliding), None)
            if first is not None:
                attention: Any = first.attention
                index = int(attention.layer_idx)
                masks[sliding] = build(config, x, self.mask, self.cache, positions, layer_idx=index)
        return (x, masks.get(False), masks.get(True), positions, *rotary)

    def choose(self, output: torch.Tensor) -> tuple[torch.Tensor, bool]:
        decoding = self.decoding
        logits = output[:, -1].float()  # [b, V]
        if decoding.do_sample:
            warped = warp_logits(logits, decoding.temperature, decoding.top_k, decoding.top_p)
            step = decoding._draws.draw(self.index, len(self.tokens), warped.softmax(dim=-1))
        else:
            step = logits.argmax(dim=-1)
        step = torch.where(self.done, decoding.pad_token_id, step)
        done = self.done | torch.isin(step, self.eos)
        return step, bool(done.all()) or len(self.tokens) + 1 == decoding.max_new_tokens

    def follow(self, control: torch.Tensor) -> None:
        self.tokens.append(control)
        self.done |= torch.isin(control, self.eos)
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)

    def result(self) -> torch.Tensor:
        return torch.cat([self.ids, torch.stack(self.tokens, dim=1)], dim=1)


def _library_config(layers: list[nn.Module]) -> Any:
    """The library config of the model ``layers`` belong to (``None`` for a stage with no cached layer)."""
    for layer in layers:
        if isinstance(layer, TokenEmbedding):
            return layer.config
        if isinstance(layer, CausalDecoderLayer):
            return layer.attention.config
    return None


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
    :class:`~zoo.tasks.causal_lm.PretrainedCausalLM` (any module whose ``layers`` are :mod:`zoo.hf.causal_lm_layers`'
    entries; its ``max_positions``, where it has one, bounds the prompt and its new tokens).
    """
    decoding = CausalLMDecoding(
        input_ids,
        torch.ones_like(input_ids) if attention_mask is None else attention_mask,
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        eos_token_id=(eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id),
        pad_token_id=pad_token_id,
        max_positions=getattr(model, "max_positions", None),
    )
    was_training = model.training
    model.train(False)
    try:
        with torch.no_grad():
            tokens: torch.Tensor = run_decoding(model.layers, decoding)
    finally:
        model.train(was_training)
    return tokens
