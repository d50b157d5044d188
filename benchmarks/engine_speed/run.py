"""Engine throughput benchmark: interleaved rounds of fresh processes, then the tables, the headline line and docs.

Usage: ``python -m benchmarks.engine_speed.run [--quick]`` (see this folder's README).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import pstats
import signal
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console

from benchmarks.engine_speed.report import markdown_tables, write_docs
from benchmarks.engine_speed.results import Results, headline
from benchmarks.engine_speed.rounds import progress_bar, run_rounds
from benchmarks.engine_speed.worker import Job, JobResult, JobRunner
from benchmarks.engine_speed.workloads import K
from lightning_gpipe.engine.schedule import bubble_fraction
from lightning_gpipe.engine.timeline import Timeline

__all__ = ["Plan", "main"]

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "benchmarks" / "engine.md"
TIMELINE_PNG = REPO / "docs" / "img" / "engine_timeline.png"
TIMELINE_CHUNKS = 8
SMALL_CHUNKS = 16


@dataclass(frozen=True)
class Plan:
    """How much to measure: rounds, micro-batch counts, steps per window, and the time and load limits."""

    rounds: int
    min_rounds: int  # always run; further rounds only while the time budget allows
    chunks: tuple[int, ...]
    transformer_steps: tuple[int, int]  # warm-up, timed
    small_steps: tuple[int, int]
    budget_seconds: float
    foreign_threshold: float = 0.15  # cores; jiffy resolution and kernel threads stay well below this
    max_retries: int = 2
    max_quiet_wait: float = 20.0
    job_timeout: float = 180.0

    def round_jobs(self) -> list[Job]:
        """One round, A B C ... in a fixed order; each M's pipelines run next to their accumulation reference."""

        def transformer(config: str, chunks: int) -> Job:
            return Job("transformer", config, chunks, *self.transformer_steps)

        def small(config: str, chunks: int) -> Job:
            return Job("small", config, chunks, *self.small_steps)

        jobs = [transformer("unpipelined", 1), transformer("two_threads", 1)]
        for chunks in self.chunks:
            if chunks > 1:  # 1-way accumulation is the unpipelined step
                jobs.append(transformer("accumulation", chunks))
            jobs += [transformer("ours", chunks), transformer("torch_pipelining", chunks)]
            if chunks == METADATA_CHUNKS:  # the cost of per-micro-batch shapes, next to the step it is compared with
                jobs.append(transformer("ours_described", chunks))
        jobs += [small("unpipelined", 1), small("accumulation", SMALL_CHUNKS), small("two_threads", 1)]
        jobs += [small("ours", SMALL_CHUNKS), small("ours_described", SMALL_CHUNKS)]
        jobs += [small("torch_pipelining", SMALL_CHUNKS)]
        return jobs


METADATA_CHUNKS = 8


# Step counts keep a full round near 100 s on this machine, so that 6 rounds fit the ~11 min budget: more, shorter
# rounds average out the VM's speed drift better than fewer, longer windows.
FULL = Plan(
    rounds=6, min_rounds=4, chunks=(1, 2, 4, 8, 16), transformer_steps=(1, 5), small_steps=(20, 100), budget_seconds=660
)
QUICK = Plan(rounds=3, min_rounds=2, chunks=(1, 8), transformer_steps=(1, 4), small_steps=(20, 80), budget_seconds=170)


def _step_guess(job: Job) -> float:
    # Before a job has run once: ~0.5 s per Transformer step, ~10 ms per small one.
    return {"transformer": 0.5, "small": 0.01}[job.workload]


def _record_timeline(launcher: JobRunner) -> tuple[Timeline, JobResult]:
    """One `ours` step at M = 8 per stage, recorded; the step with the median makespan of a few is kept."""
    job = Job("transformer", "ours", TIMELINE_CHUNKS, 2, 3, record_timeline=True)
    result = launcher.run(job, FULL.job_timeout)
    timelines = [Timeline.from_records(records) for records in result.timelines]
    makespans = [t.makespan() for t in timelines]
    return timelines[makespans.index(statistics.median_low(makespans))], result


