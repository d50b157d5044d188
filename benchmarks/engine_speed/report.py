"""Statistics over the interleaved rounds, and the tables, headline ratios and docs section made from them.

A window is one job's timed steps; its step time is the median of its per-step times. A cell (workload,
configuration, M) takes one window per round: the clean one when a retry produced it, else the last attempt,
flagged. Cells report the median over rounds of the clean windows; every ratio is the median over rounds of the
per-round ratio, using only rounds where both windows are clean. Cells or ratios with no clean window to use fall back
to all windows and are marked ``*``.
"""

from __future__ import annotations

import datetime
import math
import os
import pathlib
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from benchmarks.engine_speed.worker import Job, JobResult
from benchmarks.engine_speed.workloads import WORKLOADS, K
from lightning_gpipe.timeline import Timeline

__all__ = [
    "Goals",
    "Measurement",
    "Results",
    "bubble_bound",
    "headline",
    "markdown_tables",
    "write_docs",
]

Key = tuple[str, str, int]  # workload, configuration, M


@dataclass(frozen=True)
class Measurement:
    """One attempt at one job in one round; ``clean`` if the foreign load stayed under the threshold."""

    round: int
    job: Job
    attempt: int
    result: JobResult
    clean: bool

    @property
    def step_seconds(self) -> float:
        return statistics.median(self.result.step_seconds)


@dataclass(frozen=True)
class Estimate:
    """A median and whether it had to fall back on windows with foreign load."""

    value: float
    flagged: bool = False

    def show(self, fmt: str = "{:.2f}") -> str:
        return "n/a" if math.isnan(self.value) else fmt.format(self.value) + ("*" if self.flagged else "")


_MISSING = Estimate(math.nan, True)


def bubble_bound(chunks: int) -> float:
    """The fill-drain speed-up over one stage's work, ``K * M / (M + K - 1)``: K stages, idle ``K - 1`` slots."""
    return K * chunks / (chunks + K - 1)


def _key(workload: str, config: str, chunks: int) -> Key:
    # Whole-batch configurations do not depend on M; 1-way accumulation is the unpipelined step itself.
    if config in ("unpipelined", "two_threads") or (config == "accumulation" and chunks == 1):
        return (workload, "unpipelined" if config == "accumulation" else config, 1)
    return (workload, config, chunks)


class Results:
    """The measurements of one benchmark run, indexed by cell and round."""

    def __init__(self, measurements: Sequence[Measurement]) -> None:
        self.measurements = list(measurements)
        self._windows: dict[Key, dict[int, Measurement]] = {}
        for m in self.measurements:
            rounds = self._windows.setdefault((m.job.workload, m.job.config, m.job.chunks), {})
            kept = rounds.get(m.round)
            if kept is None or m.clean or not kept.clean:  # a later clean retry replaces a flagged attempt
                rounds[m.round] = m

    def windows(self, workload: str, config: str, chunks: int) -> dict[int, Measurement]:
        return self._windows.get(_key(workload, config, chunks), {})

    def step_seconds(self, workload: str, config: str, chunks: int) -> Estimate:
        """Median step time of the cell over rounds."""
        windows = list(self.windows(workload, config, chunks).values())
        clean = [m.step_seconds for m in windows if m.clean]
        if clean:
            return Estimate(statistics.median(clean))
        return Estimate(statistics.median(m.step_seconds for m in windows), True) if windows else _MISSING

    def memory_mib(self, workload: str, config: str, chunks: int) -> Estimate:
        windows = list(self.windows(workload, config, chunks).values())
        if not windows:
            return _MISSING
        return Estimate(statistics.median(m.result.memory_growth_mib for m in windows))

    def ratio(
        self,
        numerator: Key,
        denominator: Key,
        combine: Callable[[float, float], float] = lambda num, den: den / num,
    ) -> Estimate:
        """Median over rounds of ``combine(step time of numerator, step time of denominator)``.

        The default is a throughput ratio: numerator throughput / denominator throughput = denominator step time /
        numerator step time (same batch).
        """
        top, bottom = self.windows(*numerator), self.windows(*denominator)
        rounds = sorted(set(top) & set(bottom))
        values = {r: combine(top[r].step_seconds, bottom[r].step_seconds) for r in rounds}
        clean = [values[r] for r in rounds if top[r].clean and bottom[r].clean]
        if clean:
            return Estimate(statistics.median(clean))
        return Estimate(statistics.median(values.values()), True) if values else _MISSING

    def efficiency(self, workload: str, chunks: int) -> Estimate:
        """(ours / unpipelined) / (bubble bound x accumulation / unpipelined) = ours / (bound x accumulation)."""
        return self.ratio(
            (workload, "ours", chunks),
            (workload, "accumulation", chunks),
            lambda ours, accumulation: accumulation / ours / bubble_bound(chunks),
        )

    def load_summary(self) -> str:
        clean = [m for m in self.measurements if m.clean]
        retries = sum(1 for m in self.measurements if m.attempt > 0)
        worst_kept = max((m.result.foreign_cores for m in clean), default=math.nan)
        return (
            f"{len(self.measurements)} windows measured ({retries} of them retries), "
            f"{len(self.measurements) - len(clean)} discarded for foreign load; "
            f"foreign load in the kept windows: at most {worst_kept:.2f} cores"
        )


