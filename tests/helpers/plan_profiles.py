"""Synthetic profiles of identical layers, for the planner's tests: known bytes and times per sample."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lightning_gpipe.profile.layer_profile import LayerProfile, ModelProfile

__all__ = ["FREE_LINKS", "MiB", "meta", "synthetic"]

MiB = 2**20


def synthetic(
    layers: int = 8,
    *,
    params: int = MiB,
    saved: float = 0.5 * MiB,
    output: float = 0.125 * MiB,
    transient: float = 0.25 * MiB,
    seconds: float = 1e-3,
    overhead: float = 0.5e-3,
) -> ModelProfile:
    """``layers`` identical layers; per sample ``saved``/``output``/``transient`` bytes; a forward takes ``overhead``
    plus ``seconds`` per sample, a backward twice that."""
    layer = LayerProfile("Block", params, params, 0, saved, output, transient, 1.0)
    forward = {n: overhead + seconds * n for n in (1, 2, 4, 8, 16, 32)}
    times = {n: ((t,) * layers, (2 * t,) * layers) for n, t in forward.items()}
    return ModelProfile((layer,) * layers, output, times)


# Free links and no engine cost (a meta profile) leave each schedule's own bubble; synthetic layers all have weights, so
# W is half of each backward: F = I = W.
FREE_LINKS: dict[str, Any] = {"bandwidth": 1e30, "latency": 0.0}


def meta(layers: int = 16, **kwargs: Any) -> ModelProfile:
    """:func:`synthetic` on the meta device: the planner adds no engine or boundary cost."""
    return replace(synthetic(layers, **kwargs), device="meta")
