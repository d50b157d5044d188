"""The machine a benchmark ran on, as its results report it."""

from __future__ import annotations

import datetime
import os
import platform

__all__ = ["cpu_model", "machine_line"]


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_line() -> str:
    """The machine, torch and Python a run used, and when: the "Machine:" line of a benchmark's page."""
    import torch

    return (
        f"`nproc` = {os.cpu_count()}, {cpu_model()}, torch {torch.__version__}, Python {platform.python_version()}, "
        f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}"
    )
