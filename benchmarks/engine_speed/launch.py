"""Runs a throughput `Job` of this benchmark in fresh ranks, through the shared `benchmarks.launch`."""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

from benchmarks import launch
from benchmarks.engine_speed.worker import Job, JobResult, measure_rank
from benchmarks.launch import JobError, JobTimeoutError

__all__ = ["JobError", "JobTimeoutError", "Launcher"]

_PRELOAD = [
    "torch",
    "torch.distributed.pipelining",
    "lightning_gpipe.engine.pipeline",
    "benchmarks.engine_speed.worker",
]


class Launcher:
    """Runs jobs in fresh processes; use as a context manager so that nothing outlives the benchmark.

    ``observer_pid`` is the orchestrator's process, whose CPU time counts as the benchmark's own in the load
    measurement; ``preload``: further modules the server imports once, e.g. the module that defines the jobs.
    """

    def __init__(self, observer_pid: int, preload: Sequence[str] = ()) -> None:
        self._ranks = launch.Launcher([*_PRELOAD, *preload])
        self._observer_pid = observer_pid

    def __enter__(self) -> Launcher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._ranks.__exit__(exc_type, exc, tb)

    def run(self, job: Job, timeout: float) -> JobResult:
        """Run ``job`` once; raises :class:`JobError` on an error, a dead rank or after ``timeout`` seconds."""
        results = self._ranks.run(
            measure_rank, (job, self._observer_pid), job.world_size, timeout, threads=job.threads, label=str(job)
        )
        result = results[0]
        assert result is not None
        return result
