"""Our schedules against torch.distributed.pipelining's, side by side: interleaved rounds of fresh processes.

Usage: ``python -m benchmarks.schedule_speed.run [--quick | --tiny]`` (``make bench-schedules``; see this folder's
README). Prints the tables and ends with the headline line; the full run rewrites the results block of
``docs/benchmarks/schedules.md`` and its Gantt charts ``docs/img/schedule_speed_<schedule>.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import pstats
import shutil
import signal
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console

from benchmarks.engine_speed.results import Results
from benchmarks.engine_speed.rounds import progress_bar, run_rounds
from benchmarks.engine_speed.worker import Job, JobRunner
from benchmarks.schedule_memory.run import memory_table
from benchmarks.schedule_speed.analysis import Bubble, bubble, per_process
from benchmarks.schedule_speed.report import Refusal, Report, write_docs
from benchmarks.schedule_speed.steps import (
    SCHEDULE_NAMES,
    Model,
    ScheduleJob,
    engine_runs,
    schedule_job,
    torch_refusal,
)
from lightning_gpipe.engine.timeline import Timeline
from tools.launch import JobError, Launcher

__all__ = ["FULL", "QUICK", "TINY", "Plan", "main"]

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "benchmarks" / "schedules.md"
IMAGES = REPO / "docs" / "img"


@dataclass(frozen=True)
class Plan:
    """How much to measure: rounds, K, M, steps per window, the model, and the time and load limits."""

    rounds: int
    min_rounds: int  # always run; further rounds only while the time budget allows
    processes: tuple[int, ...]
    chunks: int
    steps: tuple[int, int]  # warm-up (the first counts activations), timed
    budget_seconds: float
    model: Model = Model()
    memory_chunks: tuple[int, ...] = (4, 16)  # M of the 1F1B-against-fill-drain memory table (threads, exact)
    variants: bool = True  # our compiled and variable-length zero-bubble steps
    foreign_threshold: float = 0.15  # cores
    max_retries: int = 1
    max_quiet_wait: float = 10.0
    job_timeout: float = 240.0

    def schedules(self) -> list[str]:
        """The schedules both engines run; the others' rows say why they are missing."""
        return [schedule for schedule in SCHEDULE_NAMES if engine_runs(schedule)]

    def round_jobs(self) -> list[Job]:
        """One round: per K and schedule, ours then torch's next to it, and our variants next to our zero bubble."""
        jobs: list[Job] = []
        for K in self.processes:
            for schedule in self.schedules():
                jobs += [self.job(schedule, engine, K) for engine in ("ours", "torch")]
                if schedule == "zero_bubble" and self.variants:
                    jobs += [self.job(schedule, "ours", K, variant) for variant in ("compiled", "varlen")]
        return jobs

    def job(self, schedule: str, engine: str, K: int, variant: str = "", timeline: bool = False) -> ScheduleJob:
        return schedule_job(schedule, engine, K, self.chunks, self.steps, variant, self.model, timeline)


# A round is 24 windows of 1 + 4 steps, 2-4 minutes on 2 loaded cores: the budget fits 3-4 rounds there, more where
# every process has a core. Waiting long for a quiet machine does not pay where other work runs for minutes.
FULL = Plan(rounds=8, min_rounds=3, processes=(2, 4), chunks=8, steps=(1, 4), budget_seconds=600, max_quiet_wait=4.0)
QUICK = Plan(rounds=2, min_rounds=2, processes=(2, 4), chunks=8, steps=(1, 3), budget_seconds=200, variants=False)
TINY = Plan(
    rounds=1,
    min_rounds=1,
    processes=(2, 4),
    chunks=4,
    steps=(1, 1),
    budget_seconds=60,
    model=Model(layers=8, width=16, heads=2, batch=8, tokens=8),
    memory_chunks=(4,),
    foreign_threshold=float("inf"),  # it checks that everything runs: no window waits for a quiet machine
    max_quiet_wait=0.0,
)


def _step_guess(job: Job) -> float:
    assert isinstance(job, ScheduleJob)
    scale = job.model.width * job.model.batch * job.model.tokens * job.model.layers / (128 * 16 * 64 * 8)
    return 0.3 * scale + (20.0 if job.variant == "compiled" else 0.0) / max(job.warmup_steps + job.timed_steps, 1)


def _timelines(plan: Plan, runner: JobRunner, console: Console) -> dict[tuple[str, int], tuple[Timeline, Bubble]]:
    """One recorded step of ours per schedule and K (the median makespan of a few), and its bubble."""
    found = {}
    for K in plan.processes:
        for schedule in plan.schedules():
            job = plan.job(schedule, "ours", K, timeline=True)
            job = dataclasses.replace(job, timed_steps=max(job.timed_steps, 3))
            console.log(f"timeline of {job}")
            result = runner.run(job, plan.job_timeout)
            timelines = [Timeline.from_records(records) for records in result.timelines]
            makespans = [t.makespan() for t in timelines]
            timeline = timelines[makespans.index(statistics.median_low(makespans))]
            found[schedule, K] = (timeline, bubble(timeline, schedule, K, plan.chunks))
    return found


