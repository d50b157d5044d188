"""Shared fixtures of the zoo tests: one multi-process job trains every model's tiny configuration with GPipe."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.distributed import run_job
from helpers.zoo_tiny import CHUNKS, STEPS, TINY


@pytest.fixture(scope="session")
def gpipe_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with ``NAME.pt`` (state dict) and ``NAME.ckpt`` of every tiny model after a K = 2 fit."""
    out = tmp_path_factory.mktemp("gpipe-runs")
    runs = [f"{name}:{CHUNKS[name]}" for name in TINY]
    results = run_job("helpers.zoo_job", [str(out), str(STEPS), *runs], 2, timeout=600)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank} failed:\n{result.stdout[-4000:]}"
    return out
