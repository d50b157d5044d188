"""``make bench-gpu``: issue 33's table on one CUDA GPU, every configuration in a fresh process, in under 8 minutes.

Usage: ``python -m benchmarks.gpu_speed.run [--quick] [--only KEY ...] [--budget S] [--peak-tflops P] [--no-docs]``,
and ``--device cpu --tiny`` to dry-run every configuration on a tiny model (see this folder's README);
``--workload causal_lm`` times a random-initialized 0.5B Qwen2 instead (issue 32), in its own table. Without CUDA
and without ``--device cpu`` it says that it needs a GPU and exits 0, so the target is safe anywhere. Configurations
run by priority (issue 33's table first) while the time budget lasts; what would not fit is skipped and named. The
table is printed, and (unless ``--tiny`` or ``--no-docs``) written into ``docs/benchmarks/gpu.md`` between markers.
Exits 1 when a configuration failed (being skipped or out of memory is not a failure).
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.docs_page import write_block
from benchmarks.gpu_speed.configs import (
    CAUSAL_LM,
    CAUSAL_LM_KEYS,
    CAUSAL_LM_TINY,
    FULL,
    QUICK,
    QUICK_KEYS,
    TINY,
    Config,
    Workload,
    configurations,
    strategy_accepts_compile,
    strategy_accepts_selective,
)
from benchmarks.gpu_speed.report import peak_tflops, rows, table
from tools.launch import JobError, JobTimeoutError, Launcher

__all__ = ["main"]

REPO = pathlib.Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "benchmarks" / "gpu.md"
# Each workload's table on the page, between its own markers.
MARKERS = {
    "transformer_lm": ("<!-- gpu-speed:begin -->", "<!-- gpu-speed:end -->"),
    "causal_lm": ("<!-- gpu-speed-causal-lm:begin -->", "<!-- gpu-speed-causal-lm:end -->"),
}
BUDGET = 450.0  # seconds from the start of the command to the end of its last configuration: 8 minutes with margin
JOB_LIMIT = 300.0  # no configuration runs longer, whatever the budget
# A configuration's duration before any of its kind has run: a first compile (cold caches) takes the longest.
FIRST_GUESS = {False: 60.0, True: 150.0}


class Budget:
    """The time left, and a guess of each configuration's duration from those of its kind (compiled or not) so far."""

    def __init__(self, seconds: float, started: float) -> None:
        self.deadline = started + seconds
        self.durations: dict[bool, list[float]] = {False: [], True: []}

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def guess(self, config: Config) -> float:
        compiled = config.user_compile or config.strategy_compile
        return max(self.durations[compiled], default=FIRST_GUESS[compiled])

    def record(self, config: Config, seconds: float) -> None:
        self.durations[config.user_compile or config.strategy_compile].append(seconds)


def measure_all(
    configs: list[Config], workload: Workload, device: str, budget: Budget, threads: int
) -> dict[str, dict[str, Any]]:
    """Each configuration's result by key, run by priority in fresh processes; ``{"note": why}`` for one not measured.

    ``auto`` always runs (every ratio needs it); another configuration runs only if its guessed duration fits what is
    left of the budget, and is stopped when the budget ends (or after a minute, when less was left).
    """
    from benchmarks.gpu_speed.measure import run_config

    results: dict[str, dict[str, Any]] = {}
    order = sorted(configs, key=lambda config: (config.key != "auto", config.priority))
    preload = ["benchmarks.gpu_speed.measure", *(["benchmarks.gpu_speed.causal_lm"] * (workload.model == "qwen2"))]
    with Launcher(preload=preload) as launcher:
        for config in order:
            left = budget.remaining()
            if config.key != "auto" and budget.guess(config) > left:
                results[config.key] = {"note": "skipped (budget)"}
                print(
                    f"{config.key}: skipped, about {budget.guess(config):.0f} s needed, {max(left, 0):.0f} s left",
                    flush=True,
                )
                continue
            timeout = min(JOB_LIMIT, max(left, FIRST_GUESS[False]))
            start = time.monotonic()
            try:
                (result,) = launcher.run(
                    run_config, (config, workload, device), 1, timeout, threads=threads, label=config.key
                )
            except JobTimeoutError:
                result = {"note": f"skipped (stopped after {timeout:.0f} s)"}
            except JobError as error:
                result = {"note": "failed", "error": str(error).strip().splitlines()[-1]}
            seconds = time.monotonic() - start
            budget.record(config, seconds)
            results[config.key] = result
            print(f"{config.key}: {_summary(result)} [{seconds:.0f} s]", flush=True)
    return results


