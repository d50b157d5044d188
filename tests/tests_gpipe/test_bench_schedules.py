"""``make bench-schedules`` (``benchmarks.schedule_speed``): the formulas it compares with, and a tiny run end to end.

The tiny run checks what the page reports, never how fast anything ran.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
from helpers.runif import RunIf
from torch import nn

from benchmarks.schedule_memory.run import SavedBytes
from benchmarks.schedule_speed.analysis import FORMULAS, bubble, formula_bubble, per_process
from benchmarks.schedule_speed.run import FULL, TINY
from benchmarks.schedule_speed.steps import SCHEDULE_NAMES, Model, stage_cells
from lightning_gpipe.engine.timeline import Span, Timeline
from tools.launch import run_module

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [("gpipe", 3 / 11), ("1f1b", 3 / 11), ("interleaved", 3 / 19), ("zero_bubble", 3 / 27), ("zbv", 3 / 51)],
)
def test_the_formula_bubble_is_the_schedules_page_s_at_k4_m8(schedule: str, expected: float) -> None:
    # docs/concepts/schedules.md: 27.3% for GPipe and 1F1B, 15.8% interleaved (v = 2), 11.1% ZB-H1, 5.9% ZB-V.
    assert formula_bubble(schedule, 4, 8) == pytest.approx(expected)
    assert set(FORMULAS) == set(SCHEDULE_NAMES)


def test_every_schedule_cuts_the_same_layers_into_equal_stages_per_process() -> None:
    model = Model(layers=8, width=8, heads=2, batch=4, tokens=4)
    for schedule in SCHEDULE_NAMES:
        for K in (2, 4):
            held = [stage_cells(model, schedule, rank, K) for rank in range(K)]
            stages = sorted(s for cells in held for s in cells)
            per_stage = {len(cell) for cells in held for cell in cells.values()}
            assert stages == list(range(len(stages))), (schedule, K)
            assert per_stage == {8 // len(stages)}, (schedule, K)
    assert sorted(stage_cells(model, "zbv", 0, 2)) == [0, 3]  # the V: first and last stage on process 0


def test_a_process_s_row_holds_its_stages_and_an_ideal_step_has_the_formula_bubble() -> None:
    # 1F1B, K = 2, M = 2, F = 1 and B = 2 with no gaps but the schedule's: the bubble is (K-1)/(M+K-1) = 1/3.
    spans = [
        Span(0, "forward", 0, 0, 1),
        Span(0, "forward", 1, 1, 2),
        Span(1, "forward", 0, 1, 2),
        Span(1, "backward", 0, 2, 4),
        Span(1, "forward", 1, 4, 5),
        Span(0, "backward", 0, 4, 6),
        Span(1, "backward", 1, 5, 7),
        Span(0, "backward", 1, 7, 9),
    ]
    timeline = Timeline()
    timeline.spans.extend(spans)
    found = bubble(timeline, "1f1b", 2, 2)
    assert found.measured == pytest.approx(1 / 3)
    assert found.simulated == pytest.approx(1 / 3)
    assert found.formula == pytest.approx(1 / 3)
    assert (found.forward_ms, found.backward_ms, found.weight_ms) == pytest.approx((1e3, 2e3, 0.0))
    # Under ZB-V process 0 holds stages 0 and 3: their spans share its row.
    v_shaped = Timeline()
    v_shaped.spans.extend([Span(0, "forward", 0, 0, 1), Span(3, "forward", 0, 3, 4), Span(1, "forward", 0, 1, 2)])
    assert per_process(v_shaped, "zbv", 2).stages() == [0, 1]


def test_the_full_run_measures_k2_and_k4_at_one_m_with_both_engines_side_by_side() -> None:
    jobs = [str(job) for job in FULL.round_jobs()]
    for K in (2, 4):
        for schedule in SCHEDULE_NAMES:
            ours = jobs.index(f"{schedule}/K={K}/ours/M={FULL.chunks}")
            assert jobs[ours + 1] == f"{schedule}/K={K}/torch/M={FULL.chunks}"
    assert f"zero_bubble/K=4/ours+compiled/M={FULL.chunks}" in jobs
    assert f"zero_bubble/K=4/ours+varlen/M={FULL.chunks}" in jobs


def test_the_activation_count_frees_a_graph_a_kept_backward_ran_through() -> None:
    # The zero-bubble schedules keep the graph from I to W. Attention saves its own output; the counter's hook kept
    # it with its graph, a cycle no backward that keeps the graph breaks, so every micro-batch's activations stayed
    # counted (a zero-bubble last stage read as fill-drain's: 27 MiB against 1F1B's 6 instead of 9.5).
    attention = nn.MultiheadAttention(16, 2, batch_first=True)
    counter = SavedBytes()
    live = []
    with counter.hooks():
        for _ in range(3):
            x = torch.randn(2, 8, 16, requires_grad=True)
            out = attention(x, x, x)[0]
            torch.autograd.grad(out.sum(), [x], retain_graph=True)
            del out, x
            live.append(counter.live)
    assert live[2] == live[0], live
    assert counter.peak > 0


@pytest.mark.slow
@RunIf(multiprocess=True)
@pytest.mark.timeout(900)
def test_a_tiny_run_writes_every_table_and_ends_with_the_headline(tmp_path: pathlib.Path) -> None:
    """Every schedule under both engines at K = 2 and 4 on a tiny model, one round, into a page of its own."""
    page = tmp_path / "schedules.md"
    code, out, err = run_module("benchmarks.schedule_speed.run", ["--tiny", "--docs", str(page)], timeout=840, cwd=REPO)
    assert code == 0, err[-3000:]
    headline = out.strip().splitlines()[-1]
    assert re.fullmatch(
        r"ratio_interleaved_vs_torch=\S+ ratio_zero_bubble_vs_torch=\S+ ratio_zbv_vs_torch=\S+", headline
    ), headline
    assert all(value != "nan" for value in re.findall(r"=(\S+)", headline)), headline
    text = page.read_text()
    for K in TINY.processes:
        for schedule in SCHEDULE_NAMES:
            row = next(line for line in text.splitlines() if line.startswith(f"| {K} | `{schedule}` | `Schedule"))
            assert "n/a" not in row, row
            assert "not yet run" not in row, row
            assert re.search(rf"^\| {K} \| `{schedule}` \| \d+\.\d%", text, re.MULTILINE), (K, schedule)
    # torch refuses a compiled stage under its zero-bubble schedule, and dies on a longer sequence; ours ran both.
    assert "is not supported with stage modules that have used torch.compile" in text
    assert "sequence length changing every step" in text
    assert text.count("layers compiled in place") == len(TINY.processes) + 1
    for schedule in SCHEDULE_NAMES:
        assert (tmp_path / f"schedule_speed_{schedule}.png").stat().st_size > 0
