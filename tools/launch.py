"""Starts the ranks of a job, for the benchmarks and the tests alike, under one policy.

Three ways to start ranks:

- **function ranks**: :class:`Launcher` (or :func:`run_processes` for one job) calls ``fn(rank, world_size, *args)``
  in fresh processes forked from a server that has the heavy imports done, with ``MASTER_ADDR``/``MASTER_PORT``,
  ``RANK`` and ``WORLD_SIZE`` set and a gloo group up; the return values come back in rank order;
- **script ranks**: :func:`run_job` runs ``python -m module`` once per rank with torchrun's environment
  (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), on one "node" or
  on several that share this host;
- **Lightning's own launch**: :func:`launch` runs ``python -m module`` once; its Trainer starts the other ranks.

:func:`run_command` and :func:`run_module` run one command (a CLI, a benchmark) the same way. The policy: every launch
has a deadline; a rank that fails or dies ends the others promptly (a function rank's traceback is raised, a script
rank's output returned; a script rank's peers get ``grace`` seconds to report the failure themselves); and nothing
outlives the launch: the ranks are killed by their handles, and a script's or command's whole process group (its own
session) at the end.

Nothing a job starts listens beyond the loopback interface. torch's TCPStore server binds every interface whatever
``MASTER_ADDR`` says, so the launching process hosts the store itself on a socket bound to 127.0.0.1 (TCPStore's
``master_listen_fd``) and every rank joins it as a client (``TORCHELASTIC_USE_AGENT_STORE=True``, how torchrun's agent
hosts it); gloo's own sockets bind the interface named by ``GLOO_SOCKET_IFNAME=lo``.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

__all__ = [
    "JobError",
    "JobTimeoutError",
    "Launcher",
    "RankFn",
    "importing_package_from",
    "launch",
    "loopback_store",
    "run_command",
    "run_job",
    "run_module",
    "run_processes",
]

RankFn = Callable[..., Any]
"""What a function rank runs: ``fn(rank, world_size, *args)``; with ``world_size > 1`` a gloo group is up."""

_PRELOAD = ("torch", "lightning")  # imported once by the server every function rank is forked from
_STORE_TIMEOUT = datetime.timedelta(seconds=60)
_SETTLE = 1.0  # seconds to gather the other ranks' failures after the first, to name the one that caused them


class JobError(RuntimeError):
    """A rank of a job raised, died or missed the deadline; the message carries its traceback or exit code."""


class JobTimeoutError(JobError, TimeoutError):
    """A rank of a job missed the deadline (on a heavily loaded machine a slow window does; no bug needed)."""


@contextlib.contextmanager
def loopback_store() -> Iterator[dict[str, str]]:
    """Host a TCPStore on 127.0.0.1 for the ranks of one job; yields the environment that makes them use it."""
    import torch.distributed as dist  # here: a launcher of single-rank jobs never needs torch itself

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = int(listener.getsockname()[1])
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=_STORE_TIMEOUT,
        master_listen_fd=listener.detach(),  # the store owns the descriptor from here on
    )
    try:
        yield {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "GLOO_SOCKET_IFNAME": "lo",
        }
    finally:
        del store


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


# ------------------------------------------------------------------------------------------------ function ranks


def _plain(value: Any) -> Any:
    """Tensors as NumPy arrays: torch's queue would share their memory, which dies with the exiting rank."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_plain(item) for item in value)
    return value


def _rank_env(rank: int, world_size: int, store_env: dict[str, str]) -> dict[str, str]:
    """A function rank's environment: this process's, and with a group the store's, ``RANK`` and ``WORLD_SIZE``."""
    if world_size == 1:
        return dict(os.environ)
    return {**os.environ, **store_env, "RANK": str(rank), "WORLD_SIZE": str(world_size)}


