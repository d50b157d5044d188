"""Per-stage record of pipeline actions, the measured bubble, and a Gantt chart.

Spans are stamped with :func:`time.perf_counter`, which is ``CLOCK_MONOTONIC`` on Linux: processes on one host
share that clock, so the timelines of all stages of a single-host pipeline can be gathered (:meth:`Timeline.to_records`,
:meth:`Timeline.merge`) and compared directly. Spans from different hosts have unrelated origins and are not
comparable; merge them only to look at each stage on its own.

On a GPU (:attr:`Timeline.device` is a CUDA device) the host only launches kernels, so host clock readings around a
block would time the launches. There each span is a pair of CUDA events on the current stream, and the events are
placed on the host clock through an anchor: after a device synchronization, an event recorded on the idle stream
marks a known host time. The first span after :meth:`Timeline.clear` (or creation) pays that synchronization, and
reading :attr:`Timeline.spans` synchronizes once to resolve the pending events; a disabled timeline costs nothing.
"""

from __future__ import annotations

import os
import pathlib
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from types import TracebackType

import torch

__all__ = ["IDLE_PHASES", "Span", "SpanRecord", "Timeline"]

# Time spent blocked on a peer is the bubble itself: such spans are drawn but not counted as busy.
IDLE_PHASES: frozenset[str] = frozenset({"wait"})
"""Phases during which a stage is idle: they count towards the bubble, not towards busy time."""

# Forward and backward keep fixed colours so that charts compare at a glance; other phases take the next free one.
_PHASE_COLOURS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "recompute": "#55A868",
    "send": "#8172B3",
    "wait": "#9E9E9E",
}
_SPARE_COLOURS = ("#C44E52", "#937860", "#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD")

#: A span as a plain tuple ``(stage, phase, microbatch, start, end)``, what processes exchange.
SpanRecord = tuple[int, str, int, float, float]
"""One span as plain data, picklable across processes: (stage, phase, micro-batch, start, end)."""

_DISABLED: AbstractContextManager[None] = nullcontext()


@dataclass(frozen=True)
class Span:
    """One action of one stage, from ``start`` to ``end`` in seconds; ``microbatch < 0`` means none applies."""

    stage: int
    phase: str
    microbatch: int
    start: float
    end: float

    def __post_init__(self) -> None:
        if self.end < self.start:
            raise ValueError(f"Span ends before it starts: start={self.start}, end={self.end} ({self}).")


class _Recording(AbstractContextManager[None]):
    # A plain class rather than @contextmanager: this wraps every forward and backward, and a generator-based
    # context manager costs several times more per use. Subclasses say how the block's two ends are stamped.
    __slots__ = ("_timeline", "_stage", "_phase", "_microbatch")

    def __init__(self, timeline: Timeline, stage: int, phase: str, microbatch: int) -> None:
        self._timeline = timeline
        self._stage = stage
        self._phase = phase
        self._microbatch = microbatch


class _HostRecording(_Recording):
    # Off the GPU the block's work is done when it returns, so two host clock readings time it.
    __slots__ = ("_start",)
    _start: float

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        # Recorded even when the block raised: the time was spent, and the chart then shows where it stopped.
        end = time.perf_counter()
        self._timeline.spans.append(Span(self._stage, self._phase, self._microbatch, self._start, end))


class _CudaRecording(_Recording):
    # The span's ends are events on the device's current stream: they complete when the work queued between them
    # has run, which is what the stage spent, however early the host launched it.
    __slots__ = ("_start",)
    _start: torch.cuda.Event

    def __enter__(self) -> None:
        self._start = self._timeline._event()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        end = self._timeline._event()
        self._timeline._pending.append((self._stage, self._phase, self._microbatch, self._start, end))


