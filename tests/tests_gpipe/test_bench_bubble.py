"""The bubble benchmark: the idle fraction of merged spans, its summary against the formula, and a smoke run."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.runif import RunIf

from benchmarks.bubble.analysis import Sample, all_idle_fraction, idle_fraction, max_abs_difference, summarize
from lightning_gpipe.engine.schedule import bubble_fraction
from tools.launch import run_module

REPO = Path(__file__).resolve().parents[2]


def fill_drain(stages: int, chunks: int, forward: float = 1.0, backward: float = 2.0) -> list:
    """The spans of an ideal GPipe step with equal passes: every stage waits only in the fill and the drain."""
    records = []
    for stage in range(stages):
        for mb in range(chunks):
            start = (stage + mb) * forward
            records.append((stage, "forward", mb, start, start + forward))
        backward_origin = (chunks + stages - 1) * forward
        for n, mb in enumerate(reversed(range(chunks))):
            start = backward_origin + (stages - 1 - stage + n) * backward
            records.append((stage, "backward", mb, start, start + backward))
    return records


@pytest.mark.parametrize(("stages", "chunks"), [(2, 1), (2, 4), (2, 32), (4, 1), (4, 8)])
def test_an_ideal_schedule_has_the_formula_bubble(stages: int, chunks: int) -> None:
    assert idle_fraction(fill_drain(stages, chunks), stages) == pytest.approx(bubble_fraction(stages, chunks))


def test_waits_and_gaps_are_idle_and_overlaps_count_once() -> None:
    records = [
        (0, "forward", 0, 0.0, 2.0),
        (0, "backward", 0, 1.0, 3.0),  # overlaps the forward: busy 0..3 once
        (0, "wait", -1, 3.0, 4.0),  # waiting is idle
        (1, "forward", 0, 2.0, 4.0),  # idle 0..2
    ]
    # span 4 s, busy 3 + 2 of K x span = 8.
    assert idle_fraction(records, 2) == pytest.approx(1 - 5 / 8)


def test_no_stage_busy_is_zero_for_fill_drain_and_counts_common_gaps() -> None:
    assert all_idle_fraction(fill_drain(2, 8)) == pytest.approx(0.0)
    records = [(0, "forward", 0, 0.0, 1.0), (1, "forward", 0, 0.5, 2.0), (0, "backward", 0, 3.0, 4.0)]
    assert all_idle_fraction(records) == pytest.approx(1 / 4)  # 2..3 of 0..4, when neither stage worked


def test_idle_fraction_needs_every_stage() -> None:
    with pytest.raises(ValueError, match=r"spans come from stages \[0\], expected 0..1"):
        idle_fraction([(0, "forward", 0, 0.0, 1.0)], 2)


def test_summary_prefers_quiet_jobs_and_names_the_largest_gap() -> None:
    samples = [
        Sample(2, 1, 0.52, 0.0, all_idle=0.01),
        Sample(2, 1, 0.54, 0.01, all_idle=0.03),
        Sample(2, 1, 0.90, 1.5, all_idle=0.5),  # a step under foreign load is left out
        Sample(2, 8, 0.20, 1.2),  # no quiet job: every step is used, and the row says so
        Sample(2, 8, 0.16, 1.1),
    ]
    rows = summarize(samples, foreign_threshold=0.15)
    assert [(row.chunks, row.used, row.quiet) for row in rows] == [(1, 2, True), (8, 2, False)]
    assert rows[0].measured == pytest.approx(0.53)
    assert rows[0].all_idle == pytest.approx(0.02)
    assert rows[1].formula == pytest.approx(1 / 9)
    assert max_abs_difference(rows, stages=2) == pytest.approx(0.18 - 1 / 9)
    with pytest.raises(ValueError, match="no measurement with K=4 stages"):
        max_abs_difference(rows, stages=4)


def test_stages_are_equal() -> None:
    from benchmarks.bubble.measure import LAYERS_PER_STAGE, stage_layers

    first, second = stage_layers(2, 0), stage_layers(2, 1)
    assert len(first) == len(second) == LAYERS_PER_STAGE
    assert sum(p.numel() for p in first.parameters()) == sum(p.numel() for p in second.parameters())


@pytest.mark.slow
@RunIf(multiprocess=True)
def test_smoke_run_prints_the_headline_last() -> None:
    """The run module on K = 2 processes, M = 1 and 4, one step each; ~30 s on an idle machine."""
    code, out, err = run_module("benchmarks.bubble.run", ["--smoke"], timeout=280, cwd=REPO)
    assert code == 0, err[-3000:]
    lines = out.strip().splitlines()
    key, _, value = lines[-1].partition("=")
    assert key == "bubble_measured_vs_formula"
    assert 0.0 <= float(value) < 1.0
    # M = 1 leaves each of the two stages idle about half of the step, whatever the load.
    m1 = float(next(line for line in lines if line.startswith("bubble_k2_m1=")).partition("=")[2])
    assert 0.3 < m1 < 0.7
