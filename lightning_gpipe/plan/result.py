"""The planner's answer: each configuration it weighed (:class:`Candidate`), the one it recommends with its reasons
(:class:`Plan`), and the error that says what would fit when nothing does (:class:`InfeasiblePlanError`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from lightning_gpipe.engine.rematerialization import CheckpointMode
from lightning_gpipe.engine.schedule import stages_of
from lightning_gpipe.partition.balance import cell_bounds
from lightning_gpipe.partition.config import DataParallel
from lightning_gpipe.plan.memory import StageMemory
from lightning_gpipe.profile.layer_profile import ModelProfile

__all__ = ["GiB", "Candidate", "InfeasiblePlanError", "Plan", "format_bytes", "parse_bytes"]

GiB = 2**30
"""Bytes in a gibibyte: the planner's unit (``"16GB"`` means 16 GiB)."""

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20}
_UNITS.update({"g": GiB, "gb": GiB, "gib": GiB, "t": 2**40, "tb": 2**40, "tib": 2**40})


def parse_bytes(value: float | str) -> float:
    """Bytes from a number or a string such as ``"16GB"``, ``"512 MiB"`` (binary units: 1 GB = 2**30 bytes)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str) and (match := re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)):
        unit = match.group(2).lower()
        if unit not in _UNITS:
            raise ValueError(f"unknown memory unit {match.group(2)!r} in {value!r}; use B, KB, MB, GB or TB")
        number = float(match.group(1)) * _UNITS[unit]
    else:
        raise ValueError(f"memory {value!r} must be a number of bytes or a string such as '16GB'")
    if not (number > 0 and math.isfinite(number)):
        raise ValueError(f"memory {value!r} must be positive")
    return number


def format_bytes(nbytes: float) -> str:
    """``nbytes`` as the planner prints it: GiB with two decimals, or MiB below a tenth of a GiB."""
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB / 10 else f"{nbytes / 2**20:.1f} MiB"


@dataclass(frozen=True)
class Candidate:
    """One configuration the planner weighed, with its predicted step time and per-stage memory."""

    pipe_size: int
    replicas: int
    chunks: int
    microbatch_size: int
    balance: tuple[int, ...]
    checkpoint: CheckpointMode
    schedule: str
    step_time: float  # seconds per optimizer step (all replicas in parallel)
    bubble: float
    stage_memory: tuple[StageMemory, ...]  # per process: its stages together
    stage_busy: tuple[float, ...]  # seconds each process computes per step
    samples: int = 0  # samples per optimizer step over all replicas
    virtual_stages: int = 1  # v, the stages per process of "interleaved" (1 for the other schedules)
    data_parallel: DataParallel = "ddp"  # how the replicas share each stage: whole, or sharded ("fsdp")

    @property
    def time_per_sample(self) -> float:
        """Predicted seconds per sample: what the planner minimizes (the step time when the batch is fixed)."""
        return self.step_time / max(1, self.samples)

    @property
    def peak(self) -> float:
        """The largest process's predicted peak bytes."""
        return max(memory.peak for memory in self.stage_memory)

    @property
    def schedule_label(self) -> str:
        """The schedule as the strategy takes it: ``schedule='1f1b'``, ``schedule='interleaved', virtual_stages=2``."""
        v = f", virtual_stages={self.virtual_stages}" if self.schedule == "interleaved" else ""
        return f"schedule={self.schedule!r}{v}"

    @property
    def preference(self) -> tuple[float, float, int]:
        """How the planner ranks candidates, the smallest first: the fastest per sample (per step when the batch is
        fixed); among equally fast ones (within 1%), the one with the most memory to spare, then the one that
        recomputes least."""
        # At M = 1 "except_last" is "never" by another name; "selective" wins only on time or memory: a profile that
        # did not measure it predicts it as "except_last".
        recompute = ("never", "except_last", "selective", "always").index(self.checkpoint)
        return (round(math.log(max(self.time_per_sample, 1e-15)) / math.log(1.01)), self.peak, recompute)

    @property
    def data_parallel_label(self) -> str:
        """``data_parallel='fsdp'`` for sharded replicas; empty for whole ones, the strategy's default."""
        return f"data_parallel={self.data_parallel!r}" if self.data_parallel != "ddp" else ""

    def label(self) -> str:
        """The settings in one line, as the reasons and messages quote them."""
        sharded = f", {self.data_parallel_label}" if self.data_parallel_label else ""
        return (
            f"K={self.pipe_size}, M={self.chunks}, checkpoint={self.checkpoint!r}, {self.schedule_label}, "
            f"balance={list(self.balance)}{sharded}"
        )


