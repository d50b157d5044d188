"""The benchmarks' launcher: a job that cannot start reports why."""

from __future__ import annotations

import pickle

import pytest

from benchmarks.launch import Launcher


def test_a_job_that_cannot_start_raises_its_own_error_not_the_cleanups() -> None:
    # A lambda does not pickle, so the forkserver cannot start the rank; the launcher's cleanup used to join the
    # unstarted process and raise AssertionError("can only join a started process") over the pickling error.
    with Launcher([]) as launcher, pytest.raises((pickle.PicklingError, AttributeError, TypeError)) as raised:
        launcher.run(lambda rank, world_size: rank, (), 1, timeout=30)
    assert "pickle" in str(raised.value).lower()
