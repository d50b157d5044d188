"""Every benchmark in one run: ``make bench`` (full) and ``make bench-quick``, ending with the issue's headline lines.

Usage: ``python -m benchmarks [--quick] [--no-docs] [--only NAME ...]``.

Each experiment runs as its own subprocess (``python -m benchmarks.<name>.run``), one after the other so that none
disturbs another's timing, under a hard deadline that kills its whole process group. Progress and tables stream
through; the ``key=value`` lines an experiment prints last are collected, and this run ends by printing all of them,
in the order below, so a script can read the run's headlines from the last lines of its output. The overview page
``docs/benchmarks/index.md`` gets the headlines, goals, command, machine and date of the run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.docs_page import write_block
from benchmarks.machine import cpu_model
from tools.launch import run_command

__all__ = ["EXPERIMENTS", "Experiment", "Headline", "headlines_from", "main"]

REPO = pathlib.Path(__file__).resolve().parents[1]
INDEX = REPO / "docs" / "benchmarks" / "index.md"
BEGIN, END = "<!-- headlines:begin -->", "<!-- headlines:end -->"
HEADLINE = re.compile(r"^([a-z][a-z0-9_]*)=(\S+)$")


@dataclass(frozen=True)
class Headline:
    """A goal the issue sets for a headline value (``value >= minimum``, or ``value <= minimum`` with ``at_most``)."""

    key: str
    minimum: float
    meaning: str
    at_most: bool = False

    def met(self, value: float) -> bool:
        return value <= self.minimum if self.at_most else value >= self.minimum


@dataclass(frozen=True)
class Experiment:
    """One benchmark folder: its module, the deadlines of its two modes, and the headlines it must print."""

    name: str
    quick_deadline: float  # seconds
    full_deadline: float
    headlines: tuple[Headline, ...] = ()
    quick: bool = True  # part of ``--quick``; the others run only in the full run
    writes_docs: bool = True  # takes ``--no-docs``; the older strategy benchmarks write their folder's RESULTS.md

    def command(self, quick: bool, no_docs: bool) -> list[str]:
        return [
            sys.executable,
            "-m",
            f"benchmarks.{self.name}.run",
            *(["--quick"] if quick else []),
            *(["--no-docs"] if no_docs and self.writes_docs else []),
        ]


EXPERIMENTS: tuple[Experiment, ...] = (
    Experiment("bubble", quick_deadline=300, full_deadline=1200),
    Experiment(
        "zoo_throughput",
        quick_deadline=660,
        full_deadline=3600,
        headlines=(
            Headline("ratio_vs_torch_pipelining", 1.00, "our throughput / ScheduleGPipe's, K = 2, M = 8"),
            Headline("small_stage_ratio_vs_torch_pipelining", 1.50, "the same on overhead-bound stages, M = 16"),
            Headline("efficiency_vs_bubble_bound", 0.95, "share of the fill-drain bound reached, K = 2, M = 8"),
        ),
    ),
    Experiment(
        "zoo_memory",
        quick_deadline=480,
        full_deadline=2400,
        headlines=(
            Headline("pipeline1_layers_vs_naive1", 2.5, "deepest Transformer-L in one budget, Pipeline-1 / Naive-1"),
        ),
    ),
    Experiment(
        "plan_calibration",
        quick_deadline=0,
        full_deadline=2400,
        quick=False,
        headlines=(
            Headline("plan_memory_error", 0.10, "worst relative error of predicted peak memory per stage", True),
            Headline("plan_time_error", 0.15, "worst relative error of predicted step time", True),
        ),
    ),
    Experiment(
        "generate",
        quick_deadline=0,
        full_deadline=3000,
        quick=False,
        headlines=(
            Headline("predict_k2_m2_vs_one_device", 1.4, "predict of 160 tokens, K = 2, M = 2 / one device", True),
            Headline("zoo_vs_transformers", 1.1, "the zoo's cached generate / transformers', one process", True),
            Headline("pipeline_cost_growth", 1.3, "cost per new token at 512 / at 32, K = 2, M = 2", True),
        ),
    ),
    Experiment("engine_speed", quick_deadline=0, full_deadline=1200, quick=False),
    Experiment("strategy_overhead", quick_deadline=0, full_deadline=1800, quick=False, writes_docs=False),
    Experiment("strategy_memory", quick_deadline=0, full_deadline=900, quick=False, writes_docs=False),
    Experiment(
        "fsdp_memory",
        quick_deadline=0,
        full_deadline=900,
        quick=False,
        headlines=(
            Headline("fsdp_held_vs_ddp", 0.60, "bytes the 2 x 2 ranks hold between steps, fsdp / ddp", True),
            Headline("fsdp_speed_vs_ddp", 0.80, "ddp's step time / fsdp's, 2 x 2 CPU ranks"),
        ),
    ),
    Experiment(
        "schedule_speed",
        quick_deadline=0,
        full_deadline=1500,
        quick=False,
        headlines=(
            Headline("ratio_interleaved_vs_torch", 1.00, "our throughput / ScheduleInterleaved1F1B's, lower of K 2, 4"),
            Headline("ratio_zero_bubble_vs_torch", 1.00, "ours / ScheduleInterleavedZeroBubble's, lower of K 2, 4"),
            Headline("ratio_zbv_vs_torch", 1.00, "ours / ScheduleZBVZeroBubble's, lower of K 2, 4"),
        ),
    ),
)


def headlines_from(output: str) -> dict[str, str]:
    """The trailing ``key=value`` lines of an experiment's standard output (blank lines ignored), in order."""
    found: dict[str, str] = {}
    for line in reversed([line.strip() for line in output.splitlines() if line.strip()]):
        match = HEADLINE.match(line)
        if match is None:
            break
        found[match.group(1)] = match.group(2)
    return dict(reversed(found.items()))


