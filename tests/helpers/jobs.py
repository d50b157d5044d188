"""The one entry point of the tests' rank scripts, and the two ways a test starts them.

A rank script is a module with ``main(*args: str)`` (``helpers.lightning_job``, ``helpers.zoo_job``, ...). Each of its
processes runs ``python -m helpers.jobs MODULE ARG...``, which imports ``MODULE`` and calls its ``main`` with the
arguments. A test starts them with :func:`run_job` (one process per rank, torchrun's environment) or :func:`launch`
(one process whose Trainer starts the ranks): :mod:`benchmarks.launch`'s, with its deadlines and clean-up.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks import launch as launcher

__all__ = ["launch", "main", "run_job"]


def run_job(
    module: str, args: Sequence[str], world_size: int, *, timeout: float, cwd: str | Path | None = None
) -> list[subprocess.CompletedProcess[str]]:
    """Rank script ``module`` with ``args`` on ``world_size`` ranks (:func:`benchmarks.launch.run_job`)."""
    return launcher.run_job("helpers.jobs", [module, *args], world_size, timeout=timeout, cwd=cwd)


def launch(
    module: str, args: Sequence[str], *, timeout: float, cwd: str | Path | None = None
) -> tuple[subprocess.CompletedProcess[str], float, int]:
    """Rank script ``module`` with ``args``, started once for Lightning to launch (:func:`benchmarks.launch.launch`)."""
    return launcher.launch("helpers.jobs", [module, *args], timeout=timeout, cwd=cwd)


def main(argv: Sequence[str]) -> None:
    """``MODULE ARG...``: call ``MODULE.main(*ARG)``."""
    module, *args = argv
    importlib.import_module(module).main(*args)


if __name__ == "__main__":
    main(sys.argv[1:])
