"""Partitioning of a sequence of layers into contiguous cells.

GPipe splits the L layers of a network into K cells, one per pipeline stage. The pipeline runs at the pace of its
slowest stage, so :func:`balance_by_cost` picks the cut points that minimise the most expensive cell; an explicit
``balance`` (layers per stage) is checked where it is given (:func:`checked_entries`) and against the sequence once
(:func:`checked_total`; :func:`validate_balance` does both), and :func:`split` turns either into cells.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

from torch import nn

from lightning_gpipe.partition.tied import find_ties

__all__ = [
    "balance_by_cost",
    "cell_bounds",
    "checked_entries",
    "checked_total",
    "in_place_starts",
    "split",
    "validate_balance",
]


def balance_by_cost(costs: Sequence[float], num_stages: int, *, avoid_cuts: Collection[int] = ()) -> list[int]:
    """Return the number of layers per stage that best balances ``costs`` over ``num_stages`` contiguous cells.

    The result is the exact optimum, not a heuristic:

    1. the cost of the most expensive cell (the pipeline's bottleneck) is minimal;
    2. among those partitions, the cell costs have the lowest variance (equivalently, since K and the total are fixed,
       the lowest sum of squared cell costs), so the stages that are not the bottleneck are as even as possible;
    3. among those, cut by cut from the first, a cell does not start at a layer of ``avoid_cuts`` where an optimal
       cut elsewhere exists, and otherwise the lexicographically smallest balance wins (earlier stages get fewer
       layers), so the answer is a pure function of ``costs`` and ``avoid_cuts``.

    Two dynamic programs over prefix sums do this. The first finds the minimal bottleneck ``B``; it uses that the
    best bottleneck of the first ``j`` layers grows with ``j`` while the last cell's cost shrinks as its start moves
    right, so each step is a binary search: O(K·L·log L). The second minimises the sum of squares over partitions
    whose cells all cost at most ``B``: O(K·L²) in the worst case, but it only visits cell starts and cells that can
    still fit under ``B``, which leaves about O(L²/K) on typical costs. In pure Python, 3000 layers take ~30 ms into
    8 stages and ~0.3 s into 64.

    Costs are compared exactly as floats: two partitions tie only when their cell costs are bit-for-bit equal, which is
    what integer-valued costs (parameter counts, FLOPs) give.

    Args:
        costs: the cost of each layer, non-negative and finite (zeros are fine, e.g. activations without parameters).
        num_stages: K, the number of cells; ``1 <= K <= len(costs)`` because every cell needs at least one layer.
        avoid_cuts: indices of layers that had better not start a cell, such as those :func:`in_place_starts` finds:
            a cell's input arrives from another stage, so an in-place first layer costs a copy of it.

    Returns:
        ``K`` positive ints that add up to ``len(costs)``.

    Example:
        >>> balance_by_cost([1, 2, 3, 4, 5, 6], 2)
        [4, 2]
    """
    values = _checked_costs(costs)
    L = len(values)
    K = _checked_num_stages(num_stages, L)

    # Scaling by a power of two is exact, and keeps squared sums of huge costs (e.g. 1e200 FLOPs) from overflowing.
    largest = max(values)
    if largest > 0:
        scale = math.ldexp(1.0, -math.frexp(largest)[1])
        values = [value * scale for value in values]
    prefix = [0.0] * (L + 1)
    for i, value in enumerate(values):
        prefix[i + 1] = prefix[i] + value

    bottleneck = _min_bottleneck(prefix, K)
    return _min_square_balance(prefix, K, bottleneck, set(avoid_cuts))


def _min_bottleneck(prefix: list[float], K: int) -> float:
    """Return the smallest achievable cost of the most expensive cell (``prefix`` are the cumulative layer costs)."""
    L = len(prefix) - 1
    # best[j]: minimal bottleneck of the first j layers in k cells (the current k); only j >= k is meaningful.
    best = prefix[:]
    for k in range(2, K + 1):
        previous = best
        best = [math.inf] * (L + 1)
        # The layers after j must still fill K-k cells, and the top level only needs the whole model.
        for j in range(k, L - (K - k) + 1) if k < K else (L,):
            # The last cell is layers m..j-1 for m in [k-1, j-1]. previous[m] never decreases with m and the last cell's
            # cost prefix[j] - prefix[m] never increases, so the maximum of the two is smallest where they cross.
            lo, hi = k - 1, j - 1
            if previous[lo] > prefix[j] - prefix[lo]:
                best[j] = previous[lo]
                continue
            # Invariant: previous[lo] <= last-cell cost at lo; find the largest such m.
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if previous[mid] <= prefix[j] - prefix[mid]:
                    lo = mid
                else:
                    hi = mid - 1
            candidate = prefix[j] - prefix[lo]
            if lo + 1 <= j - 1:
                candidate = min(candidate, previous[lo + 1])
            best[j] = candidate
    return best[L]


def _min_square_balance(prefix: list[float], K: int, bottleneck: float, avoid: set[int]) -> list[int]:
    """Return a balance of least sum of squared cell costs, each cell <= bottleneck: at each cut the first optimal one
    outside ``avoid``, or the first optimal one if all are in it."""
    L = len(prefix) - 1
    # rest[k][i]: minimal sum of squares of layers i..L-1 split into k cells that each cost at most the bottleneck.
    rest = [[math.inf] * (L + 1) for _ in range(K + 1)]
    for i in range(L):
        cost = prefix[L] - prefix[i]
        if cost <= bottleneck:
            rest[1][i] = cost * cost
    for k in range(2, K + 1):
        following = rest[k - 1]
        current = rest[k]
        for i in _reachable_starts(prefix, K, k, bottleneck):
            best = math.inf
            # Cell costs only grow as the cell gets longer, so stop at the first one over the bottleneck.
            for j in range(i + 1, L - k + 2):
                cost = prefix[j] - prefix[i]
                if cost > bottleneck:
                    break
                total = cost * cost + following[j]
                if total < best:
                    best = total
            current[i] = best

    # The same float expressions as above, so the optimum is found again by exact comparison; taking the shortest
    # matching first cell at every step yields the lexicographically smallest optimal balance. Every matching cut
    # leads to an optimal partition, so skipping the avoided ones keeps the optimum.
    assert math.isfinite(rest[K][0]), "the minimal bottleneck must admit a partition"
    balance: list[int] = []
    i = 0
    for k in range(K, 1, -1):
        target = rest[k][i]
        cuts = [
            j
            for j in range(i + 1, L - k + 2)
            if _is_optimal_cut(prefix[j] - prefix[i], rest[k - 1][j], bottleneck, target)
        ]
        j = next((cut for cut in cuts if cut not in avoid), cuts[0])
        balance.append(j - i)
        i = j
    balance.append(L - i)
    return balance


def _reachable_starts(prefix: list[float], K: int, k: int, bottleneck: float) -> list[int]:
    """Return the first layers i at which the last k cells can start in a partition whose cells all fit the bottleneck.

    Pruning the others is what makes the search fast when K is large: layers 0..i-1 must fit in K-k cells and layers
    i..L-1 in k cells. The slack absorbs the rounding of float sums (each within an ulp of the total per cell), so no
    start that can reach the optimum is dropped.
    """
    L = len(prefix) - 1
    if k == K:
        return [0]
    slack = 1e-9 * prefix[L]
    return [
        i
        for i in range(K - k, L - k + 1)
        if prefix[i] <= (K - k) * bottleneck + slack and prefix[L] - prefix[i] <= k * bottleneck + slack
    ]


def _is_optimal_cut(cost: float, following: float, bottleneck: float, target: float) -> bool:
    return cost <= bottleneck and cost * cost + following == target


def _checked_costs(costs: Sequence[float]) -> list[float]:
    if isinstance(costs, (str, bytes)) or not isinstance(costs, Sequence):
        raise TypeError(f"costs must be a sequence of numbers, one per layer, got {type(costs).__name__}")
    values: list[float] = []
    for index, cost in enumerate(costs):
        try:
            value = float(cost)
        except (TypeError, ValueError):
            raise TypeError(f"cost of layer {index} is {cost!r}, which is not a number") from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"cost of layer {index} is {cost!r}; layer costs must be non-negative and finite")
        values.append(value)
    return values


def _checked_num_stages(num_stages: int, num_layers: int) -> int:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int):
        raise TypeError(f"the number of stages must be an int, got {num_stages!r} ({type(num_stages).__name__})")
    if num_stages < 1:
        raise ValueError(f"the number of stages must be at least 1, got {num_stages}; use pipe_size >= 1")
    if num_stages > num_layers:
        raise ValueError(
            f"cannot split {num_layers} layers into {num_stages} stages; use pipe_size <= {num_layers} or more layers"
        )
    return num_stages


def validate_balance(balance: Sequence[int], num_layers: int) -> list[int]:
    """Return ``balance`` as a list after checking that it assigns ``num_layers`` layers to non-empty stages.

    Raises:
        TypeError: ``balance`` is not a sequence of ints (``bool`` is refused: ``True`` is not a layer count).
        ValueError: an entry is not positive, there are more stages than layers, or the entries do not add up to
            ``num_layers``. The message of a wrong sum suggests an even balance.
    """
    return checked_total(checked_entries(balance), num_layers)


def checked_total(entries: list[int], num_layers: int) -> list[int]:
    """Return ``entries``, a balance :func:`checked_entries` accepted, after checking it fits ``num_layers`` layers.

    The check against the sequence, once its length is known; the messages are :func:`validate_balance`'s.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"the module must have at least one layer to partition, got num_layers={num_layers!r}")
    if len(entries) > num_layers:
        raise ValueError(
            f"balance {entries} has {len(entries)} stages but the module has only {num_layers} layers; give at most "
            f"{num_layers} stages"
        )
    total = sum(entries)
    if total != num_layers:
        raise ValueError(
            f"balance {entries} sums to {total} but the module has {num_layers} layers; use e.g. "
            f"{_even_balance(num_layers, len(entries))}"
        )
    return entries


def checked_entries(balance: Sequence[int]) -> list[int]:
    """Return ``balance`` as a list after checking that it is a non-empty sequence of positive ints.

    The check of a balance where it is given, before the sequence it will cut is known (see :func:`checked_total`).
    """
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence):
        raise TypeError(
            f"balance must be a list of ints (layers per stage), got {balance!r} ({type(balance).__name__})"
        )
    entries = list(balance)
    if not entries:
        raise ValueError("balance [] has no stages; give one positive int per stage")
    for stage, layers in enumerate(entries):
        if isinstance(layers, bool) or not isinstance(layers, int):
            raise TypeError(f"balance {entries} has {layers!r} ({type(layers).__name__}) for stage {stage}, not an int")
        if layers < 1:
            raise ValueError(f"balance {entries} gives stage {stage} {layers} layers; every stage needs at least one")
    return entries