def _refusals(plan: Plan, console: Console) -> list[Refusal]:
    """What torch does with our variants: compiled stages under its zero-bubble schedule, and a longer sequence."""
    found = []
    K = plan.processes[0]
    with Launcher(["torch", "torch.distributed.pipelining", __name__]) as launcher:
        for variant in ("compiled", "varlen"):
            console.log(f"torch's zero_bubble with {variant} stages")
            try:
                outcomes = launcher.run(
                    torch_refusal, ("zero_bubble", variant, plan.model, plan.chunks), K, plan.job_timeout, label=variant
                )
                outcome = next((o for o in outcomes if o != "ran"), "ran")
            except JobError as error:  # a rank died: gloo aborts the process on a message of the wrong size
                outcome = "a rank died: " + str(error).strip().splitlines()[-1]
            found.append(Refusal(variant, K, outcome))
    return found


def _profile(plan: Plan, schedules: Sequence[str], directory: pathlib.Path, console: Console) -> None:
    """cProfile each process of both engines under each of ``schedules`` at the largest K; print the top functions."""
    directory.mkdir(parents=True, exist_ok=True)
    K = max(plan.processes)
    with JobRunner(observer_pid=os.getpid(), preload=[__name__]) as runner:
        for schedule in schedules:
            for engine in ("ours", "torch"):
                job = dataclasses.replace(plan.job(schedule, engine, K), profile_dir=str(directory))
                (directory / schedule).mkdir(exist_ok=True)  # the worker names its files after the job's workload
                console.log(f"profiling {job}")
                result = runner.run(job, plan.job_timeout)
                cpu = " / ".join(f"{c * 1e3:.1f}" for c in result.cpu_seconds_per_step)
                print(f"\n### {job}: step {statistics.median(result.step_seconds) * 1e3:.1f} ms, CPU per step {cpu} ms")
                for rank in range(K):
                    path = directory / f"{job.workload}-{job.config}-M{job.chunks}-rank{rank}.pstats"
                    print(f"\n#### rank {rank}")
                    pstats.Stats(str(path), stream=sys.stdout).sort_stats("tottime").print_stats(12)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.schedule_speed.run",
        description="Our pipeline schedules against torch.distributed.pipelining's, K = 2 and 4 CPU processes.",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="2 rounds, no variants, ~4 min; leaves the docs alone")
    mode.add_argument("--tiny", action="store_true", help="a tiny model, 1 round: checks that everything runs")
    parser.add_argument("--rounds", type=int, help="override the number of rounds")
    parser.add_argument("--budget", type=float, metavar="SECONDS", help="override the rounds' time budget")
    parser.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks/schedules.md and charts")
    parser.add_argument(
        "--profile",
        type=pathlib.Path,
        metavar="DIR",
        help="instead of benchmarking, cProfile both engines under --schedules at the largest K into DIR",
    )
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULE_NAMES), help="the schedules --profile runs")
    parser.add_argument("--docs", type=pathlib.Path, help="write the page (and charts beside it) here instead")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse(argv)
    # `kill` (SIGTERM) unwinds like Ctrl-C, so that the launcher still stops every worker it started.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    plan = TINY if args.tiny else QUICK if args.quick else FULL
    if args.rounds is not None:
        plan = dataclasses.replace(plan, rounds=args.rounds, min_rounds=min(plan.min_rounds, args.rounds))
    if args.profile is not None:
        _profile(plan, args.schedules, args.profile, Console(stderr=True))
        return 0
    if args.budget is not None:
        plan = dataclasses.replace(plan, budget_seconds=args.budget)
    console = Console(stderr=True)
    jobs = plan.round_jobs()
    # The compiled step's graphs, cached for this run's later windows; none from an earlier torch or checkout.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="schedule-speed-inductor-")
    with progress_bar(console) as progress, JobRunner(observer_pid=os.getpid(), preload=[__name__]) as runner:
        task = progress.add_task("starting the worker server (imports torch once)", total=plan.rounds * len(jobs))
        measurements = run_rounds(plan, jobs, runner, progress, task, _step_guess)
        progress.update(task, description="one recorded step of ours per schedule")
        timelines = _timelines(plan, runner, progress.console)
    refusals = _refusals(plan, console) if plan.variants or args.tiny else []
    console.log("peak activations of 1F1B against fill-drain (threads, exact)")
    memory = memory_table(plan.memory_chunks)
    report = Report(plan.model, plan.processes, plan.chunks, plan.schedules(), Results(measurements), timelines)
    print(report.markdown(refusals, memory))
    docs = args.docs or (None if args.quick or args.no_docs else DOCS)
    if docs is not None:
        images = docs.parent if args.docs else IMAGES
        charts = []
        for (schedule, K), (timeline, found) in timelines.items():
            if max(plan.processes) != K:  # the deepest pipeline's charts only
                continue
            chart = images / f"schedule_speed_{schedule}.png"
            per_process(timeline, schedule, K).plot(
                chart,
                title=f"ours, {schedule}, K = {K} processes, M = {plan.chunks}",
                expected_bubble=found.formula,
                row_label="process",
            )
            charts.append((schedule, chart))
        command = " ".join(["python -m benchmarks.schedule_speed.run", *argv])
        write_docs(docs, report, refusals, memory, charts, command)
        console.print(f"wrote {docs}")
    shutil.rmtree(os.environ.pop("TORCHINDUCTOR_CACHE_DIR"), ignore_errors=True)
    print(report.headline())  # last, for scripts
    return 0


if __name__ == "__main__":
    sys.exit(main())
