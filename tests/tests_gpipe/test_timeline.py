"""The timeline: spans, the measured bubble, gathering across processes, and the Gantt chart."""

from __future__ import annotations

import pickle
import sys
import time

import pytest
import torch
from helpers.runif import RunIf

from lightning_gpipe.engine.schedule import bubble_fraction
from lightning_gpipe.engine.timeline import Span, Timeline
from lightning_gpipe.plan.simulate import simulate_step

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def simulated(schedule: str, K: int, M: int, forward_time: float = 1.0, backward_time: float = 2.0) -> Timeline:
    timeline = Timeline()
    for stage, spans in enumerate(simulate_step(schedule, [forward_time] * K, [backward_time] * K, M).spans):
        for span in spans:
            timeline.add(Span(stage, span.action.phase.value, span.action.microbatch, span.start, span.end))
    return timeline


def test_bubble_of_hand_built_spans():
    # Stage 0 busy 0-2 and 3-4 (3 of 4 s), stage 1 busy 1-4 with an overlap that must count once (3 of 4 s),
    # stage 2 busy 2-3 and waiting 0-2, which is idle time (1 of 4 s).
    timeline = Timeline.merge(
        [
            [Span(0, "forward", 0, 0.0, 2.0), Span(0, "backward", 0, 3.0, 4.0)],
            [Span(1, "forward", 0, 1.0, 3.0), Span(1, "recompute", 0, 2.5, 4.0)],
            [Span(2, "wait", 0, 0.0, 2.0), Span(2, "forward", 0, 2.0, 3.0)],
        ]
    )
    assert timeline.stages() == [0, 1, 2]
    assert timeline.makespan() == 4.0
    assert [timeline.busy_time(stage) for stage in (0, 1, 2)] == [3.0, 3.0, 1.0]
    assert timeline.bubble_fraction() == pytest.approx((1 + 1 + 3) / 12)


def test_busy_time_counts_nested_spans_once():
    timeline = Timeline()
    for start, end in [(0.0, 10.0), (1.0, 2.0), (3.0, 4.0), (12.0, 13.0)]:
        timeline.add(Span(0, "forward", 0, start, end))
    assert timeline.busy_time(0) == 11.0
    assert timeline.busy_time(7) == 0.0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])  # fill-drain's formula
@pytest.mark.parametrize(("K", "M"), [(1, 4), (2, 8), (4, 4), (4, 16), (5, 3)])
def test_simulated_schedule_has_the_analytic_bubble(schedule, K, M):
    assert simulated(schedule, K, M).bubble_fraction() == pytest.approx(bubble_fraction(K, M))


def test_record_measures_the_block():
    timeline = Timeline()
    with timeline.record(1, "forward", 3):
        time.sleep(0.01)
    (span,) = timeline.spans
    assert (span.stage, span.phase, span.microbatch) == (1, "forward", 3)
    assert span.end - span.start >= 0.01


def test_record_keeps_the_span_when_the_block_raises():
    timeline = Timeline()
    with pytest.raises(ZeroDivisionError), timeline.record(0, "backward", 0):
        _ = 1 / 0
    assert len(timeline.spans) == 1


def test_disabled_timeline_records_nothing():
    timeline = Timeline(enabled=False)
    for microbatch in range(3):
        with timeline.record(0, "forward", microbatch):
            pass
    assert timeline.spans == []
    timeline.enabled = True
    with timeline.record(0, "forward", 0):
        pass
    assert len(timeline.spans) == 1
    timeline.clear()
    assert timeline.spans == []


def test_records_round_trip_through_pickle_and_merge():
    # Each process records its own stage and ships plain tuples, as all_gather_object would.
    whole = simulated("gpipe", 3, 4)
    per_stage = [Timeline.merge([[s for s in whole.spans if s.stage == stage]]) for stage in range(3)]
    gathered = [pickle.loads(pickle.dumps(timeline.to_records())) for timeline in per_stage]
    assert all(type(record) is tuple for records in gathered for record in records)

    merged = Timeline.merge(gathered)
    assert sorted(merged.spans, key=lambda s: (s.stage, s.start)) == whole.spans
    assert merged.spans == sorted(merged.spans, key=lambda s: (s.start, s.stage, s.end))
    assert Timeline.from_records(merged.to_records()).spans == merged.spans
    # Timelines, span lists and record lists mix freely.
    assert Timeline.merge([per_stage[0], per_stage[1].spans, gathered[2]]).spans == merged.spans


def test_span_and_empty_timeline_validation():
    with pytest.raises(ValueError, match=r"Span ends before it starts: start=2\.0, end=1\.0"):
        Span(0, "forward", 0, 2.0, 1.0)
    with pytest.raises(ValueError, match=r"no spans, so it has no bubble; enable it"):
        Timeline().bubble_fraction()
    with pytest.raises(ValueError, match=r"no spans to plot"):
        Timeline().plot("unused.png")
    assert Timeline().makespan() == 0.0


def test_plot_writes_a_png_and_leaves_pyplot_and_the_backend_alone(tmp_path):
    import matplotlib

    # A notebook selects its inline backend before any chart is drawn: plot must neither resolve nor switch it, nor
    # create pyplot figures. The raw rcParams entry is read because rcParams["backend"] would itself resolve it.
    backend = dict.__getitem__(matplotlib.rcParams, "backend")
    had_pyplot = "matplotlib.pyplot" in sys.modules
    figures = sys.modules["matplotlib.pyplot"].get_fignums() if had_pyplot else None

    timeline = simulated("1f1b", 4, 8, 1e-3, 2e-3)
    timeline.add(Span(1, "wait", 2, 0.0, 1e-3))
    timeline.add(Span(3, "allreduce", -1, timeline.spans[-1].end, timeline.spans[-1].end + 1e-3))
    path = timeline.plot(tmp_path / "charts" / "gantt.png", title="1F1B", expected_bubble=bubble_fraction(4, 8))

    assert path == tmp_path / "charts" / "gantt.png"
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > 10_000
    assert dict.__getitem__(matplotlib.rcParams, "backend") == backend
    assert ("matplotlib.pyplot" in sys.modules) == had_pyplot
    if had_pyplot:
        assert sys.modules["matplotlib.pyplot"].get_fignums() == figures


@RunIf(gpu=True)
def test_cuda_spans_time_the_device_work_not_its_launch():
    # R18: on a GPU the host leaves a block as soon as its kernels are queued; host clock spans measured the launch.
    timeline = Timeline(device="cuda")
    torch.cuda.synchronize()
    host_start = time.perf_counter()
    with timeline.record(0, "forward", 0):
        torch.cuda._sleep(400_000_000)  # about 0.2 s of device time, queued in microseconds
    host_seconds = time.perf_counter() - host_start
    with timeline.record(0, "backward", 0):
        torch.cuda._sleep(1_000)
    forward, backward = timeline.spans
    assert host_seconds < 0.05, "the launch itself took long: the comparison below means nothing"
    assert forward.end - forward.start > 3 * host_seconds
    assert forward.start >= host_start - 1e-3  # anchored to the host clock, as CPU spans are
    assert backward.start >= forward.end - 1e-4  # stream order kept
    assert time.perf_counter() >= backward.end


def test_a_timeline_without_cuda_device_times_on_the_host():
    timeline = Timeline(device="cpu")
    with timeline.record(0, "forward", 0):
        time.sleep(0.01)
    (span,) = timeline.spans
    assert span.end - span.start >= 0.01
