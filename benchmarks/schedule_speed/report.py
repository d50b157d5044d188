"""The tables of a run, its headline line, and the results block of ``docs/benchmarks/schedules.md``."""

from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.docs_page import write_block
from benchmarks.engine_speed.results import Estimate, Results
from benchmarks.machine import machine_line
from benchmarks.schedule_speed.analysis import FORMULAS, Bubble
from benchmarks.schedule_speed.steps import SCHEDULE_NAMES, TORCH_CLASSES, Model
from lightning_gpipe.engine.timeline import Timeline

__all__ = ["HEADLINE_SCHEDULES", "Refusal", "Report", "write_docs"]

HEADLINE_SCHEDULES = ("interleaved", "zero_bubble", "zbv")
MIB = 2**20
NOT_RUN = "not yet run by the engine"


@dataclass(frozen=True)
class Refusal:
    """What torch did with a variant of our step (``"ran"``, or the error) at K = ``processes``."""

    variant: str
    processes: int
    outcome: str


@dataclass
class Report:
    """The measurements of one run and the tables they make."""

    model: Model
    processes: tuple[int, ...]
    chunks: int
    schedules: Sequence[str]  # those both engines ran
    results: Results
    timelines: dict[tuple[str, int], tuple[Timeline, Bubble]]

    def _cell(self, schedule: str, K: int) -> str:
        return f"{schedule}/K={K}"

    def ratio(self, schedule: str, K: int, numerator: str = "ours", denominator: str = "torch") -> Estimate:
        """Throughput ``numerator / denominator`` (median of per-round ratios)."""
        cell = self._cell(schedule, K)
        return self.results.ratio((cell, numerator, self.chunks), (cell, denominator, self.chunks))

    def _samples_per_second(self, schedule: str, K: int, engine: str) -> str:
        step = self.results.step_seconds(self._cell(schedule, K), engine, self.chunks)
        return Estimate(self.model.batch / step.value, step.flagged).show("{:.0f}")

    def _peaks(self, schedule: str, K: int, engine: str) -> list[float]:
        """Peak saved-activation bytes per process (the first window's: the count is exact, the same every round)."""
        windows = self.results.windows(self._cell(schedule, K), engine, self.chunks)
        if not windows:
            return []
        return [float(peak) for peak in windows[min(windows)].result.reports]

    def _memory(self, schedule: str, K: int, engine: str) -> str:
        """Each process's peak against the same engine's 1F1B at the same K, ``a / b / ...``."""
        peaks, reference = self._peaks(schedule, K, engine), self._peaks("1f1b", K, engine)
        if not peaks or not reference:
            return "n/a"
        return " / ".join(f"{p / r:.2f}" if r else "n/a" for p, r in zip(peaks, reference, strict=True))

    def throughput_table(self) -> list[str]:
        lines = [
            "| K | schedule | torch's class | ours (samples/s) | torch (samples/s) | ours / torch | per round "
            "| ours: peak activations per process / our 1F1B's | torch: the same / torch's 1F1B's |",
            "|---:|---|---|---:|---:|---:|---|---|---|",
        ]
        for K in self.processes:
            for schedule in SCHEDULE_NAMES:
                name = f"`{TORCH_CLASSES[schedule]}`"
                if schedule not in self.schedules:
                    lines.append(f"| {K} | `{schedule}` | {name} | {NOT_RUN} | | | | | |")
                    continue
                ratio = self.ratio(schedule, K)
                lines.append(
                    f"| {K} | `{schedule}` | {name} | {self._samples_per_second(schedule, K, 'ours')} | "
                    f"{self._samples_per_second(schedule, K, 'torch')} | **{ratio.show()}** | {ratio.spread()} | "
                    f"{self._memory(schedule, K, 'ours')} | {self._memory(schedule, K, 'torch')} |"
                )
        reference = [self._peaks("1f1b", K, "ours") for K in self.processes]
        sizes = "; ".join(
            f"K = {K}: " + " / ".join(f"{p / MIB:.1f}" for p in peaks)
            for K, peaks in zip(self.processes, reference, strict=True)
            if peaks
        )
        lines += ["", f"Our 1F1B's peak activations per process, MiB: {sizes}."]
        return lines

    def variants_table(self, refusals: Sequence[Refusal]) -> list[str]:
        lines = [
            "| K | our zero-bubble step | ours (samples/s) | / our plain zero bubble | per round |",
            "|---:|---|---:|---:|---|",
        ]
        what = {
            "compiled": "layers compiled in place (`torch.compile`, static shapes)",
            "varlen": "sequence length changing every step (T - T/4, T, T + T/4)",
        }
        for K in self.processes:
            for variant in ("compiled", "varlen"):
                config = f"ours+{variant}"
                if not self.results.windows(self._cell("zero_bubble", K), config, self.chunks):
                    continue
                ratio = self.ratio("zero_bubble", K, config, "ours")
                speed = self._samples_per_second("zero_bubble", K, config)
                lines.append(f"| {K} | {what[variant]} | {speed} | {ratio.show()} | {ratio.spread()} |")
        if len(lines) == 2:
            lines.append("| | not measured in this run (`--quick` leaves them out) | | | |")
        if refusals:
            lines += ["", "What torch does with the same (`ScheduleInterleavedZeroBubble`, checked in this run):", ""]
            for refusal in refusals:
                lines.append(f"- {what[refusal.variant]}, K = {refusal.processes}: `{refusal.outcome}`")
        return lines

    def bubble_table(self) -> list[str]:
        lines = [
            "| K | schedule | measured | simulated from the measured passes | formula (F = I = W) | formula "
            "| F, B, W per micro-batch and stage (ms) |",
            "|---:|---|---:|---:|---:|---|---|",
        ]
        for (schedule, K), (_, found) in sorted(self.timelines.items(), key=lambda item: (item[0][1], item[0][0])):
            weight = f", {found.weight_ms:.1f}" if found.weight_ms else ""
            lines.append(
                f"| {K} | `{schedule}` | {found.measured:.1%} | {found.simulated:.1%} | {found.formula:.1%} | "
                f"{FORMULAS[schedule]} | {found.forward_ms:.1f}, {found.backward_ms:.1f}{weight} |"
            )
        return lines

    def headline_values(self) -> dict[str, float]:
        """Each headline schedule's ours / torch ratio, the lower of its K (NaN until both engines run it)."""
        values = {}
        for schedule in HEADLINE_SCHEDULES:
            ratios = [self.ratio(schedule, K).value for K in self.processes] if schedule in self.schedules else []
            values[schedule] = min(ratios) if ratios else math.nan
        return values

    def headline(self) -> str:
        """``ratio_interleaved_vs_torch=R ratio_zero_bubble_vs_torch=R ratio_zbv_vs_torch=R``."""
        return " ".join(f"ratio_{name}_vs_torch={value:.2f}" for name, value in self.headline_values().items())

    def markdown(self, refusals: Sequence[Refusal], memory: tuple[list[str], dict[str, str]]) -> str:
        """Every table of the run."""
        parts = [
            f"**Model**: {self.model.title()}, M = {self.chunks} (micro-batches of "
            f"{self.model.batch // self.chunks}), the same on every K and schedule; each process one thread.",
            "",
            "**Throughput**, ours against torch's own schedule on the same stages (median of per-round ratios), and "
            "each process's peak of saved activations against the same engine's 1F1B (process 0 first):",
            "",
            *self.throughput_table(),
            "",
            "**Our steps torch does not run** (zero bubble):",
            "",
            *self.variants_table(refusals),
            "",
            "**Bubble** of one recorded step of ours (the median makespan of three), per process, against the "
            "simulator given that step's own pass times and against the formula:",
            "",
            *self.bubble_table(),
            "",
            "**Activation memory of 1F1B against fill-drain as M grows** (stages as threads, exact count):",
            "",
            *memory[0],
            "",
            f"Load: {self.results.load_summary()}. `*` marks a value that had to use windows with foreign load.",
        ]
        return "\n".join(parts)


_BEGIN = "<!-- schedule-speed results: generated by benchmarks/schedule_speed/run.py, do not edit by hand -->"
_END = "<!-- end of schedule-speed results -->"


def write_docs(
    path: pathlib.Path,
    report: Report,
    refusals: Sequence[Refusal],
    memory: tuple[list[str], dict[str, str]],
    charts: Sequence[tuple[str, pathlib.Path]],
    command: str,
) -> None:
    """Put the results between the markers of ``path``; the hand-written text around them is kept."""
    pictures = [f"![ours, {schedule}]({os.path.relpath(chart, path.parent)})" for schedule, chart in charts]
    block = "\n".join(
        [
            f"Command: `make bench-schedules` (runs `{command}`). Machine: {machine_line()}.",
            "",
            report.markdown(refusals, memory),
            "",
            "```",
            report.headline(),
            "```",
            "",
            "\n\n".join(pictures),
        ]
    )
    write_block(path, _BEGIN, _END, block)
