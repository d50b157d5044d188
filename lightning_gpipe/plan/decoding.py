"""The memory of a decoding call on each stage: the stage's weights and its layers' key/value caches.

A decoding call (:mod:`~lightning_gpipe.engine.decoding`) keeps, on every stage and for the whole call, the keys and
values of each attention layer the stage holds, for every sequence and every token decoded so far: ``bytes per token
per layer`` × sequences × tokens. A layer that keeps a cache says its bytes per token (per sequence) as
``cache_bytes_per_token``, as the zoo's decoder layers do (a Hugging Face decoder-only layer: ``2 × key/value heads ×
head size × dtype bytes``; an encoder-decoder's decoder layer counts its cross-attention's source tokens as tokens
too). This is what the engine checks before a call's first round against each stage's free memory, and what
:func:`decoding_memory` predicts for a balance before any process starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from lightning_gpipe.partition.balance import cell_bounds

__all__ = ["StageDecodingMemory", "cache_bytes_per_token", "decoding_memory"]


@dataclass(frozen=True)
class StageDecodingMemory:
    """Predicted bytes of one stage during a decoding call."""

    weights: float  # parameters and buffers
    cache: float  # the key/value caches of its layers, at the call's end
    per_token: float  # the cache's bytes per token and sequence, all its layers together

    @property
    def total(self) -> float:
        """Weights and caches (activations of a round, one token per sequence, are small beside them)."""
        return self.weights + self.cache


def cache_bytes_per_token(layer: nn.Module) -> int:
    """The bytes ``layer``'s key/value cache takes per token and sequence (0 for a layer without a cache)."""
    return int(getattr(layer, "cache_bytes_per_token", 0))


def decoding_memory(
    layers: nn.Sequential, balance: Sequence[int], *, sequences: int, tokens: int
) -> list[StageDecodingMemory]:
    """Each stage's memory during a decoding call of ``sequences`` sequences (prompts, or sources times beams) of up to
    ``tokens`` tokens each (the prompt and the new tokens; for an encoder-decoder, the source's too), for the stages
    ``balance`` cuts ``layers`` into.

    Raises:
        ValueError: a ``balance`` that does not cut ``layers``, or a negative count.
    """
    if sum(balance) != len(layers) or any(size < 1 for size in balance):
        raise ValueError(f"balance={list(balance)} must give each stage at least one of the {len(layers)} layers")
    if sequences < 0 or tokens < 0:
        raise ValueError(f"sequences={sequences} and tokens={tokens} must be >= 0")
    stages = []
    for cell_range in cell_bounds(list(balance)):
        cell = [layers[i] for i in cell_range]
        # A tensor that two of the stage's layers share (a tied embedding) counts once; each stage holds its own copy.
        held = {id(t): t for layer in cell for t in [*layer.parameters(), *layer.buffers()]}
        weights = sum(t.numel() * t.element_size() for t in held.values())
        per_token = sum(cache_bytes_per_token(layer) for layer in cell)
        stages.append(StageDecodingMemory(float(weights), float(per_token * sequences * tokens), float(per_token)))
    return stages
