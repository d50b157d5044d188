"""Shared fixtures: every test starts from the same random state and the same environment variables."""

import os
import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch


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
