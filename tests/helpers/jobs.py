"""The one entry point of the tests' rank scripts, and the ways a test starts them.

A rank script is a module with ``main(*args: str)`` (``helpers.lightning_job``, ``helpers.zoo_job``, ...). Each of its
processes runs ``python -m helpers.jobs MODULE ARG... [-- MODULE ARG...]...``, which imports each ``MODULE`` in turn
and calls its ``main`` with its arguments: several scripts can share one launch, and so the seconds each rank spends
importing torch and Lightning. A test starts them with :func:`run_job` or :func:`run_scripts` (one process per rank,
torchrun's environment) or :func:`launch` (one process whose Trainer starts the ranks): :mod:`tools.launch`'s,
with its deadlines and clean-up.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tools import launch as launcher

__all__ = ["launch", "main", "run_job", "run_scripts"]

SEPARATOR = "--"


def run_job(
    module: str, args: Sequence[str], world_size: int, *, timeout: float, cwd: str | Path | None = None
) -> list[subprocess.CompletedProcess[str]]:
    """Rank script ``module`` with ``args`` on ``world_size`` ranks (:func:`tools.launch.run_job`)."""
    return run_scripts([[module, *args]], world_size, timeout=timeout, cwd=cwd)


def run_scripts(
    scripts: Sequence[Sequence[str]], world_size: int, *, timeout: float, cwd: str | Path | None = None
) -> list[subprocess.CompletedProcess[str]]:
    """Each ``[MODULE, ARG...]`` of ``scripts``, one after the other, in the same ``world_size`` rank processes."""
    argv = [item for script in scripts for item in (SEPARATOR, *script)][1:]
    return launcher.run_job("helpers.jobs", argv, world_size, timeout=timeout, cwd=cwd)


def launch(
    module: str, args: Sequence[str], *, timeout: float, cwd: str | Path | None = None
) -> tuple[subprocess.CompletedProcess[str], float, int]:
    """Rank script ``module`` with ``args``, started once for Lightning to launch (:func:`tools.launch.launch`)."""
    return launcher.launch("helpers.jobs", [module, *args], timeout=timeout, cwd=cwd)


def main(argv: Sequence[str]) -> None:
    """``MODULE ARG... [-- MODULE ARG...]...``: call each ``MODULE.main(*ARG)`` in turn."""
    script: list[str] = []
    for item in [*argv, SEPARATOR]:
        if item != SEPARATOR:
            script.append(item)
            continue
        module, *args = script
        print(f"helpers.jobs: {module} {' '.join(args)}", flush=True)
        importlib.import_module(module).main(*args)
        script = []
    import torch.distributed as dist  # here: the launching process need not import torch

    if dist.is_available() and dist.is_initialized():
        # Skip the interpreter's finalization: a gloo worker thread still releasing a finished collective's tensors
        # then aborts the rank ("terminate called without an active exception", pytorch/pytorch#190489), and
        # destroy_process_group does not join those threads. Every result is written by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
