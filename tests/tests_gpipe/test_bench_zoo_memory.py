"""The memory benchmark on the zoo's models: its budget search, one probe of each setting, and a smoke run."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers.runif import RunIf

from benchmarks.zoo_memory.run import Found, headlines
from benchmarks.zoo_memory.scales import Probe
from benchmarks.zoo_memory.search import SearchResult, largest_fitting
from tools.launch import run_module

REPO = Path(__file__).resolve().parents[2]


def brute_force(peak: list[int], budget: int, low: int, high: int) -> int | None:
    fits = [size for size in range(low, high + 1) if peak[size] <= budget]
    return max(fits) if fits else None


def test_search_finds_a_linear_boundary_in_four_probes() -> None:
    # Transformer layers: memory = base + slope * L, as the benchmark measures it.
    result = largest_fitting(lambda n: 6_700 + 1_680 * n, budget=40_000, low=1, high=128)
    assert result.largest == 19
    assert [size for size, _ in result.probes] == [1, 2, 19, 20]
    assert not result.capped
    assert result.bytes_at(19) == 6_700 + 1_680 * 19


@pytest.mark.parametrize("seed", range(200))
def test_search_agrees_with_brute_force_on_monotone_growth(seed: int) -> None:
    rng = random.Random(seed)
    high = rng.randint(1, 80)
    # Non-decreasing with plateaus and jumps (AmoebaNet filters grow memory quadratically, partitions in steps).
    steps = [rng.choice([0, 0, rng.randint(1, 50), rng.randint(1, 5000)]) for _ in range(high + 1)]
    peak = [sum(steps[: n + 1]) for n in range(high + 1)]
    budget = rng.randint(1, max(2, peak[-1] + 100))
    low = rng.randint(1, high)
    calls: list[int] = []

    def probe(size: int) -> int:
        calls.append(size)
        return peak[size]

    result = largest_fitting(probe, budget, low, high)
    assert result.largest == brute_force(peak, budget, low, high)
    assert len(calls) == len(set(calls)), "a size was probed twice"
    assert all(low <= size <= high for size in calls)
    assert result.capped == (result.largest == high)
    assert len(calls) <= 2 * (high - low + 1).bit_length() + 3


def test_search_reports_when_nothing_fits_and_when_the_cap_fits() -> None:
    nothing = largest_fitting(lambda n: 100 * n, budget=50, low=1, high=10)
    assert nothing.largest is None
    assert nothing.probes == ((1, 100),)
    everything = largest_fitting(lambda n: n, budget=10**6, low=1, high=10)
    assert everything.largest == 10
    assert everything.capped


@pytest.mark.parametrize(
    ("budget", "low", "high", "message"),
    [
        (0, 1, 4, r"budget=0 bytes: give a positive memory budget"),
        (10, 0, 4, r"low=0: sizes start at 1"),
        (10, 5, 4, r"high=4 is below low=5"),
    ],
)
def test_search_rejects_bad_arguments(budget: int, low: int, high: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        largest_fitting(lambda n: n, budget, low, high)


def test_headline_ratio_is_the_last_line() -> None:
    def found(setting: str, largest: int) -> Found:
        return Found("transformer_lm", setting, SearchResult(largest, ((largest, 1),), budget=1), {})

    lines = headlines({"transformer_lm": [found("naive-1", 3), found("pipeline-1", 13), found("pipeline-2", 30)]})
    assert lines[-1] == "pipeline1_layers_vs_naive1=4.33"
    assert "pipeline2_layers_vs_naive1=10.00" in lines


def test_rematerialization_shrinks_the_measured_peak() -> None:
    """One in-process probe per single-rank setting: Pipeline-1 holds one micro-batch's layer activations."""
    import torch

    from benchmarks.zoo_memory.probe import measure_rank

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        naive = measure_rank(0, 1, Probe("transformer_lm", 2, "naive-1"))
        pipelined = measure_rank(0, 1, Probe("transformer_lm", 2, "pipeline-1"))
    finally:
        torch.set_num_threads(threads)
    # Same model, same optimizer state; only the activations differ, and by several times.
    assert naive["state_bytes"] == pipelined["state_bytes"]
    assert naive["parameters"] == pipelined["parameters"]
    assert pipelined["activation_bytes"] * 2 < naive["activation_bytes"]
    assert naive["peak_bytes"] == naive["state_bytes"] + naive["batch_bytes"] + naive["activation_bytes"]


@pytest.mark.slow
@RunIf(multiprocess=True)
def test_smoke_run_prints_the_headline_last(tmp_path: Path) -> None:
    """The whole run module with tiny probes in fresh processes (K = 2 included); ~30 s on an idle machine."""
    code, out, err = run_module("benchmarks.zoo_memory.run", ["--smoke"], timeout=280, cwd=REPO)
    assert code == 0, err[-3000:]
    last = out.strip().splitlines()[-1]
    key, _, value = last.partition("=")
    assert key == "pipeline1_layers_vs_naive1"
    assert float(value) > 1.0