@dataclass(frozen=True)
class Goals:
    """The headline numbers and their targets."""

    ratio_vs_torch: Estimate
    small_ratio_vs_torch: Estimate
    efficiency: Estimate

    TARGETS = {"ratio_vs_torch": 1.00, "small_ratio_vs_torch": 1.50, "efficiency": 0.95}

    def line(self) -> str:
        """The one-line summary the benchmark prints last."""
        return (
            f"ratio_vs_torch_pipelining={self.ratio_vs_torch.value:.2f} "
            f"small_stage_ratio_vs_torch_pipelining={self.small_ratio_vs_torch.value:.2f} "
            f"efficiency_vs_bubble_bound={self.efficiency.value:.2f}"
        )

    def verdicts(self) -> list[str]:
        lines = []
        names = {
            "ratio_vs_torch": "R, ours / torch_pipelining, Transformer, M = 8",
            "small_ratio_vs_torch": "S, ours / torch_pipelining, small stages, M = 16",
            "efficiency": "E, ours / (bubble bound x accumulation), Transformer, M = 8",
        }
        for attribute, target in self.TARGETS.items():
            estimate: Estimate = getattr(self, attribute)
            if math.isnan(estimate.value):
                verdict = "not measured"
            elif estimate.value >= target:
                verdict = "met"
            else:
                verdict = f"**missed** by {(target - estimate.value) / target:.0%}"
            lines.append(f"- {names[attribute]}: {estimate.show()} (goal >= {target:.2f}): {verdict}")
        return lines


def headline(results: Results, chunks: int = 8, small_chunks: int = 16) -> Goals:
    return Goals(
        results.ratio(("transformer", "ours", chunks), ("transformer", "torch_pipelining", chunks)),
        results.ratio(("small", "ours", small_chunks), ("small", "torch_pipelining", small_chunks)),
        results.efficiency("transformer", chunks),
    )


_UNPIPELINED: Key = ("transformer", "unpipelined", 1)
_ROWS = ("unpipelined", "accumulation", "two_threads", "ours", "torch_pipelining")


def _normalized_table(results: Results, chunk_list: Sequence[int]) -> list[str]:
    header = "| configuration | " + " | ".join(f"M = {m}" for m in chunk_list) + " |"
    lines = [header, "|---|" + "---:|" * len(chunk_list)]
    for config in _ROWS:
        cells = [results.ratio(("transformer", config, m), _UNPIPELINED).show() for m in chunk_list]
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    bound = [
        Estimate(results.ratio(("transformer", "accumulation", m), ("transformer", "unpipelined", 1)).value)
        for m in chunk_list
    ]
    lines.append(
        "| bubble bound: accumulation x KM/(M+K-1) | "
        + " | ".join(Estimate(b.value * bubble_bound(m)).show() for b, m in zip(bound, chunk_list, strict=True))
        + " |"
    )
    lines.append(
        "| ours / bubble bound (E at M = 8) | "
        + " | ".join(results.efficiency("transformer", m).show() for m in chunk_list)
        + " |"
    )
    return lines