@dataclass(frozen=True)
class Plan:
    """What :func:`plan` recommends: the settings, the predictions, and the reasons."""

    best: Candidate
    devices: int
    memory_per_device: float
    batch_size: int
    reasons: tuple[str, ...]
    candidates: tuple[Candidate, ...] = field(repr=False, default=())
    profile: ModelProfile | None = field(repr=False, default=None)
    per_pipeline_batch: bool = False  # batch_size is each pipeline's, not the whole step's

    @property
    def pipe_size(self) -> int:
        """K, stages per pipeline."""
        return self.best.pipe_size

    @property
    def chunks(self) -> int:
        """M, micro-batches per mini-batch."""
        return self.best.chunks

    @property
    def balance(self) -> list[int]:
        """Layers per stage: K entries, or ``K·v`` when each process holds ``v`` stages (interleaved, ZB-V)."""
        return list(self.best.balance)

    @property
    def checkpoint(self) -> CheckpointMode:
        """The re-materialization mode."""
        return self.best.checkpoint

    @property
    def schedule(self) -> str:
        """The schedule."""
        return self.best.schedule

    @property
    def virtual_stages(self) -> int:
        """Stages per process under ``"interleaved"``; 1 for the other schedules (``"zbv"`` always holds two)."""
        return self.best.virtual_stages

    @property
    def data_parallel(self) -> DataParallel:
        """How the replicas share each stage: ``"ddp"`` (whole) or ``"fsdp"`` (sharded; only with several)."""
        return self.best.data_parallel

    @property
    def step_time(self) -> float:
        """Predicted seconds per optimizer step."""
        return self.best.step_time

    @property
    def bubble(self) -> float:
        """Predicted idle share of the stages."""
        return self.best.bubble

    @property
    def stage_peaks(self) -> list[float]:
        """Predicted peak bytes per process (its stages together when it holds several)."""
        return [memory.peak for memory in self.best.stage_memory]

    def strategy_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :class:`~lightning_gpipe.GPipeStrategy` that carry out this plan
        (``virtual_stages`` only under ``"interleaved"``, ``data_parallel`` only when ``"fsdp"``)."""
        settings: dict[str, Any] = {
            "pipe_size": self.pipe_size,
            "chunks": self.chunks,
            "balance": self.balance,
            "checkpoint": self.checkpoint,
            "schedule": self.schedule,
        }
        if self.schedule == "interleaved":
            settings["virtual_stages"] = self.virtual_stages
        if self.data_parallel != "ddp":
            settings["data_parallel"] = self.data_parallel
        return settings

    def strategy_code(self) -> str:
        """The :class:`~lightning_gpipe.GPipeStrategy` that carries out this plan, as code to paste.

        ``plan="auto"`` logs it and ``python -m lightning_gpipe.plan`` prints it; the Trainer takes ``devices`` of
        them (``devices / pipe_size`` data-parallel pipelines).
        """
        arguments = ", ".join(f"{name}={value!r}" for name, value in self.strategy_kwargs().items())
        return f"GPipeStrategy({arguments})"

    def table(self) -> Any:
        """A ``rich`` renderable: the settings, one row per stage, and the reasons."""
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        best = self.best
        sharded = best.data_parallel != "ddp"
        head = Text(
            f"{self.devices} device(s) x {format_bytes(self.memory_per_device)}, batch {self.batch_size}"
            f"{' per pipeline' if self.per_pipeline_batch else ''}: "
            f"K={best.pipe_size} stages x {best.replicas} replica(s), M={best.chunks} micro-batches of "
            f"{best.microbatch_size}, checkpoint={best.checkpoint!r}, {best.schedule_label}"
            f"{', ' + best.data_parallel_label if sharded else ''}\n"
            f"predicted step {best.step_time * 1e3:.1f} ms for {best.samples} samples, bubble {best.bubble:.0%}, "
            f"peak {format_bytes(best.peak)} ({best.peak / self.memory_per_device:.0%} of the budget)"
        )
        several = len(best.balance) > best.pipe_size  # each process holds several stages
        stages = Table(title="per process (its stages' layers)" if several else "per stage")
        columns = ["process" if several else "stage", "layers", "state", "batch", "activations", "peak", "busy"]
        if sharded:  # the parameters gathered whole for the step, beside the shards in the state
            columns.insert(4, "gathered")
        for column in columns:
            stages.add_column(column, justify="right")
        cells = cell_bounds(best.balance)
        for r, (memory, busy) in enumerate(zip(best.stage_memory, best.stage_busy, strict=True)):
            held = stages_of(best.schedule, r, best.pipe_size, best.virtual_stages)
            row = [
                str(r),
                ", ".join(f"{cells[s].start}-{cells[s].stop - 1}" for s in held),
                format_bytes(memory.state),
                format_bytes(memory.batch),
                format_bytes(memory.activations),
                format_bytes(memory.peak),
                f"{busy / best.step_time:.0%}" if best.step_time > 0 else "-",
            ]
            if sharded:
                row.insert(4, format_bytes(memory.gathered))
            stages.add_row(*row)
        why = Text("why:\n" + "\n".join(f"- {reason}" for reason in self.reasons))
        return Group(head, stages, why)

    def __str__(self) -> str:
        import io

        from rich.console import Console

        # force_jupyter=False: in a notebook rich would otherwise display the table itself, besides returning it.
        console = Console(width=110, record=True, file=io.StringIO(), force_jupyter=False)
        console.print(self.table())
        return console.export_text()


class InfeasiblePlanError(ValueError):
    """No configuration fits the devices and memory asked for; says what would."""

    def __init__(self, message: str, *, min_devices: int | None, min_memory: float | None) -> None:
        super().__init__(message)
        self.min_devices = min_devices
        """The fewest devices (of the asked memory) that fit, ``None`` if none up to one layer per device does."""
        self.min_memory = min_memory
        """The least memory per device that fits on the asked device count."""
