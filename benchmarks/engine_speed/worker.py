"""One measurement in a fresh rank: warm-up, timed steps, CPU and load accounting.

The orchestrator runs :func:`measure_rank` once per rank of a :class:`Job`. Rank 0 reports a :class:`JobResult`, the
other ranks ``None``; a rank that fails reports its traceback.
"""

from __future__ import annotations

import cProfile
import os
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch.distributed as dist

from benchmarks.engine_speed.cpuload import foreign_cores, snapshot
from benchmarks.engine_speed.workloads import PIPELINED, WORKLOADS, Step, build_step
from lightning_gpipe.engine.timeline import SpanRecord, Timeline
from tools.launch import Launcher

__all__ = ["Job", "JobResult", "JobRunner", "measure_rank"]


@dataclass(frozen=True)
class Job:
    """One configuration of one workload at ``chunks`` micro-batches, timed over ``timed_steps`` steps.

    Other benchmarks measure their own steps with this worker by subclassing it (a frozen dataclass too) and
    overriding :meth:`build_step`, :attr:`world_size` and :attr:`threads`; ``benchmarks/zoo_throughput`` does.
    """

    workload: str
    config: str
    chunks: int
    warmup_steps: int
    timed_steps: int
    record_timeline: bool = False
    profile_dir: str | None = None  # cProfile the timed steps of every rank into this folder

    @property
    def world_size(self) -> int:
        return 2 if self.config in PIPELINED else 1

    @property
    def threads(self) -> int:
        return 2 if self.config == "two_threads" else 1

    def __str__(self) -> str:
        return f"{self.workload}/{self.config}/M={self.chunks}"

    def build_step(self, rank: int, timeline: Timeline | None) -> Step:
        """This process's training step (built inside the worker, after the process group is up)."""
        return build_step(WORKLOADS[self.workload], self.config, self.chunks, rank, timeline)


@dataclass
class JobResult:
    """Per-step times (seconds, a step ends when its last process is done), and the load of the timed window."""

    step_seconds: list[float]
    window_seconds: float
    foreign_cores: float
    own_cores: float
    memory_growth_mib: float  # peak RSS during training minus RSS before the first step, max over processes
    cpu_seconds_per_step: list[float]  # per process: CPU time (all its threads) per timed step, robust to load
    timelines: list[list[SpanRecord]] = field(default_factory=list)  # one per timed step, all stages merged
    reports: list[Any] = field(default_factory=list)  # per process: what its step measured (``step.report()``)


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _gather(value: Any, world_size: int) -> list[Any]:
    if world_size == 1:
        return [value]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, value)
    return gathered


def _measure(job: Job, rank: int, observer_pid: int) -> JobResult | None:
    world_size = job.world_size
    timeline = Timeline() if job.record_timeline else None
    step = job.build_step(rank, timeline)
    pids = _gather(os.getpid(), world_size) + [observer_pid]  # the orchestrator's progress display is ours too
    rss_before = _rss_mib()
    for _ in range(job.warmup_steps):
        step()
    if world_size > 1:
        dist.barrier()
    start = snapshot(pids) if rank == 0 else None
    profiler = cProfile.Profile() if job.profile_dir is not None else None
    origin = time.perf_counter()
    cpu_origin = time.process_time()
    ends: list[float] = []
    records: list[list[SpanRecord]] = []
    if profiler is not None:
        profiler.enable()
    for _ in range(job.timed_steps):
        if timeline is not None:
            timeline.clear()
        step()
        ends.append(time.perf_counter())
        if timeline is not None:
            records.append(timeline.to_records())
    if profiler is not None:
        profiler.disable()
        assert job.profile_dir is not None
        profiler.dump_stats(
            os.path.join(job.profile_dir, f"{job.workload}-{job.config}-M{job.chunks}-rank{rank}.pstats")
        )
    cpu_per_step = (time.process_time() - cpu_origin) / job.timed_steps
    if world_size > 1:
        dist.barrier()
    end = snapshot(pids) if rank == 0 else None
    # perf_counter is CLOCK_MONOTONIC, shared by the processes of one host: a step ends when its last stage does.
    all_ends = _gather(ends, world_size)
    all_records = _gather(records, world_size)
    growth = max(_gather(_peak_rss_mib() - rss_before, world_size))
    cpu = _gather(cpu_per_step, world_size)
    report = getattr(step, "report", None)  # a step may carry its own measurement, e.g. of memory
    reports = _gather(report() if report is not None else None, world_size)
    if rank != 0:
        return None
    assert start is not None
    assert end is not None
    step_ends = [max(stage_ends[n] for stage_ends in all_ends) for n in range(job.timed_steps)]
    boundaries = [origin, *step_ends]
    return JobResult(
        step_seconds=[b - a for a, b in zip(boundaries, boundaries[1:], strict=False)],
        window_seconds=end.wall - start.wall,
        foreign_cores=foreign_cores(start, end),
        own_cores=(end.own - start.own) / max(end.wall - start.wall, 1e-9),
        memory_growth_mib=growth,
        cpu_seconds_per_step=cpu,
        timelines=[sorted(sum((stage[n] for stage in all_records), [])) for n in range(len(records))],
        reports=reports,
    )


def measure_rank(rank: int, world_size: int, job: Job, observer_pid: int) -> JobResult | None:
    """What rank ``rank`` of ``job`` runs in its fresh process (see :class:`JobRunner`)."""
    assert world_size == job.world_size
    return _measure(job, rank, observer_pid)


_PRELOAD = ["torch", "torch.distributed.pipelining", "lightning_gpipe.engine.pipeline", __name__]


class JobRunner:
    """Runs this benchmark's jobs, each in fresh ranks (:class:`tools.launch.Launcher`); a context manager.

    ``observer_pid`` is the orchestrator's process, whose CPU time counts as the benchmark's own in the load
    measurement; ``preload``: further modules the server imports once, e.g. the module that defines the jobs.
    """

    def __init__(self, observer_pid: int, preload: Sequence[str] = ()) -> None:
        self._launcher = Launcher([*_PRELOAD, *preload])
        self._observer_pid = observer_pid

    def __enter__(self) -> JobRunner:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._launcher.__exit__(exc_type, exc, tb)

    def run(self, job: Job, timeout: float) -> JobResult:
        """Run ``job`` once; :class:`tools.launch.JobError` on an error, a dead rank or after ``timeout``."""
        results = self._launcher.run(
            measure_rank, (job, self._observer_pid), job.world_size, timeout, threads=job.threads, label=str(job)
        )
        result = results[0]
        assert result is not None
        return result
