"""The measured bubble of a pipeline step and its summary against the GPipe formula (K-1)/(M+K-1).

A step's idle fraction is ``1 - sum_k busy_k / (K x span)``: ``busy_k`` is the time stage k spent in forward and
backward spans (overlaps once, waits not at all), ``span`` the time from the first span's start to the last one's
end over all stages. It is what :meth:`lightning_gpipe.Timeline.bubble_fraction` computes, with every one of the K
stages required to appear.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lightning_gpipe.engine.schedule import bubble_fraction
from lightning_gpipe.engine.timeline import IDLE_PHASES, SpanRecord, Timeline

__all__ = ["Row", "Sample", "all_idle_fraction", "idle_fraction", "max_abs_difference", "summarize"]


def idle_fraction(records: Sequence[SpanRecord], stages: int) -> float:
    """``1 - busy / (stages x span)`` of one step's merged spans.

    Raises:
        ValueError: the spans do not cover exactly stages ``0 .. stages - 1``.
    """
    timeline = Timeline.from_records(records)
    if timeline.stages() != list(range(stages)):
        raise ValueError(
            f"the step's spans come from stages {timeline.stages()}, expected 0..{stages - 1}; merge the records of "
            "every stage of one step (Timeline.to_records on each rank, then concatenate)"
        )
    span = timeline.makespan()
    if span == 0.0:
        return 0.0
    return 1.0 - sum(timeline.busy_time(stage) for stage in range(stages)) / (stages * span)


def all_idle_fraction(records: Sequence[SpanRecord]) -> float:
    """The share of the step's span during which no stage was busy (a diagnostic, not part of the formula).

    In a fill-drain schedule some stage is always working, so on a quiet machine this stays near 0. Time when every
    stage is outside its spans is engine overhead between passes, or all processes waiting for a core: on a loaded
    machine every hand-off is a blocking receive whose wake-up queues behind other processes.
    """
    busy = sorted((s.start, s.end) for s in Timeline.from_records(records).spans if s.phase not in IDLE_PHASES)
    if not busy:
        return 0.0
    origin, covered_until, gaps = busy[0][0], busy[0][0], 0.0
    for start, end in busy:
        if start > covered_until:
            gaps += start - covered_until
        covered_until = max(covered_until, end)
    span = covered_until - origin
    return gaps / span if span > 0 else 0.0


@dataclass(frozen=True)
class Sample:
    """One timed step: K, M, its idle fraction, the share with no stage busy, and its job's foreign load (cores)."""

    stages: int
    chunks: int
    idle: float
    foreign_cores: float
    all_idle: float = 0.0


@dataclass(frozen=True)
class Row:
    """One (K, M): the formula, the median measured idle fraction and its range, and how many steps gave them."""

    stages: int
    chunks: int
    formula: float
    measured: float
    low: float
    high: float
    used: int  # steps the median is over
    quiet: bool  # True when those are the steps of quiet jobs only
    all_idle: float = 0.0  # median share of the span with no stage busy, over the same steps

    @property
    def difference(self) -> float:
        """Measured minus formula."""
        return self.measured - self.formula


def summarize(samples: Iterable[Sample], foreign_threshold: float) -> list[Row]:
    """One row per (K, M), sorted: the median over the steps of jobs whose foreign load stayed below the threshold.

    Where no job of a (K, M) was quiet, every step is used and the row says so (``quiet=False``).
    """
    groups: dict[tuple[int, int], list[Sample]] = {}
    for sample in samples:
        groups.setdefault((sample.stages, sample.chunks), []).append(sample)
    rows = []
    for (stages, chunks), group in sorted(groups.items()):
        quiet = [s for s in group if s.foreign_cores < foreign_threshold]
        chosen = quiet or group
        values = [s.idle for s in chosen]
        rows.append(
            Row(
                stages,
                chunks,
                bubble_fraction(stages, chunks),
                statistics.median(values),
                min(values),
                max(values),
                len(values),
                bool(quiet),
                statistics.median(s.all_idle for s in chosen),
            )
        )
    return rows


def max_abs_difference(rows: Iterable[Row], stages: int) -> float:
    """The largest ``|measured - formula|`` over the rows of ``stages`` stages.

    Raises:
        ValueError: no row has that many stages.
    """
    differences = [abs(row.difference) for row in rows if row.stages == stages]
    if not differences:
        raise ValueError(f"no measurement with K={stages} stages; measure it first or pick a K that was run")
    return max(differences)
