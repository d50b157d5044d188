"""The key/value cache of a Transformer's decoder layers while decoding: what each attention keeps between rounds.

Shape legend: N rows (sequences, or hypotheses of a beam search), A heads, E channels per head, S source length, C
target tokens cached.

Each decoder layer keeps two entries, found by the layer: its self-attention's keys and values [N, A, C, E], which each
round extends by its new tokens, and its cross-attention's [N, A, S, E], computed from the encoder output once, in the
first round. A beam search moves each hypothesis's entries to its continuation's row
(:meth:`DecoderCache.reorder_cache`, the name ``transformers``' caches use); the cross-attention entries need not move,
since the hypotheses of one source share them.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["AttentionCache", "DecoderCache"]


class AttentionCache:
    """One attention's keys and values [N, A, L, E]: ``grow`` appends each call's (self-attention), else they are set
    once and read after (cross-attention)."""

    def __init__(self, grow: bool) -> None:
        self.grow = grow
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep this call's ``keys`` and ``values``; all of them so far."""
        if self.grow and self.keys is not None and self.values is not None:
            keys, values = torch.cat([self.keys, keys], dim=2), torch.cat([self.values, values], dim=2)
        self.keys, self.values = keys, values
        return keys, values

    def kept(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values kept."""
        assert self.keys is not None, "nothing is kept yet"
        assert self.values is not None
        return self.keys, self.values

    @property
    def filled(self) -> bool:
        """Whether keys and values are kept (a cross-attention's are then read, not computed)."""
        return self.keys is not None

    @property
    def length(self) -> int:
        """How many positions are kept."""
        return 0 if self.keys is None else int(self.keys.shape[2])


class DecoderCache:
    """The caches of the decoder layers of one stage for one set of rows, each layer's found by the layer."""

    def __init__(self) -> None:
        self._layers: dict[int, tuple[AttentionCache, AttentionCache]] = {}

    def of(self, layer: nn.Module) -> tuple[AttentionCache, AttentionCache]:
        """``layer``'s self-attention and cross-attention caches (new ones on its first call)."""
        entry = self._layers.get(id(layer))
        if entry is None:
            entry = self._layers[id(layer)] = (AttentionCache(grow=True), AttentionCache(grow=False))
        return entry

    def reorder_cache(self, rows: torch.Tensor) -> None:
        """Row ``i`` takes the self-attention entries of row ``rows[i]`` (a beam search's hypotheses)."""
        for own, _cross in self._layers.values():
            if own.keys is not None and own.values is not None:
                own.keys, own.values = own.keys[rows], own.values[rows]