def _profile(launcher: JobRunner, directory: pathlib.Path, console: Console) -> None:
    """cProfile each rank of both pipelines on both workloads and print where their time goes."""
    directory.mkdir(parents=True, exist_ok=True)
    for job in (
        Job("transformer", "ours", TIMELINE_CHUNKS, *FULL.transformer_steps, profile_dir=str(directory)),
        Job("transformer", "torch_pipelining", TIMELINE_CHUNKS, *FULL.transformer_steps, profile_dir=str(directory)),
        Job("small", "ours", SMALL_CHUNKS, *FULL.small_steps, profile_dir=str(directory)),
        Job("small", "torch_pipelining", SMALL_CHUNKS, *FULL.small_steps, profile_dir=str(directory)),
    ):
        console.log(f"profiling {job}")
        result = launcher.run(job, FULL.job_timeout)
        cpu = " / ".join(f"{c * 1e3:.1f}" for c in result.cpu_seconds_per_step)
        print(
            f"\n### {job}: step {statistics.median(result.step_seconds) * 1e3:.1f} ms, CPU per step {cpu} ms, "
            f"foreign load {result.foreign_cores:.2f} cores"
        )
        for rank in range(job.world_size):
            path = directory / f"{job.workload}-{job.config}-M{job.chunks}-rank{rank}.pstats"
            print(f"\n#### rank {rank} ({path})")
            pstats.Stats(str(path), stream=sys.stdout).sort_stats("tottime").print_stats(15)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.engine_speed.run",
        description="Throughput of lightning_gpipe against torch.distributed.pipelining, K = 2 processes.",
    )
    parser.add_argument("--quick", action="store_true", help="3 rounds, M in {1, 8}, ~2-3 min; leaves the docs alone")
    parser.add_argument("--rounds", type=int, help="override the number of rounds")
    parser.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks/engine.md and the chart")
    parser.add_argument(
        "--profile",
        type=pathlib.Path,
        metavar="DIR",
        help="instead of benchmarking, cProfile both pipelines on both workloads into DIR and print the top functions",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse(argv)
    # `kill` (SIGTERM) unwinds like Ctrl-C, so that the launcher still stops every worker it started.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.profile is not None:
        with JobRunner(observer_pid=os.getpid()) as launcher:
            _profile(launcher, args.profile, Console(stderr=True))
        return 0
    plan = QUICK if args.quick else FULL
    if args.rounds is not None:
        plan = dataclasses.replace(plan, rounds=args.rounds, min_rounds=min(plan.min_rounds, args.rounds))
    console = Console(stderr=True)
    with progress_bar(console) as progress, JobRunner(observer_pid=os.getpid()) as launcher:
        jobs = plan.round_jobs()
        total = plan.rounds * len(jobs) + 1
        task = progress.add_task("starting the worker server (imports torch once)", total=total)
        measurements = run_rounds(plan, jobs, launcher, progress, task, _step_guess)
        progress.update(task, description=f"timeline of one `ours` step, M = {TIMELINE_CHUNKS}")
        timeline, timeline_result = _record_timeline(launcher)
        progress.update(task, completed=total)

    results = Results(measurements)
    goals = headline(results, TIMELINE_CHUNKS, SMALL_CHUNKS)
    expected = bubble_fraction(K, TIMELINE_CHUNKS)
    tables = markdown_tables(results, plan.chunks, SMALL_CHUNKS)
    if not (args.quick or args.no_docs):
        timeline.plot(
            TIMELINE_PNG,
            title=f"One `ours` step, Transformer workload, K = {K}, M = {TIMELINE_CHUNKS}, checkpoint='never'",
            expected_bubble=expected,
        )
        command = " ".join(["python -m benchmarks.engine_speed.run", *argv])
        write_docs(DOCS, TIMELINE_PNG, tables, goals, timeline, timeline_result, expected, command)
        console.print(f"wrote {DOCS.relative_to(REPO)} and {TIMELINE_PNG.relative_to(REPO)}")
    print(tables)
    print()
    print("\n".join(goals.verdicts()))
    print(
        f"Timeline of one ours step at M = {TIMELINE_CHUNKS}: measured bubble {timeline.bubble_fraction():.1%}, "
        f"expected (K-1)/(M+K-1) = {expected:.1%}"
    )
    print(goals.line())  # last, for scripts: ratio_vs_torch_pipelining=R ...
    return 0


if __name__ == "__main__":
    sys.exit(main())