def _run(experiment: Experiment, quick: bool, no_docs: bool) -> tuple[int, str]:
    """Run one experiment, echoing its output as it comes; its whole process group dies at the deadline."""
    deadline = experiment.quick_deadline if quick else experiment.full_deadline
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        done = run_command(experiment.command(quick, no_docs), timeout=deadline, cwd=REPO, env=env, echo=sys.stdout)
    except subprocess.TimeoutExpired as timeout:
        print(f"{experiment.name}: killed at its {deadline:.0f} s deadline", file=sys.stderr)
        return -signal.SIGKILL, str(timeout.output or "")
    return done.returncode, done.stdout


def _index_block(results: dict[str, str], command: str, elapsed: float) -> str:
    rows = ["| headline | value | goal | met | meaning |", "|---|---|---|---|---|"]
    for experiment in EXPERIMENTS:
        for goal in experiment.headlines:
            value = results.get(goal.key)
            met = "n/a" if value is None else ("yes" if goal.met(_number(value)) else "**no**")
            bound = "<=" if goal.at_most else ">="
            rows.append(
                f"| `{goal.key}` | {value or 'missing'} | {bound} {goal.minimum:.2f} | {met} | {goal.meaning} |"
            )
    others = [f"`{key}={value}`" for key, value in results.items() if not any(key == g.key for g in _goals())]
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    lines = [
        *rows,
        "",
        *([f"Other headlines of the run: {', '.join(others)}.", ""] if others else []),
        f"- command: `{command}` ({elapsed / 60:.1f} min)",
        f"- machine: {os.cpu_count()} CPUs, {cpu_model()}, {platform.system()} {platform.release()}; "
        f"load average at the end: {load}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
    ]
    return "\n".join(lines)


def _goals() -> list[Headline]:
    return [goal for experiment in EXPERIMENTS for goal in experiment.headlines]


def _number(value: str) -> float:
    try:
        return float(value.rstrip("*"))
    except ValueError:
        return float("nan")


def _write_index(block: str) -> None:
    write_block(INDEX, BEGIN, END, block)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the quick mode of the quick experiments (< 15 min)")
    parser.add_argument("--no-docs", action="store_true", help="leave docs/ alone")
    names = [experiment.name for experiment in EXPERIMENTS]
    parser.add_argument("--only", nargs="+", choices=names, metavar="NAME", help=f"a subset of {names}")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    chosen = [e for e in EXPERIMENTS if (args.only is None or e.name in args.only) and (e.quick or not args.quick)]
    started = time.monotonic()
    results: dict[str, str] = {}
    failed: list[str] = []
    for experiment in chosen:
        print(f"\n=== {experiment.name} ({'quick' if args.quick else 'full'}) ===", file=sys.stderr, flush=True)
        code, output = _run(experiment, args.quick, args.no_docs)
        found = headlines_from(output)
        missing = [goal.key for goal in experiment.headlines if goal.key not in found]
        if code != 0 or missing:
            failed.append(f"{experiment.name} (exit code {code}{', missing ' + ', '.join(missing) if missing else ''})")
        results.update(found)
    elapsed = time.monotonic() - started
    if not args.no_docs and args.only is None:
        command = "make bench-quick" if args.quick else "make bench"
        _write_index(_index_block(results, command, elapsed))
    print(f"\n{len(chosen)} experiments in {elapsed / 60:.1f} min", file=sys.stderr)
    if failed:
        print("failed: " + "; ".join(failed), file=sys.stderr)
    goal_keys = [goal.key for goal in _goals()]
    ordered = [key for key in results if key not in goal_keys] + [key for key in goal_keys if key in results]
    print()
    for key in ordered:
        print(f"{key}={results[key]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