def _rank_main(
    fn: RankFn,
    args: tuple[Any, ...],
    rank: int,
    world_size: int,
    env: dict[str, str],
    threads: int,
    pg_timeout: float,
    out: Connection,
) -> None:
    """Entry point of one function rank; sends ``(status, value)`` through ``out`` and never raises.

    ``out`` is the write end of this rank's own pipe, which no other process holds: when the rank dies, even halfway
    through its message, the launcher reads the end of the pipe instead of waiting for the rest.
    """
    import torch  # here: a process that launches only single-rank jobs never imports torch
    import torch.distributed as dist

    try:
        os.environ.clear()  # the launching process's environment now, not the server's from when it started
        os.environ.update(env)
        # Before any torch work: the inter-op pool can be sized only once, before it starts.
        torch.set_num_threads(threads)
        torch.set_num_interop_threads(1)
        if world_size > 1:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{env['MASTER_PORT']}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=pg_timeout),
            )
        report: tuple[str, Any] = ("ok", _plain(fn(rank, world_size, *args)))
    except BaseException:
        # When: the launcher blames the rank that failed first (one clock for every process of this host).
        report = ("error", (time.monotonic(), traceback.format_exc()))
    try:
        # Sent in full before the group goes: its peers fail on the closed connection, and the cause should come first.
        try:
            out.send(report)
        except Exception:  # the value does not pickle (nothing was written: send pickles first)
            out.send(("error", (time.monotonic(), traceback.format_exc())))
    finally:
        out.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_description(code: int | None) -> str:
    """How a rank's process ended, for errors: ``exited with code -9 (SIGKILL)``."""
    if code is None:
        return "closed its results pipe while still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"exited with code {code} ({signal.Signals(-code).name})"
    return f"exited with code {code}"


