"""Zoo throughput benchmark (GPipe Table 2 analogue): interleaved rounds, then the tables, plots, docs and headlines.

Usage: ``python -m benchmarks.zoo_throughput.run [--quick | --smoke] [--no-docs]`` (see this folder's README).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
import platform
import signal
import sys
from collections.abc import Sequence

from rich.console import Console

from benchmarks.docs_page import write_block
from benchmarks.engine_speed.results import Goals, Results, headline
from benchmarks.engine_speed.rounds import progress_bar, run_rounds
from benchmarks.engine_speed.worker import Job, JobRunner
from benchmarks.machine import cpu_model
from benchmarks.zoo_throughput.models import WORKLOADS, balance
from benchmarks.zoo_throughput.plan import FULL, QUICK, SMOKE, TINY, TINY_CHUNKS, Plan
from benchmarks.zoo_throughput.report import BEGIN, END, goal_lines, markdown_tables, plot_model

__all__ = ["main"]

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "benchmarks" / "zoo_throughput.md"
IMAGES = REPO / "docs" / "img"
HEADLINE_CHUNKS = 8  # R and E are read at M = 8, as in the engine benchmark
_PRELOAD = ["zoo", "torchgpipe", "benchmarks.zoo_throughput.plan"]


def _step_guess(job: Job) -> float:
    # Before a job has run once: seconds per step on one quiet thread.
    return {"transformer": 0.5, "amoebanet": 0.7, "tiny": 0.03}[job.workload]


def _load_average() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def _machine() -> str:
    import torch
    import torchgpipe

    return (
        f"`nproc` = {os.cpu_count()}, {cpu_model()}, torch {torch.__version__}, torchgpipe {torchgpipe.__version__}, "
        f"Python {platform.python_version()}, {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}"
    )


def _chart(workload: str) -> pathlib.Path:
    return IMAGES / f"bench_throughput_{workload}.png"


def _write_docs(
    results: Results, plan: Plan, tables: str, goals: Goals, command: str, loads: tuple[str, str], balances: str
) -> None:
    for workload in plan.models:
        plot_model(results, workload, plan.chunks, _chart(workload))
    charts = [f"![Normalized throughput against M, {WORKLOADS[w].title}](../img/{_chart(w).name})" for w in plan.models]
    block = "\n".join(
        [
            f"Command: `{command}`. Machine: {_machine()}. Load average (1 / 5 / 15 min) at the start {loads[0]}, at "
            f"the end {loads[1]}. Stage split (layers per stage, balanced by forward FLOPs): {balances}.",
            "",
            tables,
            "",
            *charts,
            "",
            *goals.verdicts(),
            "",
            "```",
            *goal_lines(goals),
            "```",
        ]
    )
    write_block(DOCS, BEGIN, END, block)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.zoo_throughput.run",
        description="Training throughput of the zoo's models for K in {1, 2} and several M, against "
        "torch.distributed.pipelining and torchgpipe (the GPipe paper's Table 2 on CPU processes).",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="M in {1, 8}, fewer rounds and steps: <= 8 min")
    mode.add_argument("--smoke", action="store_true", help="one step of every configuration on the tiny model; no docs")
    parser.add_argument("--rounds", type=int, help="override the number of rounds")
    parser.add_argument("--no-docs", action="store_true", help="leave docs/benchmarks/zoo_throughput.md and the PNGs")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse(argv)
    # `kill` (SIGTERM) unwinds like Ctrl-C, so that the launcher still stops every worker it started.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    plan = SMOKE if args.smoke else QUICK if args.quick else FULL
    if args.rounds is not None:
        if args.rounds < 1:
            raise ValueError(f"--rounds {args.rounds}: give at least 1 round")
        plan = dataclasses.replace(plan, rounds=args.rounds, min_rounds=min(plan.min_rounds, args.rounds))
    console = Console(stderr=True)
    start_load = _load_average()
    balances = {workload: balance(workload) for workload in (*plan.models, TINY)}
    jobs = plan.round_jobs(balances)
    with progress_bar(console) as progress, JobRunner(os.getpid(), preload=_PRELOAD) as launcher:
        task = progress.add_task("starting the worker server (imports torch once)", total=plan.rounds * len(jobs))
        measurements = run_rounds(plan, jobs, launcher, progress, task, _step_guess)

    results = Results(measurements)
    realistic = plan.models[0] if plan.models else TINY
    goals = headline(
        results,
        HEADLINE_CHUNKS,
        TINY_CHUNKS,
        workloads=(realistic, TINY),
        titles=(WORKLOADS[realistic].model, f"{WORKLOADS[TINY].model} made tiny"),
    )
    tables = markdown_tables(results, plan.models, plan.chunks, TINY, TINY_CHUNKS)
    if not (args.smoke or args.no_docs):
        command = " ".join(["python -m benchmarks.zoo_throughput.run", *argv])
        split = ", ".join(f"{WORKLOADS[w].model} {list(b)}" for w, b in balances.items() if w in plan.models)
        _write_docs(results, plan, tables, goals, command, (start_load, _load_average()), split)
        console.print(f"wrote {DOCS.relative_to(REPO)} and its charts under {IMAGES.relative_to(REPO)}")
    print(tables)
    print()
    print("\n".join(goals.verdicts()))
    print(f"Load average (1 / 5 / 15 min): {start_load} at the start, {_load_average()} at the end")
    print("\n".join(goal_lines(goals)))  # last, for scripts: one key=value per line
    return 0


if __name__ == "__main__":
    sys.exit(main())
