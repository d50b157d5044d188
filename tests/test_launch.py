"""The launcher of tests and benchmarks (``tools/launch.py``): every launch has a deadline, a failing rank ends
the others promptly with its error, and nothing a launch started outlives it."""

from __future__ import annotations

import io
import os
import pickle
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.runif import RunIf

from tools.launch import JobError, JobTimeoutError, Launcher, run_command, run_job, run_processes

# A parent that starts a child (as Lightning's launcher starts the other ranks), writes the child's pid, and waits.
SCRIPT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(120)
"""

# A rank script: prints its torchrun environment; rank 1 fails at once, rank 0 would wait two minutes.
RANK_SCRIPT = """
import os, sys, time
print({key: os.environ.get(key) for key in sys.argv[1:]}, flush=True)
if os.environ["RANK"] == "1":
    sys.exit("rank 1 fails on purpose")
time.sleep(120)
"""
TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _environment(rank: int, world_size: int) -> dict[str, str | None]:
    return {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}


def _fail_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.barrier()  # waits for rank 1, which never comes: only the launcher can end this rank
    return os.getpid()


def _killed_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OS kills a rank (out of memory): no traceback, no report
    dist.recv(torch.zeros(1), src=1)  # fails on the closed connection: a consequence, not the cause


def _killed_while_reporting_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.recv(torch.zeros(1), src=1)  # waits for rank 1, which never sends: only the launcher can end this rank
        return
    # What a rank killed while writing its result leaves behind: a message's header (a 1 MiB body announced) and part
    # of its body. The rank's end of its results pipe is `out` in the launcher's frame that called this function.
    out = sys._getframe(1).f_locals["out"]
    os.write(out.fileno(), struct.pack("!i", 1 << 20) + b"partial")
    os.kill(os.getpid(), signal.SIGKILL)


def _sleep(rank: int, world_size: int, folder: Path) -> None:
    (folder / f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(120)


@RunIf(multiprocess=True)
def test_a_timeout_kills_the_processes_the_command_started(tmp_path: Path) -> None:
    # Found when the spiral example's test timed out under load: subprocess.run killed rank 0 only, and the rank it
    # had started ran on for minutes.
    pid_file = tmp_path / "child.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_command([sys.executable, "-c", SCRIPT, str(pid_file)], timeout=5, env=dict(os.environ))
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


# A command that prints a line, then waits: the line must reach the echo before the command ends.
ECHO_SCRIPT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(child.pid))
print("started", flush=True)
time.sleep(float(sys.argv[2]))
print("done", flush=True)
"""


@RunIf(multiprocess=True)
def test_an_echoed_command_streams_its_output_and_is_killed_with_its_children_at_the_deadline(tmp_path: Path) -> None:
    # The benchmarks' runner had its own copy of this (a deadline by SIGALRM, the output echoed as it came).
    pid_file = tmp_path / "child.pid"
    echo = io.StringIO()
    done = run_command([sys.executable, "-c", ECHO_SCRIPT, str(pid_file), "0"], timeout=60, echo=echo)
    assert (done.returncode, done.stdout, echo.getvalue()) == (0, "started\ndone\n", "started\ndone\n")
    echo = io.StringIO()
    with pytest.raises(subprocess.TimeoutExpired) as timeout:
        run_command([sys.executable, "-c", ECHO_SCRIPT, str(pid_file), "120"], timeout=5, echo=echo)
    assert timeout.value.output == echo.getvalue() == "started\n"  # what came before the deadline
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


@RunIf(multiprocess=True)
def test_a_job_that_cannot_start_raises_its_own_error_not_the_cleanups() -> None:
    # A lambda does not pickle, so the forkserver cannot start the rank; the launcher's cleanup used to join the
    # unstarted process and raise AssertionError("can only join a started process") over the pickling error.
    with Launcher([]) as launcher, pytest.raises((pickle.PicklingError, AttributeError, TypeError)) as raised:
        launcher.run(lambda rank, world_size: rank, (), 1, timeout=30)
    assert "pickle" in str(raised.value).lower()


@RunIf(multiprocess=True)
def test_function_ranks_see_their_rank_and_the_loopback_store() -> None:
    first, second = run_processes(_environment, 2, timeout=120)
    assert (first["RANK"], second["RANK"]) == ("0", "1")
    assert first["WORLD_SIZE"] == second["WORLD_SIZE"] == "2"
    assert first["MASTER_ADDR"] == "127.0.0.1"
    assert first["MASTER_PORT"] == second["MASTER_PORT"]


def _fails_within_a_minute(launcher: Launcher, fn: Callable[..., Any], match: str, timeout: float) -> None:
    """Run ``fn`` as a 2-rank job that must raise a :class:`JobError` matching ``match`` well before the group's
    300-second timeout, the launcher's server warmed up first (its imports out of the time measured)."""
    launcher.run(_environment, (), 2, timeout=120)
    start = time.monotonic()
    with pytest.raises(JobError, match=match):
        launcher.run(fn, (), 2, timeout=timeout, pg_timeout=300)
    assert time.monotonic() - start < 60


