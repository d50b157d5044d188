"""Shared fixtures of the zoo tests: one multi-process job trains every model's tiny configuration with GPipe."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
from helpers.jobs import run_job
from helpers.zoo_tiny import CHUNKS, STEPS, TINY


@pytest.fixture(scope="session")
def gpipe_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with ``NAME.pt`` (state dict) and ``NAME.ckpt`` of every tiny model after a K = 2 fit.

    Under pytest-xdist each worker has its own session, and the files that use this fixture may run on both: the first
    worker to get here runs the job into the run's shared temporary root, under a lock the other waits on.
    """
    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:  # each worker has its own folder in the run's root
        root = root.parent
    out = root / "gpipe-runs"
    with (root / "gpipe-runs.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "done").exists():
            out.mkdir(exist_ok=True)
            runs = [f"{name}:{CHUNKS[name]}" for name in TINY]
            results = run_job("helpers.zoo_job", [str(out), str(STEPS), *runs], 2, timeout=600)
            for rank, result in enumerate(results):
                assert result.returncode == 0, f"rank {rank} failed:\n{result.stdout[-4000:]}"
            (out / "done").touch()
    return out
