"""Run a function in several gloo processes on 127.0.0.1, with a deadline and no process left behind.

Nothing a test starts listens beyond the loopback interface. torch's TCPStore server binds every interface whatever
``MASTER_ADDR`` says, so the test process hosts the store itself on a socket bound to 127.0.0.1 (TCPStore's
``master_listen_fd``) and every rank joins it as a client (``TORCHELASTIC_USE_AGENT_STORE=True``, how torchrun's agent
hosts it); gloo's own sockets bind the interface named by ``GLOO_SOCKET_IFNAME=lo``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def loopback_store() -> Iterator[dict[str, str]]:
    """Host a TCPStore on 127.0.0.1 for the ranks of one job; yields the environment that makes them use it."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = int(listener.getsockname()[1])
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
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


def _plain(value: Any) -> Any:
    """Tensors as NumPy arrays: torch's queue would share their memory, which dies with the exiting worker."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(item) for item in value)
    return value


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    env: dict[str, str],
    args: tuple,
    results: Any,
    pg_timeout: float,
) -> None:
    torch.set_num_threads(1)
    os.environ.update(env)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{env['MASTER_PORT']}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        try:
            results.put((rank, "ok", _plain(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise SystemExit(1) from None


def run_processes(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, pg_timeout: float = 60.0
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined by a gloo group.

    Returns the results in rank order, tensors turned into NumPy arrays. The first error is re-raised with the
    failing rank's traceback; on any failure or when ``timeout`` seconds pass, every process still alive is killed.
    """
    with loopback_store() as env:
        return _run_spawned(fn, world_size, env, args, timeout, pg_timeout)


def _run_spawned(
    fn: Callable[..., Any], world_size: int, env: dict[str, str], args: tuple, timeout: float, pg_timeout: float
) -> list[Any]:
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=_worker, args=(fn, rank, world_size, env, args, results, pg_timeout), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    collected: dict[int, Any] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(collected) < world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                raise TimeoutError(f"{world_size - len(collected)} of {world_size} ranks did not finish in {timeout}s")
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead and results.empty():
                    raise RuntimeError(f"a rank exited with code {dead[0].exitcode} without reporting") from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            collected[rank] = value
        return [collected[rank] for rank in range(world_size)]
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()


def run_job(
    module: str, args: list[str], world_size: int, *, timeout: float = 300.0, cwd: str | None = None
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``python -m module *args`` as ``world_size`` ranks on 127.0.0.1, as Lightning's launcher or torchrun would.

    Each rank gets ``LOCAL_RANK``/``NODE_RANK``/``MASTER_*`` in its environment. If any rank fails or ``timeout``
    passes, every rank still running is killed; the completed processes are returned with their output.
    """
    with loopback_store() as store_env:
        return _run_ranks(module, args, world_size, store_env, timeout, cwd)


def _run_ranks(
    module: str, args: list[str], world_size: int, store_env: dict[str, str], timeout: float, cwd: str | None
) -> list[subprocess.CompletedProcess[str]]:
    tests_dir = str(Path(__file__).resolve().parents[1])
    processes = []
    for rank in range(world_size):
        env = dict(os.environ)
        env.update(
            store_env,
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
            WORLD_SIZE=str(world_size),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([tests_dir, env.get("PYTHONPATH", "")]),
        )
        processes.append(
            subprocess.Popen(
                [sys.executable, "-m", module, *args],
                env=env,
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    deadline = time.monotonic() + timeout
    outputs: list[str] = [""] * world_size
    try:
        for rank, process in enumerate(processes):
            remaining = max(deadline - time.monotonic(), 0.1)
            try:
                outputs[rank], _ = process.communicate(timeout=remaining)
            except subprocess.TimeoutExpired:
                break
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        for rank, process in enumerate(processes):
            if not outputs[rank]:
                outputs[rank] = process.communicate()[0] or ""
    return [
        subprocess.CompletedProcess(process.args, process.returncode, outputs[rank], "")
        for rank, process in enumerate(processes)
    ]


def launch(
    module: str, args: list[str], *, timeout: float = 300.0, cwd: str | None = None
) -> tuple[subprocess.CompletedProcess[str], float, int]:
    """Run ``python -m module *args`` as one process that Lightning's own launcher turns into the job's ranks.

    Returns the first process (global rank 0) with the output of every rank, the seconds until the last process of
    the job ended (every rank writes to the same pipe, which closes only when all have exited), and how many of the
    job's processes were still alive then and had to be killed (0 when the job ended by itself). On ``timeout``
    every process of the job is killed.
    """
    tests_dir = str(Path(__file__).resolve().parents[1])
    with loopback_store() as store_env:
        env = {key: value for key, value in os.environ.items() if key not in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
        env.update(
            store_env,
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join([tests_dir, env.get("PYTHONPATH", "")]),
        )
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


def run_command(
    command: list[str], *, timeout: float, cwd: str | Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(command, capture_output=True, text=True, timeout=...)``, but on ``timeout`` every process the
    command started (the ranks Lightning's launcher spawns, a benchmark's workers) is killed with it.

    The command gets its own session; plain ``subprocess.run`` kills only its direct child, and a rank it started
    could outlive the test. The timeout is then raised.
    """
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
        _kill_group(process.pid)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def run_module(module: str, args: list[str], *, timeout: float, cwd: str | Path | None = None) -> tuple[int, str, str]:
    """Run ``python -m module *args`` with one thread per process; ``(returncode, stdout, stderr)``.

    On ``timeout`` every process it started is killed with it (:func:`run_command`) and the timeout is raised.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = run_command([sys.executable, "-m", module, *args], timeout=timeout, cwd=cwd, env=env)
    return result.returncode, result.stdout, result.stderr