@RunIf(multiprocess=True)
def test_a_failing_function_rank_ends_the_job_at_once_with_its_traceback() -> None:
    # Rank 0 waits in a barrier for 300 s (the group's timeout); the job must not wait for it.
    with Launcher() as launcher:
        _fails_within_a_minute(
            launcher, _fail_on_rank_1, r"(?s)rank 1 failed.*ValueError: rank 1 fails on purpose", 600
        )


@RunIf(multiprocess=True)
@pytest.mark.timeout(120)
def test_a_killed_function_rank_is_named_not_the_peer_that_failed_on_its_closed_connection() -> None:
    # The peer's error used to arrive first and be raised as the job's failure; the killed rank was never named.
    with Launcher() as launcher:
        _fails_within_a_minute(launcher, _killed_on_rank_1, r"rank1 exited with code -9 \(SIGKILL\)", 120)


@RunIf(multiprocess=True)
@pytest.mark.timeout(120)
def test_a_rank_killed_while_reporting_ends_the_job_and_the_launcher_runs_the_next() -> None:
    # Hung: every rank wrote to one shared queue, and the launcher blocked reading the rest of the dead rank's message
    # (the queue's other writers kept the pipe open), with no deadline; the torn message would also have wedged every
    # later job of the launcher.
    with Launcher() as launcher:
        _fails_within_a_minute(
            launcher, _killed_while_reporting_on_rank_1, r"rank1 exited with code -9 \(SIGKILL\)", 120
        )
        first, second = launcher.run(_environment, (), 2, timeout=120)
    assert (first["RANK"], second["RANK"]) == ("0", "1")


@RunIf(multiprocess=True)
def test_function_ranks_that_miss_the_deadline_are_killed(tmp_path: Path) -> None:
    with Launcher() as launcher:
        launcher.run(_environment, (), 2, timeout=300)  # the server's imports, out of the deadline
        with pytest.raises(JobTimeoutError, match="did not finish within 5 s"):
            launcher.run(_sleep, (tmp_path,), 2, timeout=5)
    pids = [int(path.read_text()) for path in tmp_path.glob("rank*.pid")]
    assert len(pids) == 2
    assert not any(_alive(pid) for pid in pids)


@RunIf(multiprocess=True)
def test_script_ranks_get_torchruns_environment_and_a_failing_rank_ends_the_others(tmp_path: Path) -> None:
    # Rank 0 would sleep two minutes; once rank 1 has failed it gets `grace` seconds, then it is killed.
    (tmp_path / "rank_script.py").write_text(RANK_SCRIPT)
    start = time.monotonic()
    first, second = run_job("rank_script", TORCHRUN, 2, timeout=120, cwd=tmp_path, grace=2)
    assert time.monotonic() - start < 60
    assert second.returncode == 1
    assert "rank 1 fails on purpose" in second.stdout
    assert first.returncode == -9  # killed
    seen = [eval(result.stdout.splitlines()[0]) for result in (first, second)]  # noqa: S307 - our own output
    assert [environment["RANK"] for environment in seen] == ["0", "1"]
    assert [environment["LOCAL_RANK"] for environment in seen] == ["0", "1"]
    for environment in seen:
        assert environment["WORLD_SIZE"] == environment["LOCAL_WORLD_SIZE"] == "2"
        assert environment["MASTER_ADDR"] == "127.0.0.1"
        assert environment["MASTER_PORT"] == seen[0]["MASTER_PORT"]


# A rank script that prints the variables named on its command line and ends.
PRINT_SCRIPT = """
import os, sys
print({key: os.environ.get(key) for key in sys.argv[1:]}, flush=True)
"""
TORCHRUN_NODES = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


@RunIf(multiprocess=True)
def test_script_ranks_on_two_nodes_are_numbered_node_major_as_torchrun_does(tmp_path: Path) -> None:
    (tmp_path / "print_script.py").write_text(PRINT_SCRIPT)
    results = run_job("print_script", TORCHRUN_NODES, 4, timeout=120, cwd=tmp_path, nodes=2, elastic=True)
    assert [result.returncode for result in results] == [0, 0, 0, 0]
    seen = [eval(result.stdout.splitlines()[0]) for result in results]  # noqa: S307 - our own output
    assert [(e["RANK"], e["NODE_RANK"], e["GROUP_RANK"], e["LOCAL_RANK"]) for e in seen] == [
        ("0", "0", "0", "0"),
        ("1", "0", "0", "1"),
        ("2", "1", "1", "0"),
        ("3", "1", "1", "1"),
    ]
    assert {e["LOCAL_WORLD_SIZE"] for e in seen} == {"2"}
    assert all(e["TORCHELASTIC_RUN_ID"] for e in seen)  # what makes Lightning pick its TorchElasticEnvironment


def test_nodes_must_divide_the_world() -> None:
    with pytest.raises(ValueError, match="nodes=3 must be a positive divisor of world_size=4"):
        run_job("print_script", (), 4, nodes=3)
