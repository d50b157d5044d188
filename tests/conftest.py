"""Shared fixtures: every test starts from the same random state and the same environment variables."""

import os
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from benchmarks.launch import loopback_store


def pytest_configure(config: pytest.Config) -> None:
    # Every process a test starts (a job's ranks, a command line) imports `helpers` as the test process does.
    tests = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(path for path in (tests, os.environ.get("PYTHONPATH")) if path)


@pytest.fixture(autouse=True)
def seed() -> int:
    """Seed Python, NumPy and torch so that each test is reproducible on its own."""
    value = 1234
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)
    return value


@pytest.fixture(autouse=True)
def restore_environment() -> Iterator[None]:
    """Put back the environment variables a test changed.

    Regression: Lightning's launcher writes ``LOCAL_RANK``/``NODE_RANK`` (and ``seed_everything`` ``PL_GLOBAL_SEED``)
    into the environment of the process that fits in-process; a later test that started a job inherited them, and
    the job's launcher, taking itself for an already-launched rank, never started its other ranks: a hang.
    """
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def no_process_group_left() -> Iterator[None]:
    """Fail the test that leaves a process group initialized, rather than a later test of its worker.

    Regression: an in-process fit without :func:`loopback_process_group` left its world-of-one group behind; two tests
    run after it on the same pytest worker failed (a balance broadcast over the stale group, a check that no group
    exists).
    """
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left a process group initialized: fit in-process with the loopback_process_group fixture")


@pytest.fixture
def loopback_process_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A one-process group for a Trainer fitted in the test's process, its store on 127.0.0.1, destroyed after."""
    with loopback_store() as env:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        yield
        if dist.is_initialized():
            dist.destroy_process_group()