class Launcher:
    """Runs jobs of function ranks in fresh processes; a context manager, so that no rank outlives it.

    The ranks are forked from a server (multiprocessing's ``forkserver``, one per launching process) that imports
    ``preload`` once, so each rank starts in a fraction of a second with its own interpreter state, allocator, thread
    pools and process group. The first launcher of a process decides what its server preloads. Each rank sends its
    result through a pipe of its own, so that a rank killed while sending wedges neither its job nor the next one.

    Args:
        preload: modules the server imports once (the rank function's module among them).
    """

    def __init__(self, preload: Sequence[str] = _PRELOAD) -> None:
        self._context = multiprocessing.get_context("forkserver")
        # Never empty: only with modules to preload does the server get this process's sys.path (tests' folders).
        self._context.set_forkserver_preload(list(preload) or ["os"])
        self._processes: list[multiprocessing.process.BaseProcess] = []

    def __enter__(self) -> Launcher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop_all(failed=exc_type is not None)

    def run(
        self,
        fn: RankFn,
        args: tuple[Any, ...],
        world_size: int,
        timeout: float,
        *,
        threads: int = 1,
        label: str = "job",
        pg_timeout: float = 60.0,
    ) -> list[Any]:
        """Every rank's return value of ``fn(rank, world_size, *args)``, tensors as NumPy arrays.

        Raises :class:`JobError` as soon as one rank raises or dies, with the failed rank's traceback or exit code
        (a rank that died is named before the peers that failed on its closed connections), and
        :class:`JobTimeoutError` after ``timeout`` seconds; every other rank is then killed. Each rank runs with
        ``threads`` intra-op threads and one inter-op thread; ``label`` names the job in errors; ``pg_timeout`` is
        the gloo group's timeout.
        """
        store: contextlib.AbstractContextManager[dict[str, str]] = (
            loopback_store() if world_size > 1 else contextlib.nullcontext({})
        )
        pipes = [self._context.Pipe(duplex=False) for _ in range(world_size)]
        with store as store_env:
            self._processes = [
                self._context.Process(
                    target=_rank_main,
                    args=(fn, args, rank, world_size, _rank_env(rank, world_size, store_env), threads, pg_timeout, out),
                    name=f"{label}-rank{rank}",
                    daemon=True,
                )
                for rank, (_, out) in enumerate(pipes)
            ]
            failed = True
            try:
                for process, (_, out) in zip(self._processes, pipes, strict=True):
                    process.start()
                    out.close()  # the rank holds the only write end now: its death reads as the end of its pipe
                results = self._collect([reader for reader, _ in pipes], timeout, label)
                failed = False
                return results
            finally:
                self._stop_all(failed)
                for reader, out in pipes:
                    reader.close()
                    out.close()

    def _collect(self, readers: list[Connection], timeout: float, label: str) -> list[Any]:
        """Every rank's result; after the first failure, the failures seen within ``_SETTLE`` seconds, as one error."""
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        errors: dict[int, tuple[float, str]] = {}  # rank: when it failed, its traceback
        deaths: dict[int, str] = {}  # rank: how its process ended, in the order noticed
        waiting = set(range(len(readers)))
        settled = deadline
        while waiting and time.monotonic() < settled:
            # A rank's pipe is ready when it sent its report or ended; its sentinel, when its process ended.
            handles: dict[Any, int] = {readers[rank]: rank for rank in waiting}
            handles.update({self._processes[rank].sentinel: rank for rank in waiting})
            for handle in multiprocessing.connection.wait(list(handles), timeout=settled - time.monotonic()):
                rank = handles[handle]
                if rank not in waiting:
                    continue  # both its pipe and its sentinel were ready
                waiting.discard(rank)
                status, value = self._report(rank, readers[rank])
                if status == "ok":
                    results[rank] = value
                    continue
                (errors if status == "error" else deaths)[rank] = value
                # The first failure: its peers' failures follow within moments, and the one to name is among them.
                settled = min(settled, time.monotonic() + _SETTLE)
        if deaths or errors:
            raise JobError(_failure(label, deaths, errors))
        if waiting:
            names = ", ".join(str(rank) for rank in sorted(waiting))
            raise JobTimeoutError(
                f"{label}: rank(s) {names} of {len(readers)} did not finish within {timeout:g} s; give the launch a "
                "longer timeout if the machine is merely slow"
            )
        return [results[rank] for rank in range(len(readers))]

    def _report(self, rank: int, reader: Connection) -> tuple[str, Any]:
        """Rank ``rank``'s ``(status, value)``: its own report, or ``("died", how)`` when it ended without one."""
        process = self._processes[rank]
        # A killed process may have left part of a message: read only what a living or cleanly ended rank sent.
        if process.exitcode in (None, 0) and reader.poll():
            with contextlib.suppress(EOFError, OSError):  # it died while sending
                return reader.recv()
        process.join(timeout=5)  # its pipe or its sentinel said it ended
        return "died", f"{process.name} {_exit_description(process.exitcode)} without reporting"

    def _stop_all(self, failed: bool) -> None:
        # Only the processes this launcher started, each by its own handle; after a failure the survivors would only
        # wait for the failed rank, so they are killed at once. One that failed to start (its function or arguments
        # do not pickle) has no process to join: joining it would hide the error that stopped it.
        for process in self._processes:
            if process.pid is None:
                continue
            if failed and process.is_alive():
                process.kill()
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        self._processes = []


def _failure(label: str, deaths: dict[int, str], errors: dict[int, tuple[float, str]]) -> str:
    """The message of a failed job: the rank to blame, then (one line each) the others that failed after it.

    A rank that died is blamed before one that raised: it could not report, and the peers waiting on it fail on its
    closed connections; among those that raised, the first to fail. The blamed rank's traceback or exit comes last,
    so that the message ends with its cause.
    """
    if deaths:
        rank = next(iter(deaths))
        cause = f"{label}: {deaths.pop(rank)}"
    else:
        rank = min(errors, key=lambda failed: errors[failed][0])
        cause = f"{label}: rank {rank} failed:\n{errors.pop(rank)[1]}"
    others = [f"rank {other} ({how})" for other, how in deaths.items()]
    others += [f"rank {other} ({error.strip().splitlines()[-1]})" for other, (_, error) in sorted(errors.items())]
    if not others:
        return cause
    return f"{label}: rank {rank} failed first; also failed: {'; '.join(others)}\n{cause}"