class Timeline:
    """Spans of pipeline actions, per stage, with the measured bubble and a Gantt chart.

    A disabled timeline records nothing and :meth:`record` costs one attribute test. With a CUDA ``device`` spans are
    timed by CUDA events on that device (see the module docstring); otherwise by the host clock.
    """

    def __init__(self, enabled: bool = True, device: torch.device | str | None = None) -> None:
        self.enabled = enabled
        self.device = torch.device(device) if device is not None else None
        self._spans: list[Span] = []
        self._pending: list[tuple[int, str, int, torch.cuda.Event, torch.cuda.Event]] = []
        self._anchor: tuple[float, torch.cuda.Event] | None = None

    @property
    def spans(self) -> list[Span]:
        """The recorded spans (on a GPU, reading them waits for the recorded work to finish)."""
        if self._pending:
            self._resolve()
        return self._spans

    def _on_cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def _event(self) -> torch.cuda.Event:
        """A timing event recorded now on the device's current stream, after the anchor that dates it."""
        assert self.device is not None
        if self._anchor is None:
            torch.cuda.synchronize(self.device)
            anchor = torch.cuda.Event(enable_timing=True)
            anchor.record(torch.cuda.current_stream(self.device))
            # The stream is idle, so the anchor completes at once: at about this host time.
            self._anchor = (time.perf_counter(), anchor)
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _resolve(self) -> None:
        assert self._anchor is not None
        host, anchor = self._anchor
        for stage, phase, microbatch, start, end in self._pending:
            end.synchronize()  # spans may sit on several streams (stage threads): wait for each
            begin = host + anchor.elapsed_time(start) / 1e3  # elapsed_time is in milliseconds
            self._spans.append(Span(stage, phase, microbatch, begin, max(begin, host + anchor.elapsed_time(end) / 1e3)))
        self._pending.clear()

    def __repr__(self) -> str:
        return f"Timeline(enabled={self.enabled}, spans={len(self.spans)}, stages={self.stages()})"

    def record(self, stage: int, phase: str, microbatch: int) -> AbstractContextManager[None]:
        """Time the ``with`` block as one span of ``phase`` on ``stage`` for ``microbatch``."""
        if not self.enabled:
            return _DISABLED
        if self._on_cuda():
            return _CudaRecording(self, stage, phase, microbatch)
        return _HostRecording(self, stage, phase, microbatch)

    def add(self, span: Span) -> None:
        """Append a span measured elsewhere (recorded even when disabled: the caller chose to add it)."""
        self.spans.append(span)  # after any pending CUDA spans, which resolve first

    def clear(self) -> None:
        """Forget every span, e.g. after warm-up steps (on a GPU the next span re-anchors the device clock)."""
        self._spans.clear()
        self._pending.clear()
        self._anchor = None

    @classmethod
    def merge(cls, timelines_or_span_lists: Iterable[Timeline | Iterable[Span | SpanRecord]]) -> Timeline:
        """One timeline from several, e.g. one per process gathered with ``all_gather_object(t.to_records())``."""
        merged = cls()
        for part in timelines_or_span_lists:
            items: Iterable[Span | SpanRecord] = part.spans if isinstance(part, Timeline) else part
            merged.spans.extend(item if isinstance(item, Span) else Span(*item) for item in items)
        merged.spans.sort(key=lambda s: (s.start, s.stage, s.end))
        return merged

    def to_records(self) -> list[SpanRecord]:
        """The spans as plain ``(stage, phase, microbatch, start, end)`` tuples, cheap to pickle across processes."""
        return [(s.stage, s.phase, s.microbatch, s.start, s.end) for s in self.spans]

    @classmethod
    def from_records(cls, records: Iterable[SpanRecord]) -> Timeline:
        """Rebuild a timeline from :meth:`to_records` output."""
        timeline = cls()
        timeline.spans.extend(Span(*record) for record in records)
        return timeline

    def stages(self) -> list[int]:
        """The stages that have at least one span, in increasing order."""
        return sorted({span.stage for span in self.spans})

    def busy_time(self, stage: int) -> float:
        """Seconds ``stage`` spent on work; overlapping spans count once and :data:`IDLE_PHASES` not at all."""
        intervals = sorted((s.start, s.end) for s in self.spans if s.stage == stage and s.phase not in IDLE_PHASES)
        busy = 0.0
        covered_until = float("-inf")
        for start, end in intervals:
            if end > covered_until:
                busy += end - max(start, covered_until)
                covered_until = end
        return busy

    def makespan(self) -> float:
        """Seconds from the earliest start to the latest end over all stages (0 when empty)."""
        if not self.spans:
            return 0.0
        return max(s.end for s in self.spans) - min(s.start for s in self.spans)

    def bubble_fraction(self) -> float:
        """Mean over stages of ``(makespan - busy) / makespan``; only stages with spans take part."""
        if not self.spans:
            raise ValueError("The timeline has no spans, so it has no bubble; enable it and record a step first")
        makespan = self.makespan()
        if makespan == 0.0:
            return 0.0
        stages = self.stages()
        return sum(makespan - self.busy_time(stage) for stage in stages) / (makespan * len(stages))

    def plot(
        self,
        path: str | os.PathLike[str],
        *,
        title: str | None = None,
        expected_bubble: float | None = None,
        row_label: str = "stage",
    ) -> pathlib.Path:
        """Write a Gantt chart of the spans as a PNG at ``path``, one row per stage with stage 0 on top.

        ``row_label`` names the rows (``"process"`` for spans moved to the process that holds their stage).

        Draws on a standalone Agg canvas, so pyplot and the session's backend (a notebook's inline one) are untouched.
        """
        if not self.spans:
            raise ValueError("The timeline has no spans to plot; enable it and record a step first")
        # Imported here: ranks that only record spans never pay for matplotlib.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch

        stages = self.stages()
        row = {stage: n for n, stage in enumerate(stages)}
        origin = min(s.start for s in self.spans)
        extent_ms = self.makespan() * 1e3 or 1.0
        colours = _colours(s.phase for s in self.spans)

        width_in, height_in, dpi, fontsize = 12.0, 1.5 + 0.5 * len(stages), 100, 7
        figure = Figure(figsize=(width_in, height_in), dpi=dpi)
        FigureCanvasAgg(figure)
        left, right = 0.08, 0.98
        # Fixed margins in inches (title above; tick labels, axis label and legend below) keep the bar scale known.
        figure.subplots_adjust(left=left, right=right, top=1 - 0.7 / height_in, bottom=0.8 / height_in)
        axes = figure.add_subplot()
        axes.set_xlim(0.0, extent_ms)
        # A label fits when its estimated width (average glyph ~0.6 em) is below the bar's width in pixels.
        pixels_per_ms = (right - left) * width_in * dpi / extent_ms
        glyph_px = 0.6 * fontsize * dpi / 72

        for span in self.spans:
            start_ms, length_ms = (span.start - origin) * 1e3, (span.end - span.start) * 1e3
            y = row[span.stage]
            axes.barh(y, length_ms, left=start_ms, height=0.8, color=colours[span.phase], edgecolor="white", lw=0.5)
            label = str(span.microbatch)
            if span.microbatch >= 0 and len(label) * glyph_px + 2 < length_ms * pixels_per_ms:
                axes.text(
                    start_ms + length_ms / 2, y, label, ha="center", va="center", fontsize=fontsize, color="white"
                )

        axes.set_yticks(range(len(stages)), [f"{row_label} {stage}" for stage in stages])
        axes.set_ylim(len(stages) - 0.5, -0.5)  # stage 0 on top, as pipelines are usually drawn
        axes.set_xlabel("time (ms) from the first start")
        figure.legend(
            handles=[Patch(color=colour, label=phase) for phase, colour in colours.items()],
            loc="lower center",
            ncol=len(colours),
            frameon=False,
            fontsize=8,
        )
        subtitle = f"measured bubble {self.bubble_fraction():.1%}"
        if expected_bubble is not None:
            subtitle += f", expected {expected_bubble:.1%}"
        axes.set_title(subtitle, fontsize=9)
        plural = "" if len(stages) == 1 else "s"
        figure.suptitle(title or f"Pipeline timeline, {len(stages)} stage{plural}", fontsize=11)

        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, format="png", bbox_inches="tight")
        return path


def _colours(phases: Iterable[str]) -> dict[str, str]:
    # Legend order: forward, backward, the other known phases, then unknown ones alphabetically.
    present = set(phases)
    known = [phase for phase in _PHASE_COLOURS if phase in present]
    others = sorted(present - set(_PHASE_COLOURS))
    colours = {phase: _PHASE_COLOURS[phase] for phase in known}
    colours.update({phase: _SPARE_COLOURS[n % len(_SPARE_COLOURS)] for n, phase in enumerate(others)})
    return colours
