"""Fresh worker processes for every measurement, forked from a server that has torch imported, with a deadline.

Importing torch and torch.distributed.pipelining takes 5-12 s on the 2-core machines, longer than most measurements.
A forkserver pays it once: each job's ranks are forked from that clean server, so they are fresh processes (own
interpreter state, allocator, thread pools and process group) that start in a fraction of a second.
"""

from __future__ import annotations

import multiprocessing
import queue
import socket
import time
from collections.abc import Sequence
from types import TracebackType

from benchmarks.engine_speed.worker import Job, JobResult, run_worker

__all__ = ["JobError", "JobTimeoutError", "Launcher"]

_PRELOAD = [
    "torch",
    "torch.distributed.pipelining",
    "lightning_gpipe.pipeline",
    "benchmarks.engine_speed.worker",
]


class JobError(RuntimeError):
    """A rank of a job raised, died or missed the deadline; the message carries its traceback or exit code."""


class JobTimeoutError(JobError):
    """A rank of a job missed the deadline (on a heavily loaded machine a slow window does; no bug needed)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Launcher:
    """Runs jobs in fresh processes; use as a context manager so that nothing outlives the benchmark.

    ``preload``: further modules the server imports once, e.g. the module that defines the benchmark's jobs.
    """

    def __init__(self, observer_pid: int, preload: Sequence[str] = ()) -> None:
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload([*_PRELOAD, *preload])
        self._results = self._context.Queue()
        self._observer_pid = observer_pid
        self._tag = 0
        self._processes: list[multiprocessing.process.BaseProcess] = []

    def __enter__(self) -> Launcher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._stop_all()
        self._results.close()

    def run(self, job: Job, timeout: float) -> JobResult:
        """Run ``job`` once; raises :class:`JobError` on an error, a dead rank or after ``timeout`` seconds."""
        self._tag += 1
        port = _free_port()
        self._processes = [
            self._context.Process(
                target=run_worker,
                args=(job, rank, port, self._observer_pid, self._tag, self._results),
                name=f"bench-{job.config}-rank{rank}",
                daemon=True,
            )
            for rank in range(job.world_size)
        ]
        try:
            for process in self._processes:
                process.start()
            return self._collect(job, timeout)
        finally:
            self._stop_all()

    def _collect(self, job: Job, timeout: float) -> JobResult:
        deadline = time.monotonic() + timeout
        reported: dict[int, JobResult | None] = {}
        while len(reported) < job.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise JobTimeoutError(
                    f"{job}: {job.world_size - len(reported)} rank(s) did not finish within {timeout:g} s"
                )
            try:
                tag, rank, status, value = self._results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                # A rank killed by the OS (out of memory, a segfault) never reports: notice it instead of waiting.
                dead = [p for p in self._processes if p.exitcode not in (None, 0)]
                if dead:
                    raise JobError(f"{job}: {dead[0].name} exited with code {dead[0].exitcode}") from None
                continue
            if tag != self._tag:
                continue  # a late message from an attempt that was already given up on
            if status == "error":
                raise JobError(f"{job}: rank {rank} failed:\n{value}")
            reported[rank] = value
        result = reported[0]
        assert result is not None
        return result

    def _stop_all(self) -> None:
        # Only the processes this launcher started, each by its own handle.
        for process in self._processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        self._processes = []