def _detail_table(results: Results, workload: str, cells: Sequence[tuple[str, int]]) -> list[str]:
    batch = WORKLOADS[workload].batch_size
    lines = [
        "| configuration | M | step time (ms) | samples/s | clean windows | memory growth (MiB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for config, chunks in cells:
        step = results.step_seconds(workload, config, chunks)
        windows = results.windows(workload, config, chunks).values()
        throughput = Estimate(batch / step.value, step.flagged)
        clean = f"{sum(m.clean for m in windows)}/{len(windows)}"
        memory = results.memory_mib(workload, config, chunks).show("{:.0f}")
        lines.append(
            f"| {config} | {chunks} | {Estimate(step.value * 1e3, step.flagged).show('{:.1f}')} | "
            f"{throughput.show('{:.0f}')} | {clean} | {memory} |"
        )
    return lines


def markdown_tables(results: Results, chunk_list: Sequence[int], small_chunks: int = 16) -> str:
    """Every table of the run, as markdown."""
    transformer_cells = [("unpipelined", 1), ("two_threads", 1)]
    transformer_cells += [(config, m) for m in chunk_list for config in ("accumulation", "ours", "torch_pipelining")]
    transformer_cells = [(c, m) for c, m in transformer_cells if not (c == "accumulation" and m == 1)]
    small_cells = [
        ("unpipelined", 1),
        ("accumulation", small_chunks),
        ("two_threads", 1),
        ("ours", small_chunks),
        ("torch_pipelining", small_chunks),
    ]
    small_rows = [
        "| configuration | throughput / unpipelined | ours / this |",
        "|---|---:|---:|",
    ]
    for config, chunks in small_cells:
        normalized = results.ratio(("small", config, chunks), ("small", "unpipelined", 1)).show()
        versus = results.ratio(("small", "ours", small_chunks), ("small", config, chunks)).show()
        small_rows.append(f"| {config} (M = {chunks}) | {normalized} | {versus} |")
    parts = [
        f"**Regime 1, realistic** ({WORKLOADS['transformer'].title}): throughput normalized to `unpipelined` "
        "(median of per-round ratios; `unpipelined` and `two_threads` run the whole batch, so they do not depend "
        "on M).",
        "",
        *_normalized_table(results, chunk_list),
        "",
        "Step times (median over rounds of each window's median step), throughput, windows kept, and peak RSS "
        "growth during training (max over the processes of a configuration):",
        "",
        *_detail_table(results, "transformer", transformer_cells),
        "",
        f"**Regime 2, overhead-bound** ({WORKLOADS['small'].title}, M = {small_chunks}):",
        "",
        *small_rows,
        "",
        *_detail_table(results, "small", small_cells),
        "",
        f"Load: {results.load_summary()}. `*` marks a value that had to use windows with foreign load.",
    ]
    return "\n".join(parts)


_BEGIN = "<!-- engine-speed results: generated by benchmarks/engine_speed/run.py, do not edit by hand -->"
_END = "<!-- end of engine-speed results -->"
HEADING = "## Engine throughput (`make bench-engine`)"


def _machine() -> str:
    import platform

    import torch

    model = "unknown CPU"
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return (
        f"`nproc` = {os.cpu_count()}, {model}, torch {torch.__version__}, Python {platform.python_version()}, "
        f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}"
    )


def _timeline_summary(timeline: Timeline, step_seconds: float, expected: float) -> list[str]:
    lines = [
        f"Measured bubble {timeline.bubble_fraction():.1%} against the (K-1)/(M+K-1) = {expected:.1%} of equal-length "
        f"passes; makespan of the recorded forwards and backwards {timeline.makespan() * 1e3:.0f} ms, whole step "
        f"(with scatter, the last sends and the SGD step) {step_seconds * 1e3:.0f} ms.",
        "",
        "| stage | forward (ms) | backward (ms) | busy (ms) | idle share of the makespan |",
        "|---|---:|---:|---:|---:|",
    ]
    makespan = timeline.makespan()
    for stage in timeline.stages():
        spans = [s for s in timeline.spans if s.stage == stage]
        forward = sum(s.end - s.start for s in spans if s.phase == "forward")
        backward = sum(s.end - s.start for s in spans if s.phase == "backward")
        busy = timeline.busy_time(stage)
        lines.append(
            f"| {stage} | {forward * 1e3:.0f} | {backward * 1e3:.0f} | {busy * 1e3:.0f} | {1 - busy / makespan:.1%} |"
        )
    return lines


def write_docs(
    path: pathlib.Path,
    chart: pathlib.Path,
    tables: str,
    goals: Goals,
    timeline: Timeline,
    timeline_result: JobResult,
    expected_bubble: float,
    command: str,
) -> None:
    """Put the results between the markers of the engine-throughput section of ``path``; the rest is kept."""
    block = "\n".join(
        [
            _BEGIN,
            f"Command: `make bench-engine` (runs `{command}`). Machine: {_machine()}.",
            "",
            tables,
            "",
            *goals.verdicts(),
            "",
            "```",
            goals.line(),
            "```",
            "",
            f"![Gantt chart of one `ours` step, M = 8]({os.path.relpath(chart, path.parent)})",
            "",
            *_timeline_summary(timeline, statistics.median(timeline_result.step_seconds), expected_bubble),
            _END,
        ]
    )
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if _BEGIN in text and _END in text:
        head, rest = text.split(_BEGIN, 1)
        text = head + block + rest.split(_END, 1)[1]
    elif HEADING in text:
        head, rest = text.split(HEADING, 1)
        text = f"{head}{HEADING}\n\n{block}\n{rest}"
    else:
        text = f"{text.rstrip()}\n\n{HEADING}\n\n{block}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