def _even_balance(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage as even as possible, the larger stages first (used in suggestions)."""
    base, extra = divmod(num_layers, num_stages)
    return [base + 1] * extra + [base] * (num_stages - extra)


def cell_bounds(balance: Sequence[int]) -> list[range]:
    """Return the range of layer indices that each stage of ``balance``, a checked balance, holds.

    Example:
        >>> cell_bounds([2, 3])
        [range(0, 2), range(2, 5)]
    """
    bounds: list[range] = []
    start = 0
    for layers in balance:
        bounds.append(range(start, start + layers))
        start += layers
    return bounds


def in_place_starts(layers: Iterable[nn.Module]) -> list[int]:
    """Indices of the layers whose first module modifies its input in place (``inplace=True``, as ``nn.ReLU`` takes).

    A stage starting with such a layer must copy its input: the tensors it receives are leaves of autograd, on which
    an in-place operation is refused, and a re-materialized forward must replay from the input as it was. Pass them
    to :func:`balance_by_cost` as ``avoid_cuts``.
    """
    return [index for index, layer in enumerate(layers) if _first_module_is_in_place(layer)]


def _first_module_is_in_place(layer: nn.Module) -> bool:
    # Containers run their children in order only when they are nn.Sequential; a custom forward may do anything.
    while isinstance(layer, nn.Sequential) and len(layer) > 0:
        layer = layer[0]
    return getattr(layer, "inplace", False) is True


def split(module: nn.Sequential, balance: Sequence[int], *, allow_shared: bool = False) -> list[nn.Sequential]:
    """Split ``module`` into one ``nn.Sequential`` cell per stage of ``balance``.

    The cells hold the original layer objects (no copies, so parameters stay shared with ``module``) under their
    original child names: a cell's ``state_dict()`` keys are the unpartitioned ones (``"3.weight"``), which is what
    lets a checkpoint written with one balance load with another.

    A parameter or buffer used by layers of two cells (tied weights) is refused unless ``allow_shared``: cells trained
    in separate processes would each update a copy of their own. In one process
    (:func:`~lightning_gpipe.run_in_threads`) the cells use the very tensor and its gradient accumulates from both;
    across processes,
    :class:`~lightning_gpipe.partition.tied.TiedCopies` keeps the copies equal.
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"split needs an nn.Sequential, got {type(module).__name__}; pass nn.Sequential(*layers)")
    # _modules rather than named_children(): named_children() skips a layer object repeated at two positions, which
    # would silently shift every later layer into the wrong cell.
    children = list(module._modules.items())
    entries = validate_balance(balance, len(children))
    shared = [tie for tie in find_ties(module, entries) if len(tie.stages) > 1]
    if shared and not allow_shared:
        tie = shared[0]
        second = next(i for i, stage in enumerate(tie.name_stages) if stage != tie.owner)
        raise ValueError(
            f"layer {tie.names[0]} (cell {tie.owner}) and layer {tie.names[second]} (cell {tie.name_stages[second]}) "
            f"share one {'parameter' if tie.is_parameter else 'buffer'}: pass allow_shared=True and use "
            "run_in_threads, or TiedCopies across processes"
        )
    return [
        nn.Sequential(OrderedDict((name, layer) for name, layer in children[bounds.start : bounds.stop]))
        for bounds in cell_bounds(entries)
    ]
