"""The planner calibration's statistics: the bootstrap interval of its worst time error."""

from __future__ import annotations

import pytest

from benchmarks.plan_calibration.run import MAX_FOREIGN, _report, _worst_time_interval


def result(predicted: list[list[float]], measured: list[list[float]], loads: list[float]) -> dict:
    count = len(predicted)
    return {
        "configs": [f"config {i}" for i in range(count)],
        "predicted_times": predicted,
        "times": measured,
        "loads": loads,
        "predicted_memory": [[1.0]] * count,
        "measured_memory": [[1.0]] * count,
    }


def test_rounds_that_agree_give_an_interval_of_one_point_and_a_loaded_round_is_left_out() -> None:
    quiet, loaded = 0.0, MAX_FOREIGN + 1.0
    merged = {
        "model": result(
            predicted=[[1.1, 1.1, 1.1, 3.0], [0.95, 0.95, 0.95, 0.95]],
            measured=[[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]],
            loads=[quiet, quiet, quiet, loaded],
        )
    }
    low, high = _worst_time_interval(merged, draws=200)
    assert low == pytest.approx(0.1)
    assert high == pytest.approx(0.1)
    assert _report(merged)[2] == pytest.approx(0.1)


def test_the_interval_spans_what_redrawn_rounds_make_of_the_worst_error() -> None:
    ratios = [1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3]
    merged = {"model": result([ratios], [[1.0] * len(ratios)], [0.0] * len(ratios))}
    low, high = _worst_time_interval(merged, draws=500)
    headline = _report(merged)[2]
    assert low < headline < high
    assert low >= 0.0
    assert high <= 0.3 + 1e-9  # no drawn median is further from one than the furthest round


def test_the_calibration_measures_the_new_schedules_alone_when_asked() -> None:
    from benchmarks.plan_calibration.run import CONFIGS, Config, _configs

    chosen = _configs("cpu", ["zero_bubble", "interleaved", "zbv"])
    assert [c.label() for c in chosen] == [
        "K=2 M=4 never zero_bubble",
        "K=2 M=4 never interleaved v=2",
        "K=2 M=4 never zbv",
    ]
    assert _configs("cpu") == CONFIGS
    assert _configs("cuda", ["zbv"]) == ()  # K = 2 needs two GPUs
    assert Config(1, 1, "never").label() == "K=1 M=1 never gpipe"
