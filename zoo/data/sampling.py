"""Temperature-based sampling of language pairs (Arivazhagan et al., 2019): p_l ∝ (N_l / Σ_k N_k)^(1/T).

T = 1 samples pairs in proportion to their size, T → ∞ uniformly; T = 5 (the M4 setting) lifts low-resource pairs
without letting them dominate. Within a pair, examples are drawn uniformly with replacement.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler

__all__ = ["TemperatureSampler", "temperature_probabilities"]


def temperature_probabilities(sizes: Sequence[int], temperature: float) -> list[float]:
    """Probability of drawing each pair, p_l ∝ (N_l / Σ N)^(1/T), for pair sizes N and temperature T > 0."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a number, got {type(temperature).__name__} {temperature!r}.")
    if not temperature > 0 or temperature == float("inf"):
        raise ValueError(
            f"temperature={temperature} must be a finite number > 0: 1.0 samples pairs in proportion to their size, "
            "larger values flatten towards uniform (5.0 is the M4 setting)."
        )
    if len(sizes) == 0:
        raise ValueError("sizes is empty: pass the number of examples of each language pair.")
    if any(n <= 0 for n in sizes):
        raise ValueError(f"sizes={list(sizes)}: every pair needs at least one example; drop the empty pairs.")
    total = float(sum(sizes))
    # Scaling by the total first keeps the powers in [0, 1], so large corpora and large 1/T cannot overflow.
    weights = [(n / total) ** (1.0 / temperature) for n in sizes]
    norm = sum(weights)
    return [w / norm for w in weights]


class TemperatureSampler(Sampler[int]):
    """Indices into the concatenation of the pairs' datasets: a pair drawn by temperature, then an example uniformly.

    ``sizes[i]`` is the length of dataset ``i``; index ``j`` of dataset ``i`` is ``sum(sizes[:i]) + j``, as in
    ``torch.utils.data.ConcatDataset``. An epoch has ``num_samples`` draws (default: the total size). The draws depend
    only on ``seed``, the epoch set by :meth:`set_epoch` (Lightning calls it every epoch) and how many passes were made
    since, so every rank and every restart sees the same sequence. The pass count matters under DDP: Lightning wraps a
    custom sampler in ``DistributedSamplerWrapper`` and calls ``set_epoch`` on the wrapper only, so each epoch is a
    new pass over an epoch that stays 0; it still draws afresh every epoch, identically on every rank.
    """

    def __init__(self, sizes: Sequence[int], temperature: float = 5.0, num_samples: int | None = None, seed: int = 0):
        self.sizes = [int(n) for n in sizes]
        self.probabilities = temperature_probabilities(self.sizes, temperature)
        self.temperature = temperature
        self.num_samples = sum(self.sizes) if num_samples is None else int(num_samples)
        if self.num_samples < 1:
            raise ValueError(f"num_samples={num_samples} must be at least 1.")
        self.seed = seed
        self.epoch = 0
        self.passes = 0  # iterations since the last set_epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the draws of ``epoch`` (from its first pass)."""
        self.epoch = epoch
        self.passes = 0

    def pair_draws(self) -> torch.Tensor:
        """The pair index of every draw of the next pass, int64 [num_samples] (does not count as a pass)."""
        return self._draws()[0]

    def _draws(self) -> tuple[torch.Tensor, torch.Tensor]:
        # One stream per (seed, epoch, pass); the tuple is hashed by string so nearby seeds do not share streams.
        key = f"{self.seed}/{self.epoch}/{self.passes}".encode()
        generator = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))
        probabilities = torch.tensor(self.probabilities, dtype=torch.float64)
        pairs = torch.multinomial(probabilities, self.num_samples, replacement=True, generator=generator)
        sizes = torch.tensor(self.sizes, dtype=torch.int64)
        # floor(u * N) is uniform over 0..N-1; float64 keeps it exact for any realistic corpus size.
        uniform = torch.rand(self.num_samples, dtype=torch.float64, generator=generator)
        within = (uniform * sizes[pairs]).long().clamp_max(sizes[pairs] - 1)
        offsets = torch.cumsum(sizes, 0) - sizes
        return pairs, offsets[pairs] + within

    def __iter__(self) -> Iterator[int]:
        indices = self._draws()[1].tolist()
        self.passes += 1
        return iter(indices)

    def __len__(self) -> int:
        return self.num_samples
