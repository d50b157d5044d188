"""The GPU benchmark's table: step time, tokens/s, MFU, peak memory and throughput relative to ``auto`` in the same run.

MFU counts the model's FLOPs only (re-materialization's extra forward is not counted, so it lowers MFU): per step
``6 * N * tokens + 12 * L * D_attn * T * tokens``, N every parameter, L layers, D_attn the attention width (heads x
head_dim), T the sequence length. The first term is the matrix multiplications of forward (2 N per token) and backward
(4 N); the second the attention scores and their weighted sum (2 T D_attn each per token and layer, forward, times 3
with backward), the whole T x T square as the PaLM paper counts it (causality not subtracted).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from benchmarks.gpu_speed.configs import Config, Workload

__all__ = ["COLUMNS", "PEAK_TFLOPS", "Row", "model_flops", "peak_tflops", "read_table", "rows", "table"]

# Dense bf16 peak of each card (NVIDIA's data sheets), looked up by the device name's first match, in this order.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H200", 989.0),
    ("A100", 312.0),
)
COLUMNS = ("configuration", "ms", "tokens/s", "MFU", "peak GiB", "vs auto")
AUTO = "auto"  # the key of the configuration every ratio divides by


def peak_tflops(device_name: str) -> float | None:
    """The bf16 dense peak of ``device_name`` (TFLOP/s), None for a card not in :data:`PEAK_TFLOPS`."""
    return next((peak for name, peak in PEAK_TFLOPS if name in device_name), None)


def model_flops(workload: Workload, parameters: int) -> float:
    """FLOPs of one training step's model arithmetic (the module docstring's formula)."""
    attention_width = workload.d_model  # the zoo's Transformer-L splits D among the heads
    per_token = 6 * parameters + 12 * workload.num_layers * attention_width * workload.seq_len
    return float(per_token * workload.tokens)


@dataclass(frozen=True)
class Row:
    """One configuration's line; ``note`` says why it has no numbers (skipped, failed, out of memory)."""

    label: str
    ms: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    peak_gib: float | None = None
    vs_auto: float | None = None
    note: str = ""


def rows(
    configs: list[Config], results: dict[str, dict[str, Any]], workload: Workload, peak: float | None
) -> list[Row]:
    """A row per configuration, in ``configs``' order, from ``results`` (by key: a measurement or ``{"note": ...}``).

    The ratio to ``auto`` divides ``auto``'s median step by the configuration's (throughput relative to ``auto``),
    both from ``results``, i.e. measured in the same run; without an ``auto`` measurement there is none.
    """
    auto = results.get(AUTO, {})
    auto_ms = 1e3 * statistics.median(auto["step_seconds"]) if auto.get("step_seconds") else None
    table = []
    for config in configs:
        result = results.get(config.key, {"note": "not run"})
        peak_gib = result["peak_bytes"] / 2**30 if result.get("peak_bytes") is not None else None
        if not result.get("step_seconds"):
            table.append(Row(config.label, peak_gib=peak_gib, note=result.get("note") or result.get("status", "")))
            continue
        seconds = statistics.median(result["step_seconds"])
        mfu = model_flops(workload, result["parameters"]) / seconds / (peak * 1e12) if peak else None
        ms = 1e3 * seconds
        vs_auto = auto_ms / ms if auto_ms is not None else None
        table.append(Row(config.label, ms, workload.tokens / seconds, mfu, peak_gib, vs_auto))
    return table


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(lines: list[Row], peak: float | None) -> str:
    """The markdown table of ``lines``; the MFU column names the peak it divides by."""
    mfu = f"MFU ({peak:g} TFLOP/s)" if peak else "MFU (no peak known)"
    header = [*COLUMNS[:3], mfu, *COLUMNS[4:]]
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in lines:
        ms = row.note if row.ms is None else f"{row.ms:.1f}"
        cells = [
            row.label,
            ms,
            _cell(row.tokens_per_second, ",.0f"),
            _cell(row.mfu, ".2f"),
            _cell(row.peak_gib, ".1f"),
            _cell(row.vs_auto, ".2f"),
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def read_table(text: str) -> dict[str, dict[str, str]]:
    """The rows of the first table in ``text`` printed by :func:`table`: label -> {column: cell}, MFU's column "MFU"."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    if not lines:
        return {}
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    header = ["MFU" if name.startswith("MFU") else name for name in header]
    parsed = {}
    for line in lines[1:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells[0] == header[0]:
            break  # a second table
        parsed[cells[0]] = dict(zip(header, cells, strict=True))
    return parsed
