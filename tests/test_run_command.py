"""The test helper that runs commands: on a timeout nothing the command started may outlive the test."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.distributed import run_command

# A parent that starts a child (as Lightning's launcher starts the other ranks), writes the child's pid, and waits.
SCRIPT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


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
