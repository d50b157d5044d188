"""CPU accounting from /proc: how many cores other processes used while a measurement ran.

On a 2-core machine shared with other jobs, one foreign busy process halves what a 2-stage pipeline can get, so
every measured window carries its foreign load and the orchestrator discards the windows where it was noticeable.
Foreign load = (busy time of the whole machine - CPU time of our own processes) / wall time, in cores.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["CpuSnapshot", "foreign_cores", "idle_foreign_cores", "snapshot"]

_TICKS = os.sysconf("SC_CLK_TCK")


def _machine_busy_seconds() -> float:
    # /proc/stat "cpu" line: user nice system idle iowait irq softirq steal guest guest_nice (in clock ticks).
    # Guest time is already inside user; steal is time the hypervisor gave to others, which no process here used.
    with open("/proc/stat") as stat:
        fields = [int(field) for field in stat.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / _TICKS


def _process_cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
    except FileNotFoundError:  # it exited; its time no longer shows in the machine's counters either way
        return 0.0
    # utime and stime are fields 14 and 15; the command name (field 2) may contain spaces, so split after ')'.
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


@dataclass(frozen=True)
class CpuSnapshot:
    """Wall clock, the machine's busy CPU time and our processes' CPU time, all in seconds."""

    wall: float
    machine_busy: float
    own: float


def snapshot(own_pids: Iterable[int]) -> CpuSnapshot:
    """Counters now; ``own_pids`` are the processes whose CPU time is ours (all their threads included)."""
    return CpuSnapshot(time.monotonic(), _machine_busy_seconds(), sum(_process_cpu_seconds(p) for p in own_pids))


def foreign_cores(start: CpuSnapshot, end: CpuSnapshot) -> float:
    """Cores that processes other than ours kept busy on average between two snapshots (>= 0)."""
    wall = end.wall - start.wall
    if wall <= 0:
        return 0.0
    return max(0.0, ((end.machine_busy - start.machine_busy) - (end.own - start.own)) / wall)


def idle_foreign_cores(own_pids: Iterable[int], seconds: float = 0.5) -> float:
    """Foreign load over the next ``seconds`` while we run nothing: used to wait for a quiet machine."""
    pids = list(own_pids)
    start = snapshot(pids)
    time.sleep(seconds)
    return foreign_cores(start, snapshot(pids))
