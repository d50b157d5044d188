"""Run a function in several gloo processes on 127.0.0.1, with a deadline and no process left behind."""

from __future__ import annotations

import datetime
import os
import queue
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
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
    fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, results: Any, pg_timeout: float
) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
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
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_worker, args=(fn, rank, world_size, port, args, results, pg_timeout), daemon=True)
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
    port = free_port()
    tests_dir = str(Path(__file__).resolve().parents[1])
    processes = []
    for rank in range(world_size):
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
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