def _summary(result: dict[str, Any]) -> str:
    if result.get("step_seconds"):
        peak = f", peak {result['peak_bytes'] / 2**30:.1f} GiB" if result.get("peak_bytes") is not None else ""
        return f"median step {1e3 * statistics.median(result['step_seconds']):.1f} ms{peak}"
    if "error" in result:
        return f"failed: {result['error']}"
    return str(result.get("note") or result.get("status"))


def report(
    configs: list[Config],
    results: dict[str, dict[str, Any]],
    workload: Workload,
    peak: float | None,
    command: str,
    started: datetime.datetime,
    seconds: float,
) -> str:
    """The table and what it ran on: device, software, command, date, workload, and what was not measured."""
    measured = [result for result in results.values() if "device_name" in result]
    device = measured[0]["device_name"] if measured else "no configuration ran"
    software = measured[0]["software"] if measured else f"torch {torch.__version__}"
    lines = [
        table(rows(configs, results, workload, peak), peak),
        "",
        f"- device: {device}; {software}",
        f"- command: `{command}` ({seconds / 60:.1f} min)",
        f"- date: {started:%Y-%m-%d %H:%M} UTC",
        f"- workload: {workload.describe()}; bf16-mixed; median of {workload.steps} steps after "
        f"{workload.warmup} warm-up step{'s' * (workload.warmup > 1)}; every configuration in a fresh process",
    ]
    for config in configs:
        result = results.get(config.key, {})
        if "error" in result:
            lines.append(f"- {config.label} failed: {result['error']}")
    skipped = [
        config.label for config in configs if str(results.get(config.key, {}).get("note", "")).startswith("skipped")
    ]
    if skipped:
        lines.append(f"- not measured, to stay within the budget: {', '.join(skipped)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure, print and record the table; 0 unless a configuration failed."""
    started_clock = time.monotonic()
    started = datetime.datetime.now(datetime.timezone.utc)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload",
        choices=tuple(MARKERS),
        default="transformer_lm",
        help="the zoo's Transformer-L (735M), or a random Qwen2 of Qwen2.5-0.5B's shape as zoo.PretrainedCausalLM",
    )
    parser.add_argument("--quick", action="store_true", help=f"{' and '.join(QUICK_KEYS)} on a small model")
    parser.add_argument("--tiny", action="store_true", help="a tiny model: a dry run of the code paths")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu needs --tiny")
    parser.add_argument("--only", nargs="+", metavar="KEY", help="these configurations (keys: see the README)")
    parser.add_argument("--budget", type=float, default=BUDGET, help="seconds for the whole run (default %(default)s)")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, for a card not in the table")
    parser.add_argument("--no-docs", action="store_true", help="leave docs/ alone")
    args = parser.parse_args(argv)
    if args.device == "cpu" and not args.tiny:
        parser.error("--device cpu runs only with --tiny: the full model would take hours on a CPU")
    causal = args.workload == "causal_lm"
    if causal and args.quick:
        parser.error(f"--quick is Transformer-L's short form; --workload causal_lm runs {', '.join(CAUSAL_LM_KEYS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "benchmarks.gpu_speed needs a CUDA GPU and found none: nothing measured (--device cpu --tiny dry-runs it)"
        )
        return 0
    every = configurations(strategy_accepts_selective(), strategy_accepts_compile())
    if causal:  # the hand loops are written for Transformer-L's batches and loss
        every = [config for config in every if config.runner != "hand"]
    unknown = set(args.only or ()) - {config.key for config in every}
    if unknown:
        parser.error(f"--only {' '.join(sorted(unknown))}: no such configuration; choose from {[c.key for c in every]}")
    keys = args.only or (CAUSAL_LM_KEYS if causal else QUICK_KEYS if args.quick else [config.key for config in every])
    configs = [config for config in every if config.key in keys]
    if causal:
        workload = CAUSAL_LM_TINY if args.tiny else CAUSAL_LM
    else:
        workload = TINY if args.tiny else QUICK if args.quick else FULL
    threads = 1 if args.device == "cpu" else 4  # on a GPU the host only launches kernels
    results = measure_all(configs, workload, args.device, Budget(args.budget, started_clock), threads)
    device_name = next((r["device_name"] for r in results.values() if "device_name" in r), "")
    peak = args.peak_tflops or peak_tflops(device_name)
    command = " ".join(["python -m benchmarks.gpu_speed.run", *(argv if argv is not None else sys.argv[1:])])
    text = report(configs, results, workload, peak, command, started, time.monotonic() - started_clock)
    print(text)
    if not (args.tiny or args.no_docs):
        write_block(PAGE, *MARKERS[args.workload], text)
    return 1 if any("error" in result for result in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
