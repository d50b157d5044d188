"""The Table 2 layout of a run, its plots, and the results block of ``docs/benchmarks/zoo_throughput.md``."""

from __future__ import annotations

import math
import pathlib
from collections.abc import Sequence

from benchmarks.engine_speed.results import Estimate, Goals, Results, bubble_bound
from benchmarks.zoo_throughput.models import WORKLOADS

__all__ = ["BEGIN", "END", "ROWS", "goal_lines", "markdown_tables", "plot_model", "table_rows"]

# (configuration, row label): K and where the stages run, as the paper's Table 2 names its rows.
ROWS: tuple[tuple[str, str], ...] = (
    ("unpipelined", "unpipelined (K = 1, M = 1)"),
    ("accumulation", "accumulation (K = 1, 1 process)"),
    ("two_threads", "two_threads (1 process, 2 threads)"),
    ("ours_k1", "ours, K = 1"),
    ("ours", "ours, K = 2 (2 processes)"),
    ("torch_pipelining", "torch_pipelining, K = 2 (2 processes)"),
    ("torchgpipe", "torchgpipe, K = 2 (2 threads of 1 process)"),
)


def _normalized(results: Results, workload: str, config: str, chunks: int) -> Estimate:
    return results.ratio((workload, config, chunks), (workload, "unpipelined", 1))


def table_rows(results: Results, workload: str, chunk_list: Sequence[int]) -> dict[str, list[Estimate]]:
    """Throughput normalized to ``unpipelined`` per configuration and M, plus the bubble bound and E rows."""
    rows = {config: [_normalized(results, workload, config, m) for m in chunk_list] for config, _ in ROWS}
    # What a perfect fill-drain pipeline of two equal stages reaches, given what micro-batching alone costs.
    rows["bubble_bound"] = [
        Estimate(a.value * bubble_bound(m), a.flagged) for a, m in zip(rows["accumulation"], chunk_list, strict=True)
    ]
    rows["efficiency"] = [results.efficiency(workload, m) for m in chunk_list]
    return rows


_EXTRA_LABELS = {
    "bubble_bound": "bubble bound, K = 2: accumulation x KM/(M+K-1)",
    "efficiency": "ours / bubble bound (E)",
}


def _model_tables(results: Results, workload: str, chunk_list: Sequence[int]) -> list[str]:
    labels = dict(ROWS) | _EXTRA_LABELS
    rows = table_rows(results, workload, chunk_list)
    lines = ["| configuration | " + " | ".join(f"M = {m}" for m in chunk_list) + " |"]
    lines.append("|---|" + "---:|" * len(chunk_list))
    for config, values in rows.items():
        lines.append(f"| {labels[config]} | " + " | ".join(v.show() for v in values) + " |")
    lines += [
        "",
        "Windows kept (clean / measured), how far single rounds landed, and peak RSS growth during training (max over "
        "the processes of a configuration):",
        "",
        "| configuration | M | clean windows | throughput / unpipelined, per round | memory growth (MiB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for config, _ in ROWS:
        for m in [1] if config in ("unpipelined", "two_threads") else chunk_list:
            if config == "accumulation" and m == 1:
                continue  # the unpipelined step itself
            windows = results.windows(workload, config, m).values()
            spread = (
                _normalized(results, workload, config, m).spread() if config != "unpipelined" else "1 by definition"
            )
            memory = results.memory_mib(workload, config, m).show("{:.0f}")
            lines.append(f"| {config} | {m} | {sum(w.clean for w in windows)}/{len(windows)} | {spread} | {memory} |")
    return lines


def _tiny_table(results: Results, workload: str, chunks: int) -> list[str]:
    lines = ["| configuration | M | throughput / unpipelined | ours / this | memory growth (MiB) |"]
    lines.append("|---|---:|---:|---:|---:|")
    for config, _ in ROWS:
        m = 1 if config in ("unpipelined", "two_threads") else chunks
        normalized = _normalized(results, workload, config, m)
        versus = results.ratio((workload, "ours", chunks), (workload, config, m))
        memory = results.memory_mib(workload, config, m).show("{:.0f}")
        lines.append(f"| {config} | {m} | {normalized.show()} | {versus.show()} | {memory} |")
    return lines


def markdown_tables(
    results: Results, models: Sequence[str], chunk_list: Sequence[int], tiny: str, tiny_chunks: int
) -> str:
    """Every table of the run, as markdown."""
    parts: list[str] = []
    for workload in models:
        parts += [
            f"**{WORKLOADS[workload].title}**: training throughput normalized to `unpipelined` (K = 1, M = 1), "
            "the median over rounds of per-round ratios.",
            "",
            *_model_tables(results, workload, chunk_list),
            "",
        ]
    parts += [
        f"**Overhead-bound stages: {WORKLOADS[tiny].title}**, M = {tiny_chunks}:",
        "",
        *_tiny_table(results, tiny, tiny_chunks),
        "",
        f"Load: {results.load_summary()}. `*` marks a value that had to use windows with foreign load.",
    ]
    loaded = sum(not m.clean for m in results.measurements)
    if loaded * 2 > len(results.measurements):
        parts += [
            "",
            f"**Not a measurement of the engines:** {loaded} of {len(results.measurements)} windows ran with other "
            "processes busy on this machine, so the ratios above mostly measure how the scheduler shared the cores "
            "among them. Re-run on a quiet machine before reading them.",
        ]
    return "\n".join(parts)


def plot_model(results: Results, workload: str, chunk_list: Sequence[int], path: pathlib.Path) -> None:
    """Normalized throughput against M, one line per configuration, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = table_rows(results, workload, chunk_list)
    figure, axes = plt.subplots(figsize=(7.5, 4.5))
    styles = {
        "accumulation": ("tab:gray", "o", "-"),
        "ours_k1": ("tab:olive", "v", "-"),
        "ours": ("tab:blue", "s", "-"),
        "torch_pipelining": ("tab:orange", "^", "-"),
        "torchgpipe": ("tab:green", "D", "-"),
        "bubble_bound": ("black", "", "--"),
    }
    labels = dict(ROWS) | _EXTRA_LABELS
    for config, (color, marker, line) in styles.items():
        values = [v.value for v in rows[config]]
        if all(math.isnan(v) for v in values):
            continue
        axes.plot(chunk_list, values, color=color, marker=marker, linestyle=line, label=labels[config])
    for config, color in (("unpipelined", "tab:red"), ("two_threads", "tab:purple")):
        value = rows[config][0].value
        if not math.isnan(value):
            axes.axhline(value, color=color, linestyle=":", label=labels[config])
    axes.set_xscale("log", base=2)
    axes.set_xticks(list(chunk_list), [str(m) for m in chunk_list])
    axes.set_xlabel("M, micro-batches per mini-batch")
    axes.set_ylabel("throughput / unpipelined")
    axes.set_ylim(bottom=0)
    axes.set_title(WORKLOADS[workload].title, fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="lower left")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


BEGIN = "<!-- zoo-throughput results: generated by benchmarks/zoo_throughput/run.py, do not edit by hand -->"
END = "<!-- end of zoo-throughput results -->"


def goal_lines(goals: Goals) -> list[str]:
    """The headline ``key=value`` lines, one per goal, ``*`` when a value had to use loaded windows."""
    return [
        f"ratio_vs_torch_pipelining={goals.ratio_vs_torch.show()}",
        f"small_stage_ratio_vs_torch_pipelining={goals.small_ratio_vs_torch.show()}",
        f"efficiency_vs_bubble_bound={goals.efficiency.show()}",
    ]
