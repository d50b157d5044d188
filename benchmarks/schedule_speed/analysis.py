"""What a recorded step says about its schedule: the bubble per process, the simulator's and the formula's bubble.

Our timeline names each span's stage; a process may hold several (``"interleaved"``, ``"zbv"``), so the bubble is
measured per process: the spans of its stages on one row, idle wherever none of them runs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from lightning_gpipe.engine.schedule import MULTI_STAGE, SPLIT_BACKWARD, stages_of
from lightning_gpipe.engine.timeline import Span, Timeline
from lightning_gpipe.plan.simulate import simulate_step

__all__ = ["FORMULAS", "Bubble", "bubble", "formula_bubble", "per_process"]


FORMULAS = {
    "gpipe": "(K-1)/(M+K-1)",
    "1f1b": "(K-1)/(M+K-1)",
    "interleaved": "(K-1)/(vM+K-1)",
    "zero_bubble": "(K-1)/(3M+K-1)",
    "zbv": "(K-1)/(6M+K-1)",
}
"""The idle share of each schedule's step when every process is equally fast, F = I = W, transfers free."""


def _virtual(schedule: str) -> int:
    return 2 if schedule in MULTI_STAGE else 1  # the benchmark runs "interleaved" with v = 2; "zbv" holds 2


def per_process(timeline: Timeline, schedule: str, processes: int) -> Timeline:
    """``timeline`` with each span moved to the row of the process that holds its stage."""
    owner = {s: r for r in range(processes) for s in stages_of(schedule, r, processes, _virtual(schedule))}
    moved = Timeline()
    moved.spans.extend(Span(owner[s.stage], s.phase, s.microbatch, s.start, s.end) for s in timeline.spans)
    return moved


def formula_bubble(schedule: str, processes: int, chunks: int) -> float:
    """The simulator's bubble with F = 1, I = W = 1 on every stage and free transfers: the formula's value."""
    stages = processes * _virtual(schedule)
    step = simulate_step(
        schedule, [1.0] * stages, [2.0] * stages, chunks, weight=[1.0] * stages, virtual_stages=_virtual(schedule)
    )
    return step.bubble


@dataclass(frozen=True)
class Bubble:
    """One recorded step's bubble, the simulator's from its own pass times, and the formula's."""

    measured: float
    simulated: float
    formula: float
    forward_ms: float  # mean over stages of the mean forward per micro-batch
    backward_ms: float  # the same for the whole backward (I + W where it is split)
    weight_ms: float  # the same for W alone; 0 where the backward is not split


def bubble(timeline: Timeline, schedule: str, processes: int, chunks: int) -> Bubble:
    """The bubble of one recorded step of ``schedule`` (spans per stage) against the simulator and the formula."""
    stages = processes * _virtual(schedule)

    def mean_ms(stage: int, phases: tuple[str, ...]) -> float:
        durations = [s.end - s.start for s in timeline.spans if s.stage == stage and s.phase in phases]
        return sum(durations) / chunks if durations else 0.0

    forward = [mean_ms(s, ("forward",)) for s in range(stages)]
    backward = [mean_ms(s, ("backward", "input", "weight")) for s in range(stages)]
    weight = [mean_ms(s, ("weight",)) for s in range(stages)] if schedule in SPLIT_BACKWARD else None
    simulated = simulate_step(schedule, forward, backward, chunks, weight=weight, virtual_stages=_virtual(schedule))
    return Bubble(
        measured=per_process(timeline, schedule, processes).bubble_fraction(),
        simulated=simulated.bubble,
        formula=formula_bubble(schedule, processes, chunks),
        forward_ms=statistics.mean(forward) * 1e3,
        backward_ms=statistics.mean(backward) * 1e3,
        weight_ms=statistics.mean(weight) * 1e3 if weight else 0.0,
    )
