"""The largest model size whose measured peak memory fits a budget: a bracketing search over integer sizes.

Peak memory grows with the size (layers or filters), so the sizes that fit form a prefix ``low .. answer``. Each probe
is a real training run, and large models cost the most, so the search reaches the boundary from below and guesses
where it lies: first by linear extrapolation of the last two probes (starting by doubling), then, once a size that
does not fit brackets the answer, by linear interpolation inside the bracket, falling back to halving it whenever a
guess did not at least halve it. Memory that is linear in the size (Transformer layers) is found in about four
probes; any monotone growth in at most about twice the probes of plain bisection.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["SearchResult", "largest_fitting"]


@dataclass(frozen=True)
class SearchResult:
    """``largest``: the largest size that fits (``None``: not even ``low``); ``probes``: ``(size, bytes)`` in order.

    ``capped`` is true when ``high`` itself fits, so the true answer may be larger.
    """

    largest: int | None
    probes: tuple[tuple[int, int], ...]
    budget: int
    capped: bool = False

    def bytes_at(self, size: int) -> int:
        """The peak measured at ``size``; ``KeyError`` when it was not probed."""
        return dict(self.probes)[size]


def _check(budget: int, low: int, high: int) -> None:
    if budget <= 0:
        raise ValueError(f"budget={budget} bytes: give a positive memory budget, e.g. 40 * 2**20")
    if low < 1:
        raise ValueError(f"low={low}: sizes start at 1 (one layer, one filter step)")
    if high < low:
        raise ValueError(f"high={high} is below low={low}: give a search range with low <= high")


def _extrapolate(points: list[tuple[int, int]], budget: int) -> int:
    """The largest size that fits if memory continues on the line through the last two fitting points."""
    (prev, used_prev), (size, used) = points[-2], points[-1]
    slope = (used - used_prev) / (size - prev)
    if slope <= 0:
        return 2 * size
    return size + math.floor((budget - used) / slope)


def largest_fitting(peak_bytes: Callable[[int], int], budget: int, low: int, high: int) -> SearchResult:
    """The largest ``size`` in ``[low, high]`` with ``peak_bytes(size) <= budget``, for a non-decreasing ``peak_bytes``.

    ``peak_bytes`` is called at most once per size (each call is a probe: a fresh training run).

    Raises:
        ValueError: the budget is not positive or the range is empty.
    """
    _check(budget, low, high)
    probes: list[tuple[int, int]] = []

    def probe(size: int) -> int:
        used = int(peak_bytes(size))
        probes.append((size, used))
        return used

    def result(largest: int | None, capped: bool = False) -> SearchResult:
        return SearchResult(largest, tuple(probes), budget, capped)

    if probe(low) > budget:
        return result(None)
    fitting = [(low, probes[-1][1])]
    # Phase 1: walk up until a size does not fit, guessing the boundary from the last two fitting probes.
    while True:
        good = fitting[-1][0]
        if good == high:
            return result(high, capped=True)
        guess = 2 * good if len(fitting) < 2 else _extrapolate(fitting, budget)
        guess = min(max(guess, good + 1), high)
        used = probe(guess)
        if used > budget:
            bad, used_bad = guess, used
            break
        fitting.append((guess, used))
    # Phase 2: the answer lies in [good, bad); interpolate, halving instead whenever a guess did not halve the bracket.
    good, used_good = fitting[-1]
    interpolate = True
    while bad - good > 1:
        width = bad - good
        if interpolate and used_bad > used_good:
            guess = good + math.floor((budget - used_good) * width / (used_bad - used_good))
        else:
            guess = (good + bad) // 2
        guess = min(max(guess, good + 1), bad - 1)
        used = probe(guess)
        if used > budget:
            bad, used_bad = guess, used
        else:
            good, used_good = guess, used
        interpolate = bad - good <= width // 2
    return result(good)