def run_processes(
    fn: RankFn, world_size: int, *args: Any, timeout: float = 120.0, pg_timeout: float = 60.0
) -> list[Any]:
    """One job of function ranks: ``fn(rank, world_size, *args)`` on each of ``world_size`` ranks (:class:`Launcher`).

    Returns the results in rank order, tensors as NumPy arrays; :class:`JobError` with the failing rank's traceback.
    """
    with Launcher() as launcher:
        return launcher.run(fn, args, world_size, timeout, label=getattr(fn, "__name__", "job"), pg_timeout=pg_timeout)


# -------------------------------------------------------------------------------------------------- script ranks


def run_job(
    module: str,
    args: Sequence[str],
    world_size: int,
    *,
    timeout: float = 300.0,
    cwd: str | Path | None = None,
    grace: float = 30.0,
    nodes: int = 1,
    elastic: bool = False,
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``python -m module *args`` as ``world_size`` ranks on 127.0.0.1 with torchrun's environment.

    ``nodes`` splits the ranks into that many "nodes" of ``world_size / nodes`` consecutive ranks, numbered as torchrun
    numbers them (``RANK = NODE_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK``), all on this host. ``elastic`` adds the
    variables torchrun's agent sets besides (``GROUP_RANK``, ``TORCHELASTIC_RUN_ID``, ...), which make Lightning take
    the job for a torchrun launch (its ``TorchElasticEnvironment``); without them it reads ``LOCAL_RANK`` and
    ``NODE_RANK`` (its ``LightningEnvironment``).

    Returns every rank's completed process, its stdout and stderr together in ``stdout``. When a rank fails, the
    others get ``grace`` seconds to end (and report the failure they see) before they are killed; at ``timeout`` every
    rank still running is killed (exit code ``-9``).
    """
    if nodes < 1 or world_size % nodes:
        raise ValueError(
            f"nodes={nodes} must be a positive divisor of world_size={world_size}: every node runs as many ranks"
        )
    with loopback_store() as store_env, tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        processes, files = [], []
        for rank in range(world_size):
            env = {**os.environ, **store_env, **_torchrun_env(rank, world_size, nodes, elastic)}
            files.append(open(Path(logs) / f"rank{rank}.log", "w+"))  # noqa: SIM115 - closed below
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", module, *args],
                    env=env,
                    cwd=cwd,
                    stdout=files[-1],
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,  # its own process group: one kill reaches what the rank started
                )
            )
        try:
            _supervise(processes, timeout, grace)
        finally:
            for process in processes:
                _kill_group(process.pid)
                process.wait()
        outputs = []
        for file in files:
            file.seek(0)
            outputs.append(file.read())
            file.close()
    return [
        subprocess.CompletedProcess(process.args, process.returncode, output, "")
        for process, output in zip(processes, outputs, strict=True)
    ]


def _torchrun_env(rank: int, world_size: int, nodes: int, elastic: bool) -> dict[str, str]:
    """The variables torchrun gives global rank ``rank`` of ``world_size`` on ``nodes`` nodes (less its store's)."""
    per_node = world_size // nodes
    node, local = divmod(rank, per_node)
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(local),
        "NODE_RANK": str(node),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(per_node),
        "OMP_NUM_THREADS": "1",
    }
    if elastic:  # what torch.distributed.elastic's LocalElasticAgent adds; TORCHELASTIC_RUN_ID is what Lightning reads
        env.update(
            GROUP_RANK=str(node),
            GROUP_WORLD_SIZE=str(nodes),
            ROLE_RANK=str(rank),
            ROLE_NAME="default",
            ROLE_WORLD_SIZE=str(world_size),
            TORCHELASTIC_RUN_ID="none",  # torchrun's default --rdzv-id
            TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_MAX_RESTARTS="0",
        )
    return env


def _supervise(processes: list[subprocess.Popen[str]], timeout: float, grace: float) -> None:
    """Wait until every process has ended, one has failed ``grace`` seconds ago, or ``timeout`` has passed."""
    deadline = time.monotonic() + timeout
    failed_at = None
    while time.monotonic() < deadline:
        codes = [process.poll() for process in processes]
        if all(code is not None for code in codes):
            return
        if failed_at is None and any(code not in (None, 0) for code in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace:
            return
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------- Lightning's launch


def launch(
    module: str, args: Sequence[str], *, timeout: float = 300.0, cwd: str | Path | None = None
) -> tuple[subprocess.CompletedProcess[str], float, int]:
    """Run ``python -m module *args`` as one process that Lightning's own launcher turns into the job's ranks.

    Returns the first process (global rank 0) with the output of every rank, the seconds until the last process of
    the job ended (every rank writes to the same pipe, which closes only when all have exited), and how many of the
    job's processes were still alive then and had to be killed (0 when the job ended by itself). On ``timeout``
    every process of the job is killed.
    """
    with loopback_store() as store_env:
        env = {key: value for key, value in os.environ.items() if key not in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
        env.update(store_env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        start = time.monotonic()
        process = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # the launcher's ranks join its process group: one kill reaches them all
        )
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
        elapsed = time.monotonic() - start
        leftovers = _kill_group(process.pid)
    return subprocess.CompletedProcess(process.args, process.returncode, output, ""), elapsed, leftovers


# ------------------------------------------------------------------------------------------------ one command


def run_command(
    command: Sequence[str],
    *,
    timeout: float,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
    echo: TextIO | None = None,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(command, capture_output=True, text=True, timeout=...)``, but on ``timeout`` every process the
    command started (the ranks Lightning's launcher spawns, a benchmark's workers) is killed with it.

    The command gets its own session; plain ``subprocess.run`` kills only its direct child, and a rank it started
    could outlive the caller. The timeout is then raised. With ``echo``, the standard output is also written there
    line by line as it comes, and the standard error goes to this process's (not captured); the
    ``subprocess.TimeoutExpired`` then carries the output so far.
    """
    process = subprocess.Popen(
        list(command),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if echo is None else None,
        text=True,
        start_new_session=True,
    )
    try:
        if echo is None:
            stdout, stderr = process.communicate(timeout=timeout)
        else:
            stdout, stderr = _echoed(process, echo, timeout), None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
        _kill_group(process.pid)
    return subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr)


def _echoed(process: subprocess.Popen[str], echo: TextIO, timeout: float) -> str:
    """``process``'s standard output, copied to ``echo`` as it comes, once it exits within ``timeout`` seconds."""
    lines: list[str] = []

    def copy() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            echo.write(line)
            lines.append(line)

    reader = threading.Thread(target=copy, name="echo", daemon=True)
    reader.start()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        reader.join(timeout=5)
        raise subprocess.TimeoutExpired(process.args, timeout, output="".join(lines)) from None
    reader.join(timeout=5)  # a process the command left running may hold the pipe: killed right after
    return "".join(lines)


def run_module(
    module: str, args: Sequence[str], *, timeout: float, cwd: str | Path | None = None
) -> tuple[int, str, str]:
    """Run ``python -m module *args`` with one thread per process; ``(returncode, stdout, stderr)``.

    On ``timeout`` every process it started is killed with it (:func:`run_command`) and the timeout is raised.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = run_command([sys.executable, "-m", module, *args], timeout=timeout, cwd=cwd, env=env)
    return result.returncode, result.stdout, result.stderr


def _kill_group(group: int) -> int:
    """Kill whatever is left of process group ``group``; return how many processes were still in it."""
    alive = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(state[2]) == group and state[0] != "Z":  # a zombie has exited already
            alive += 1
    if alive:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    return alive
