"""Peak memory of GPipeStrategy with and without re-materialization for M = 1, 4, 8, against the paper's formula.

Usage: ``python -m benchmarks.strategy_memory.run [--accelerator cuda]`` (about 2 minutes on a quiet 2-core machine);
writes this folder's ``RESULTS.md`` (``RESULTS_cuda.md`` on CUDA, read the CUDA allocator column).
The measurements come from ``measure.py`` beside it, which ``test_memory.py`` asserts on: a fresh process per
configuration.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import tempfile

import lightning
import torch

from benchmarks.machine import cpu_model
from benchmarks.strategy_memory.measure import measure_runs

__all__ = ["main"]

HERE = pathlib.Path(__file__).resolve().parent
MIB = 2**20
CHUNKS = (1, 4, 8)
TIMEOUT = 900.0


def _mib(value: float) -> str:
    return f"{value / MIB:,.1f}"


def markdown(result: dict, command: str, started: datetime.datetime, load: str, accelerator: str = "cpu") -> str:
    """The results page: setup, one row per (M, mode), one row per M for the saving."""
    model = result["model"]
    cuda = accelerator == "cuda"
    device = f"{torch.cuda.get_device_name()} (CUDA)" if cuda else "CPU"
    runs = {(run["mode"], run["chunks"]): run for run in result["runs"]}
    lines = [
        "# GPipeStrategy memory: re-materialization against the GPipe formula",
        "",
        f"Stack: {model['blocks']} x (Linear({model['width']}, {model['width']}) + GELU) + Linear({model['width']}, "
        f"{model['out']}), {model['layers']} layers, {model['parameter_bytes'] / MIB:.1f} MiB of parameters; one batch "
        f"of N = {model['samples']:,} samples; `GPipeStrategy(pipe_size=1, chunks=M, checkpoint=...)` on "
        f'`Trainer(accelerator="{accelerator}", devices=1)` on {device}, SGD, {model["steps"]} steps, one thread, '
        "each run in a fresh process.",
        "",
        f"Saved activations of the whole batch (analytic: 2 tensors of N x {model['width']} float32 per block): "
        f"{_mib(result['hidden_activation_bytes'])} MiB; `lightning_gpipe.profile.cost.memory_cost` counts "
        f"{_mib(result['memory_cost_activation_bytes'])} MiB.",
        "",
        "Predicted growth (GPipe paper): `never` keeps every layer's activations of all N samples, O(L·N); `always` "
        "keeps each micro-batch's boundary input and output, O(N), plus one micro-batch's activations while it is "
        "recomputed, O(L·N/M). The boundary input is the data batch, resident before the first step. Measured: "
        "*tensors* = peak bytes of live tensor storage allocated during training (exact, allocator-independent); "
        "*RSS* = peak RSS (VmHWM, reset before the first step) minus RSS before the first step, with glibc's mmap "
        "threshold pinned at 128 KiB so that freed activations leave RSS (its offset over *tensors* is allocator and "
        "interpreter overhead)."
        + (
            " On CUDA, *CUDA allocator* = `torch.cuda.max_memory_allocated` (reset before the first step) minus what "
            "the allocator held there; RSS does not see GPU memory."
            if cuda
            else ""
        ),
        "",
        "| M | checkpoint | predicted growth (MiB) | tensors (MiB) | "
        + ("CUDA allocator" if cuda else "RSS growth")
        + " (MiB) | step (s) |",
        "|---|---|---|---|---|---|",
    ]
    measured = "cuda_growth" if cuda else "rss_growth"
    for chunks in CHUNKS:
        for mode in ("never", "always"):
            run = runs[(mode, chunks)]
            lines.append(
                f"| {chunks} | {mode} | {_mib(run['predicted'])} | {_mib(run['tensor_peak'])} | "
                f"{_mib(run[measured])} | {run['first_step_seconds']:.2f} |"
            )
    lines += [
        "",
        f"| M | predicted saving (MiB) | saving, tensors (MiB) | saving, {'CUDA' if cuda else 'RSS'} (MiB) | "
        f"{'CUDA' if cuda else 'RSS'} / predicted |",
        "|---|---|---|---|---|",
    ]
    for chunks in CHUNKS:
        never, always = runs[("never", chunks)], runs[("always", chunks)]
        predicted = never["predicted"] - always["predicted"]
        tensors = never["tensor_peak"] - always["tensor_peak"]
        saving = never[measured] - always[measured]
        ratio = f"{saving / predicted:.2f}" if predicted > 0 else "n/a (nothing predicted)"
        lines.append(f"| {chunks} | {_mib(predicted)} | {_mib(tensors)} | {_mib(saving)} | {ratio} |")
    lines += [
        "",
        "At M = 1 re-materialization rebuilds the whole batch's activations during backward, so it saves nothing. "
        "Step times are the first step's, on a shared machine: indicative only.",
        "",
        f"- command: `{command}`",
        f"- machine: {os.cpu_count()} CPUs (nproc), {cpu_model()}, {platform.system()} {platform.release()}; "
        f"load average at start: {load}",
        f"- software: Python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}",
        f"- date: {started:%Y-%m-%d %H:%M} UTC",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--output", type=pathlib.Path, default=None, help="default: RESULTS.md (RESULTS_cuda.md)")
    args = parser.parse_args(argv)
    output = args.output or HERE / ("RESULTS_cuda.md" if args.accelerator == "cuda" else "RESULTS.md")
    started = datetime.datetime.now(datetime.timezone.utc)
    with open("/proc/loadavg") as loadavg:
        load = " ".join(loadavg.read().split()[:3])
    runs = [(mode, chunks) for chunks in CHUNKS for mode in ("never", "always")]
    with tempfile.TemporaryDirectory(prefix="strategy-memory-") as root:
        result = measure_runs(runs, root, accelerator=args.accelerator, timeout=TIMEOUT)
    command = "python -m benchmarks.strategy_memory.run" + (" --accelerator cuda" if args.accelerator == "cuda" else "")
    page = markdown(result, command, started, load, args.accelerator)
    output.write_text(page)
    print(page)


if __name__ == "__main__":
    main()
