"""Fresh ranks for every measurement, forked from a server that has the heavy imports done, each job with a deadline.

Importing torch, torch.distributed.pipelining, Lightning and the zoo takes 5-20 s of CPU on the 2-core machines,
longer than most measurements. A forkserver pays that once; each job's ranks are forked from the clean server, so they
are fresh processes (own interpreter state, allocator, thread pools and process group) that start in a fraction of a
second. A job whose ranks raise, die or miss the deadline is stopped: every rank this launcher started is killed by
its own handle, and the forkserver goes when the launcher is closed. Every benchmark that runs ranks uses this one.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

__all__ = ["JobError", "JobTimeoutError", "Launcher", "RankFn", "free_port", "importing_package_from"]

RankFn = Callable[..., Any]
"""What a rank runs: ``fn(rank, world_size, *args)``; with ``world_size > 1`` a gloo group on loopback is up."""

_PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=60)


class JobError(RuntimeError):
    """A rank of a job raised, died or missed the deadline; the message carries its traceback or exit code."""


class JobTimeoutError(JobError):
    """A rank of a job missed the deadline (on a heavily loaded machine a slow window does; no bug needed)."""


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now, for a job's process group."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def importing_package_from(checkout: str | None) -> tuple[str, dict[str, str]]:
    """The working directory and environment of a ``python -m benchmarks...`` subprocess that imports
    ``lightning_gpipe`` from ``checkout`` (``None``: this repository) and everything else from this repository.

    ``-m`` puts the working directory first on ``sys.path``, before ``PYTHONPATH``: started from this repository, the
    subprocess would import this repository's package whatever ``PYTHONPATH`` says. It starts instead in a directory
    holding only a link to the checkout's package, with this repository on ``PYTHONPATH`` for the rest.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if checkout is None:
        return root, env
    shadow = tempfile.mkdtemp(prefix="baseline-")
    os.symlink(os.path.join(os.path.abspath(checkout), "lightning_gpipe"), os.path.join(shadow, "lightning_gpipe"))
    env["PYTHONPATH"] = os.pathsep.join(path for path in (root, env.get("PYTHONPATH")) if path)
    return shadow, env


def _rank_main(
    fn: RankFn, args: tuple[Any, ...], rank: int, world_size: int, threads: int, port: int, tag: int, out: Any
) -> None:
    """Entry point of one rank; reports ``(tag, rank, status, value)`` to ``out`` and never raises.

    ``tag`` identifies the attempt, so that a late message from a killed attempt is not taken for a newer one's.
    """
    import torch  # here: the orchestrator that starts the ranks never needs torch itself
    import torch.distributed as dist

    try:
        # Before any torch work: the inter-op pool can be sized only once, before it starts.
        torch.set_num_threads(threads)
        torch.set_num_interop_threads(1)
        if world_size > 1:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only: nothing of a benchmark leaves the host
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=_PROCESS_GROUP_TIMEOUT,
            )
        try:
            value = fn(rank, world_size, *args)
        finally:
            if world_size > 1:
                dist.destroy_process_group()
        out.put((tag, rank, "ok", value))
    except BaseException:
        out.put((tag, rank, "error", traceback.format_exc()))


class Launcher:
    """Runs jobs of ``world_size`` ranks in fresh processes; a context manager, so that nothing outlives it.

    Args:
        preload: modules the forkserver imports once (the rank function's module among them).
    """

    def __init__(self, preload: Sequence[str]) -> None:
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(list(preload))
        self._results = self._context.Queue()
        self._tag = 0
        self._processes: list[multiprocessing.process.BaseProcess] = []

    def __enter__(self) -> Launcher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop_all()
        self._results.close()

    def run(
        self,
        fn: RankFn,
        args: tuple[Any, ...],
        world_size: int,
        timeout: float,
        *,
        threads: int = 1,
        label: str = "job",
    ) -> list[Any]:
        """Every rank's return value of ``fn(rank, world_size, *args)``; :class:`JobError` on any failure.

        Each rank runs with ``threads`` intra-op threads and one inter-op thread; ``label`` names the job in errors.
        """
        self._tag += 1
        port = free_port() if world_size > 1 else 0
        self._processes = [
            self._context.Process(
                target=_rank_main,
                args=(fn, args, rank, world_size, threads, port, self._tag, self._results),
                name=f"bench-{label}-rank{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        try:
            for process in self._processes:
                process.start()
            return self._collect(world_size, timeout, label)
        finally:
            self._stop_all()

    def _collect(self, world_size: int, timeout: float, label: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        reported: dict[int, Any] = {}
        while len(reported) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise JobTimeoutError(
                    f"{label}: {world_size - len(reported)} rank(s) did not finish within {timeout:g} s"
                )
            try:
                tag, rank, status, value = self._results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                # A rank killed by the OS (out of memory, a segfault) never reports: notice it instead of waiting.
                dead = [p for p in self._processes if p.exitcode not in (None, 0)]
                if dead:
                    raise JobError(f"{label}: {dead[0].name} exited with code {dead[0].exitcode}") from None
                continue
            if tag != self._tag:
                continue  # a late message from an attempt that was already given up on
            if status == "error":
                raise JobError(f"{label}: rank {rank} failed:\n{value}")
            reported[rank] = value
        return [reported[rank] for rank in range(world_size)]

    def _stop_all(self) -> None:
        # Only the processes this launcher started, each by its own handle. One that failed to start (its function
        # or arguments do not pickle) has no process to join: joining it would hide the error that stopped it.
        for process in self._processes:
            if process.pid is None:
                continue
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        self._processes = []
