"""The markdown tables of a run and the results block of ``docs/benchmarks/engine.md``."""

from __future__ import annotations

import os
import pathlib
import statistics
from collections.abc import Sequence

from benchmarks.docs_page import write_block
from benchmarks.engine_speed.results import Estimate, Goals, Key, Results, bubble_bound
from benchmarks.engine_speed.worker import JobResult
from benchmarks.engine_speed.workloads import WORKLOADS
from benchmarks.machine import machine_line
from lightning_gpipe.engine.timeline import Timeline

__all__ = ["markdown_tables", "write_docs"]

_UNPIPELINED: Key = ("transformer", "unpipelined", 1)
_ROWS = ("unpipelined", "accumulation", "two_threads", "ours", "torch_pipelining")


def _normalized_table(results: Results, chunk_list: Sequence[int]) -> list[str]:
    header = "| configuration | " + " | ".join(f"M = {m}" for m in chunk_list) + " |"
    lines = [header, "|---|" + "---:|" * len(chunk_list)]
    for config in _ROWS:
        cells = [results.ratio(("transformer", config, m), _UNPIPELINED).show() for m in chunk_list]
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    # What a perfect fill-drain pipeline of two equal stages would reach, given what micro-batching alone costs.
    accumulation = [results.ratio(("transformer", "accumulation", m), _UNPIPELINED) for m in chunk_list]
    bound = [Estimate(a.value * bubble_bound(m), a.flagged) for a, m in zip(accumulation, chunk_list, strict=True)]
    efficiency = [results.efficiency("transformer", m) for m in chunk_list]
    lines.append("| bubble bound: accumulation x KM/(M+K-1) | " + " | ".join(e.show() for e in bound) + " |")
    lines.append("| ours / bubble bound (E at M = 8) | " + " | ".join(e.show() for e in efficiency) + " |")
    return lines


def _detail_table(results: Results, workload: str, cells: Sequence[tuple[str, int]]) -> list[str]:
    batch = WORKLOADS[workload].batch_size
    lines = [
        "| configuration | M | step time (ms) | samples/s | CPU per step, each process (ms) | clean windows "
        "| memory growth (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for config, chunks in cells:
        step = results.step_seconds(workload, config, chunks)
        windows = results.windows(workload, config, chunks).values()
        throughput = Estimate(batch / step.value, step.flagged)
        clean = f"{sum(m.clean for m in windows)}/{len(windows)}"
        memory = results.memory_mib(workload, config, chunks).show("{:.0f}")
        lines.append(
            f"| {config} | {chunks} | {Estimate(step.value * 1e3, step.flagged).show('{:.1f}')} | "
            f"{throughput.show('{:.0f}')} | {results.cpu_ms(workload, config, chunks)} | {clean} | {memory} |"
        )
    return lines


def _metadata_lines(results: Results, chunk_list: Sequence[int], small_chunks: int) -> list[str]:
    """What shapes that vary per micro-batch cost: `ours_described` against `ours`, measured side by side."""
    lines = [
        "**Shapes that vary per micro-batch** (`ours_described`: every micro-batch's layout sent ahead of it and its "
        "receive posted when that arrives, as after a shape change; same arithmetic as `ours`). Throughput "
        "`ours_described / ours`, median of per-round ratios; goal on the realistic workload >= 0.97:",
        "",
    ]
    if 8 in chunk_list:
        ratio = results.ratio(("transformer", "ours_described", 8), ("transformer", "ours", 8)).show()
        lines.append(f"- realistic (Transformer), M = 8: {ratio}")
    ratio = results.ratio(("small", "ours_described", small_chunks), ("small", "ours", small_chunks)).show()
    lines.append(f"- overhead-bound (small stages), M = {small_chunks}: {ratio}")
    return lines


def markdown_tables(results: Results, chunk_list: Sequence[int], small_chunks: int = 16) -> str:
    """Every table of the run, as markdown."""
    transformer_cells = [("unpipelined", 1), ("two_threads", 1)]
    transformer_cells += [(config, m) for m in chunk_list for config in ("accumulation", "ours", "torch_pipelining")]
    transformer_cells += [("ours_described", 8)] if 8 in chunk_list else []
    transformer_cells = [(c, m) for c, m in transformer_cells if not (c == "accumulation" and m == 1)]
    small_cells = [
        ("unpipelined", 1),
        ("accumulation", small_chunks),
        ("two_threads", 1),
        ("ours", small_chunks),
        ("ours_described", small_chunks),
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
        *_metadata_lines(results, chunk_list, small_chunks),
        "",
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
            f"Command: `make bench-engine` (runs `{command}`). Machine: {machine_line()}.",
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
        ]
    )
    write_block(path, _BEGIN, _END, block)
