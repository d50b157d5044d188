"""The planner: K, M, balance, re-materialization and schedule for a model, a device count and a memory budget.

:func:`plan` profiles the model's layers (:func:`~lightning_gpipe.profile.profile_layers`), then, for every
pipeline size K that divides the device count, every M, both balances (by time and by memory), every checkpoint mode
and schedule (``"interleaved"`` with each of a few ``virtual_stages``), predicts each process's peak memory
(:func:`~lightning_gpipe.plan.memory.process_memory`, its stages together) and the step time
(:func:`~lightning_gpipe.plan.simulate.simulate_step`), and keeps the fastest configuration that fits. The
:class:`Plan` says what to set, what to expect and why; a request that nothing fits raises
:class:`InfeasiblePlanError` naming the smallest device count and the smallest memory per device that would work.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gpipe.engine.microbatch import microbatch_sizes
from lightning_gpipe.engine.rematerialization import CHECKPOINT_MODES, CheckpointMode, checkpoint_stop, validate_mode
from lightning_gpipe.engine.schedule import SCHEDULES, SPLIT_BACKWARD, stages_of, validate_schedule
from lightning_gpipe.engine.torch_compat import BatchNormBase
from lightning_gpipe.partition.balance import balance_by_cost, cell_bounds
from lightning_gpipe.plan.auto import AutoPlan
from lightning_gpipe.plan.memory import StageMemory, process_memory, stage_memory
from lightning_gpipe.plan.simulate import simulate_step
from lightning_gpipe.profile.layer_profile import LayerProfile, ModelProfile, profile_layers
from lightning_gpipe.profile.timing import OptimizerFactory

__all__ = [
    "DEFAULT_BANDWIDTH",
    "DEFAULT_BOUNDARY_OVERHEAD",
    "DEFAULT_LATENCY",
    "DEFAULT_MICROBATCH_OVERHEAD",
    "DEFAULT_REMATERIALIZATION_OVERHEAD",
    "DEFAULT_VIRTUAL_STAGES",
    "AutoPlan",
    "Candidate",
    "InfeasiblePlanError",
    "LayerProfile",
    "ModelProfile",
    "Plan",
    "StageMemory",
    "evaluate",
    "parse_bytes",
    "plan",
    "profile_layers",
    "stage_memory",
]

GiB = 2**30
DEFAULT_BANDWIDTH = {"cuda": 20e9, "cpu": 1.3e9, "meta": 20e9}
"""Bytes per second across a stage boundary: NVLink/PCIe-class on CUDA; on CPU gloo on loopback through the engine,
the median measured by ``benchmarks.plan_calibration.link`` (see docs/benchmarks/plan.md)."""
DEFAULT_LATENCY = {"cuda": 20e-6, "cpu": 700e-6, "meta": 20e-6}
"""Seconds of fixed cost per boundary message (transport calls, control message, a waiting stage's wake-up); on CPU
the median measured by ``benchmarks.plan_calibration.link`` (see docs/benchmarks/plan.md)."""
DEFAULT_MICROBATCH_OVERHEAD = {"cuda": 3.2e-4, "cpu": 4.5e-4, "meta": 0.0}
"""Seconds the engine adds to each stage per micro-batch beyond its layers' profiled times (Python, bookkeeping, the
one module and ``autograd`` call per pass the profile takes off every layer), measured against the same profile by
``benchmarks.plan_calibration.overhead [--device cuda]`` (see docs/benchmarks/plan.md); none for ``meta``."""
DEFAULT_REMATERIALIZATION_OVERHEAD = {"cuda": 5.0e-4, "cpu": 5.8e-4, "meta": 0.0}
"""Seconds a re-materialized micro-batch adds (the checkpoint wrapper, its random state, the replay's Python),
measured by ``benchmarks.plan_calibration.overhead``; used only by profiles without measured re-materialization."""
DEFAULT_BOUNDARY_OVERHEAD = {"cuda": 1.1e-3, "cpu": 1.1e-3, "meta": 0.0}
"""Seconds a stage's own thread spends per micro-batch and stage boundary beyond the link (describing, posting,
sending and receiving), which the one-stage overhead leaves out; measured on the CPU by
``benchmarks.plan_calibration.link`` and used for CUDA until measured there (see docs/benchmarks/plan.md)."""
DEFAULT_VIRTUAL_STAGES = (2, 3, 4)
"""The stages per process :func:`plan` weighs for ``"interleaved"``: each divides the bubble by ``v`` for ``v`` times
the boundary messages, which past four costs more than it saves on any link the planner knows."""
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


def _gib(nbytes: float) -> str:
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

    def label(self) -> str:
        """The settings in one line, as the reasons and messages quote them."""
        return (
            f"K={self.pipe_size}, M={self.chunks}, checkpoint={self.checkpoint!r}, {self.schedule_label}, "
            f"balance={list(self.balance)}"
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
        (``virtual_stages`` only under ``"interleaved"``)."""
        settings: dict[str, Any] = {
            "pipe_size": self.pipe_size,
            "chunks": self.chunks,
            "balance": self.balance,
            "checkpoint": self.checkpoint,
            "schedule": self.schedule,
        }
        if self.schedule == "interleaved":
            settings["virtual_stages"] = self.virtual_stages
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
        head = Text(
            f"{self.devices} device(s) x {_gib(self.memory_per_device)}, batch {self.batch_size}"
            f"{' per pipeline' if self.per_pipeline_batch else ''}: "
            f"K={best.pipe_size} stages x {best.replicas} replica(s), M={best.chunks} micro-batches of "
            f"{best.microbatch_size}, checkpoint={best.checkpoint!r}, {best.schedule_label}\n"
            f"predicted step {best.step_time * 1e3:.1f} ms for {best.samples} samples, bubble {best.bubble:.0%}, "
            f"peak {_gib(best.peak)} ({best.peak / self.memory_per_device:.0%} of the budget)"
        )
        several = len(best.balance) > best.pipe_size  # each process holds several stages
        stages = Table(title="per process (its stages' layers)" if several else "per stage")
        for column in ("process" if several else "stage", "layers", "state", "batch", "activations", "peak", "busy"):
            stages.add_column(column, justify="right")
        cells = cell_bounds(best.balance)
        for r, (memory, busy) in enumerate(zip(best.stage_memory, best.stage_busy, strict=True)):
            held = stages_of(best.schedule, r, best.pipe_size, best.virtual_stages)
            stages.add_row(
                str(r),
                ", ".join(f"{cells[s].start}-{cells[s].stop - 1}" for s in held),
                _gib(memory.state),
                _gib(memory.batch),
                _gib(memory.activations),
                _gib(memory.peak),
                f"{busy / best.step_time:.0%}" if best.step_time > 0 else "-",
            )
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


def _microbatch_counts(batch: int, chunks: Sequence[int] | None, smallest: int = 1) -> list[int]:
    """The M values to weigh: ``chunks``, or the powers of two, keeping micro-batches of at least ``smallest``."""
    counts = chunks if chunks is not None else [1 << p for p in range(16)]
    return sorted({m for m in counts if 1 <= m <= batch and min(microbatch_sizes(batch, m)) >= smallest} or {1})


def evaluate(
    profile: ModelProfile,
    *,
    pipe_size: int,
    chunks: int,
    batch_size: int,
    checkpoint: CheckpointMode,
    schedule: str = "gpipe",
    balance: Sequence[int] | None = None,
    replicas: int = 1,
    optimizer_slots: float = 2.0,
    bandwidth: float | None = None,
    latency: float | None = None,
    overhead: float | None = None,
    boundary_overhead: float | None = None,
    first_send_parked: bool | None = None,
    compiled: bool = False,
    virtual_stages: int = 1,
) -> Candidate:
    """Predict one configuration: step time, bubble and per-process memory for a mini-batch of ``batch_size`` samples.

    ``batch_size`` is the whole mini-batch; each of ``replicas`` pipelines gets its share. ``pipe_size`` is K, the
    processes of a pipeline; under ``"interleaved"`` (``virtual_stages=v``) and ``"zbv"`` (two) each holds several
    stages (:func:`~lightning_gpipe.engine.schedule.stages_of`), and ``balance``, the layers per stage, has that many
    entries per process. It defaults to the one that best balances the stages' pass times. ``overhead`` is the
    engine's seconds per micro-batch and stage (default by device type: :data:`DEFAULT_MICROBATCH_OVERHEAD`), split
    evenly between forward and backward; a re-materialized micro-batch adds :data:`DEFAULT_REMATERIALIZATION_OVERHEAD`
    (scaled alike when ``overhead`` is given). ``boundary_overhead`` is what a stage adds per micro-batch and stage
    boundary to another process (default by device type: :data:`DEFAULT_BOUNDARY_OVERHEAD`), split alike.
    ``first_send_parked`` holds each stage's first message of the step until its next forward (see
    :func:`~lightning_gpipe.plan.simulate.simulate_step`); by default on CPU stages, whose transport is gloo.
    ``compiled`` layers (``compile=True``) re-materialize every micro-batch under ``checkpoint="selective"``, the
    last included (:func:`~lightning_gpipe.engine.rematerialization.checkpoint_stop`). The zero-bubble schedules'
    input and weight passes I and W are the profile's times of the engine's split (``profile_layers(split=True)``),
    each layer's own plus what it pays per autograd node of the layers before it in its stage: on the first stage,
    whose input takes no gradient, I only walks the graph and W runs the whole backward. W also pays the engine's cost
    of one pass. A profile without them (from FLOPs) takes W as half the backward of each
    layer with trainable parameters, none of the others' (a linear layer's input and weight gradients are one matrix
    product each).

    Raises:
        ValueError: ``virtual_stages`` that the schedule does not take, a ``balance`` of another number of stages, or
            (``"interleaved"``) ``chunks`` its rounds cannot split.
    """
    K, M = pipe_size, chunks
    per_process = len(stages_of(schedule, 0, K, virtual_stages))  # refuses a virtual_stages the schedule does not take
    owner = {s: r for r in range(K) for s in stages_of(schedule, r, K, virtual_stages)}
    S = K * per_process
    sizes = microbatch_sizes(math.ceil(batch_size / replicas), M)  # as the engine splits each replica's batch
    M, n = len(sizes), sizes[0]  # the largest micro-batch sets each pass's time and bytes
    per_replica = sum(sizes)
    forward, backward = profile.pass_times(n)
    stop = checkpoint_stop(checkpoint, M, compiled=compiled)
    if balance is None:
        share = stop / M
        costs = [f + b + share * f for f, b in zip(forward, backward, strict=True)]
        balance = balance_by_cost(costs, S)
    if len(balance) != S:
        raise ValueError(
            f"balance={list(balance)} has {len(balance)} stages, but schedule={schedule!r} on K={K} processes has {S} "
            f"({per_process} per process); give one number of layers per stage"
        )
    kind = profile.device.split(":")[0]
    rate = bandwidth if bandwidth is not None else DEFAULT_BANDWIDTH.get(kind, 2e9)
    delay = latency if latency is not None else DEFAULT_LATENCY.get(kind, 1e-4)
    engine = overhead if overhead is not None else DEFAULT_MICROBATCH_OVERHEAD.get(kind, 0.0)
    boundary = boundary_overhead if boundary_overhead is not None else DEFAULT_BOUNDARY_OVERHEAD.get(kind, 0.0)
    # Scaled alike when an overhead is given: the re-materialized share keeps its measured ratio to the plain one.
    base = DEFAULT_MICROBATCH_OVERHEAD.get(kind, 0.0)
    replay = DEFAULT_REMATERIALIZATION_OVERHEAD.get(kind, 0.0) * (engine / base if base > 0 else 0.0)
    bounds = cell_bounds(balance)
    # Per micro-batch, each stage pays the engine's own cost and that of each boundary to another process (a middle
    # stage two; two neighbouring stages on one process pass their values in memory).
    remote = [sum(0 <= t < S and owner[t] != owner[s] for t in (s - 1, s + 1)) for s in range(S)]
    host = [engine + boundary * links for links in remote]
    # A split backward is one pass more, W, which pays the engine's cost of a pass as F and I do.
    passes = engine / 2 if schedule in SPLIT_BACKWARD else 0.0
    stage_f = [sum(forward[i] for i in cell) + cost / 2 for cell, cost in zip(bounds, host, strict=True)]
    stage_b = [sum(backward[i] for i in cell) + cost / 2 + passes for cell, cost in zip(bounds, host, strict=True)]
    weight = [sum(backward[i] / 2 for i in cell if profile.layers[i].trainable_bytes) + passes for cell in bounds]
    split = profile.split_times(n) if schedule in SPLIT_BACKWARD else None
    if split is not None:  # measured: the engine's split costs more than the whole backward (its walk, its calls)
        for s, (cell, cost) in enumerate(zip(bounds, host, strict=True)):
            if s == 0:  # its input takes no gradient: the input pass only walks the graph, the weight pass is whole
                own_input, own_weight = sum(split.walk[i] for i in cell), sum(backward[i] for i in cell)
            else:
                own_input = _split_stage(profile, cell, split.input, split.input_below)
                own_weight = _split_stage(profile, cell, split.weight, split.weight_below)
            weight[s] = own_weight + passes
            stage_b[s] = own_input + cost / 2 + weight[s]
    transfer = [delay + n * profile.layers[cell.stop - 1].output_bytes / rate for cell in bounds[:-1]]
    # Selective re-materialization as measured under its own wrapper; unmeasured, it is charged as the whole replay.
    selective = checkpoint == "selective" and bool(profile.selective_recompute)
    extra = profile.recompute_times(n, selective=selective)
    wrapped = [0.0] * S
    if extra is not None:  # measured: the replayed forward and the checkpoint's hooks on every saved tensor
        first = profile.recompute_forward_times(n, selective=selective)  # the hooks' share in the first forward
        wrapped = [sum(first[i] for i in cell) for cell in bounds]
        recompute = [
            sum(extra[i] for i in cell) - share + profile.recompute_call
            for cell, share in zip(bounds, wrapped, strict=True)
        ]
    else:  # a re-materialized backward repeats the layers' forward and pays the checkpoint wrapper's own work
        recompute = [sum(forward[i] for i in cell) + replay for cell in bounds]
    update = [profile.stage_update(cell) for cell in bounds]
    step = simulate_step(
        schedule,
        stage_f,
        stage_b,
        M,
        transfer=transfer,
        recompute=recompute,
        checkpoint_stop=stop,
        update=update,
        checkpoint_forward=wrapped,
        first_send_parked=kind == "cpu" if first_send_parked is None else first_send_parked,
        weight=weight,
        virtual_stages=virtual_stages,
    )
    memory = tuple(
        process_memory(
            profile,
            bounds,
            rank=r,
            num_processes=K,
            num_microbatches=M,
            microbatch_size=n,
            batch_size=per_replica,
            checkpoint=checkpoint,
            schedule=schedule,
            virtual_stages=virtual_stages,
            optimizer_slots=optimizer_slots,
            compiled=compiled,
        )
        for r in range(K)
    )
    allreduce = 0.0
    if replicas > 1:
        held = [[i for s, cell in enumerate(bounds) if owner[s] == r for i in cell] for r in range(K)]
        grads = max(sum(profile.layers[i].trainable_bytes for i in layers) for layers in held)
        allreduce = 2 * (replicas - 1) / replicas * grads / rate
    return Candidate(
        K,
        replicas,
        M,
        n,
        tuple(balance),
        checkpoint,
        schedule,
        step.makespan + allreduce,
        step.bubble,
        memory,
        step.busy,
        batch_size,
        virtual_stages if schedule == "interleaved" else 1,
    )


def _search(
    profile: ModelProfile,
    pipe_sizes: Sequence[int],
    devices: int,
    batch_size: int,
    chunks: Sequence[int] | None,
    checkpoints: Sequence[CheckpointMode],
    schedules: Sequence[str],
    smallest: int = 1,
    per_pipeline: bool = False,
    virtual_stages: Sequence[int] = DEFAULT_VIRTUAL_STAGES,
    **options: Any,
) -> list[Candidate]:
    found: list[Candidate] = []
    for K in pipe_sizes:
        replicas = devices // K
        # A pipeline's batch is fixed (a DataLoader's batch_size under the strategy): replicas add samples per step.
        total = batch_size * replicas if per_pipeline else batch_size
        per_replica = math.ceil(total / replicas)
        for M in _microbatch_counts(per_replica, chunks, smallest):
            for mode in checkpoints:
                for schedule in schedules:
                    for v in _virtual_stages(schedule, K, M, len(profile), virtual_stages):
                        by_time = evaluate(
                            profile,
                            pipe_size=K,
                            chunks=M,
                            batch_size=total,
                            checkpoint=mode,
                            schedule=schedule,
                            replicas=replicas,
                            virtual_stages=v,
                            **options,
                        )
                        found.append(by_time)
                        if K > 1:
                            found.append(_memory_balanced(profile, by_time, total, options))
    return found


def _split_stage(profile: ModelProfile, cell: range, own: Sequence[float], per_node: Sequence[float]) -> float:
    """Seconds of one pass of a stage's split backward: its layers' own, and what each pays per autograd node of the
    layers before it in the stage (the walks per group of parameters go down the whole graph below)."""
    total, below = 0.0, 0
    for i in cell:
        total += own[i] + per_node[i] * below
        below += profile.layers[i].graph_nodes
    return total


def _virtual_stages(schedule: str, K: int, M: int, layers: int, weighed: Sequence[int]) -> list[int]:
    """The ``virtual_stages`` to weigh for ``schedule`` on K processes and M micro-batches: ``[1]`` for the schedules
    of one stage per process; for ``"interleaved"`` each of ``weighed`` whose K·v stages the layers fill and whose
    rounds split M (Megatron-Core's rule, relaxed as torch's), for ``"zbv"`` ``[1]`` if 2K stages fit; none at K = 1,
    where stages on one process only add the engine's cost per stage."""
    if schedule == "interleaved":
        return [v for v in weighed if K > 1 and K * v <= layers and M % max(1, M // K) == 0]
    if schedule == "zbv":
        return [1] if K > 1 and layers >= 2 * K else []
    return [1]


def _memory_balanced(profile: ModelProfile, like: Candidate, batch_size: int, options: dict[str, Any]) -> Candidate:
    """The same configuration with the layers balanced by the bytes each holds instead of by time."""
    n, slots = like.microbatch_size, options.get("optimizer_slots", 2.0)
    held = like.chunks if like.schedule == "gpipe" else like.pipe_size  # micro-batches in flight, about
    costs = [
        layer.param_bytes
        + layer.buffer_bytes
        + layer.trainable_bytes * (1 + slots)
        + n * (layer.saved_bytes if like.checkpoint == "never" else layer.saved_bytes / max(1, held))
        # A selective micro-batch keeps its kept operators' outputs until its backward.
        + (n * held * (layer.selective_bytes + layer.selective_output_bytes) if like.checkpoint == "selective" else 0)
        for layer in profile.layers
    ]
    return evaluate(
        profile,
        pipe_size=like.pipe_size,
        chunks=like.chunks,
        batch_size=batch_size,
        checkpoint=like.checkpoint,
        schedule=like.schedule,
        balance=balance_by_cost(costs, len(like.balance)),
        replicas=like.replicas,
        virtual_stages=like.virtual_stages,
        **options,
    )


def _key(candidate: Candidate) -> tuple[float, float, int]:
    # The fastest per sample (per step when the batch is fixed); among equally fast ones (within 1%), the one with the
    # most memory to spare, then the one that recomputes least (at M = 1 "except_last" is "never" by another name);
    # "selective" only when it wins on time or memory: a profile that did not measure it predicts it as "except_last".
    recompute = ("never", "except_last", "selective", "always").index(candidate.checkpoint)
    return (round(math.log(max(candidate.time_per_sample, 1e-15)) / math.log(1.01)), candidate.peak, recompute)


def _speed(candidate: Candidate, per_sample: bool) -> str:
    """A candidate's predicted speed, per sample first when candidates train on different numbers of samples."""
    step = f"{candidate.step_time * 1e3:.1f} ms per step"
    if not per_sample:
        return step
    pipelines = f"{candidate.replicas} pipelines of {candidate.samples // candidate.replicas}"
    shape = f", {pipelines}" if candidate.replicas > 1 else ""
    return f"{candidate.time_per_sample * 1e3:.3g} ms per sample ({step} of {candidate.samples} samples{shape})"


def _not_weighed(schedule: str, K: int, layers: int) -> str:
    """Why ``schedule``, several stages per process, was not weighed at the chosen K (see :func:`_virtual_stages`)."""
    if K == 1:
        why = "at K=1 its stages would share one process, which only adds the engine's cost per stage"
    elif schedule == "zbv":
        why = f"its {2 * K} stages need at least as many layers, and the model has {layers}"
    else:
        why = (
            f"it needs K·v stages of at least one layer each ({layers} layers) and M in rounds of about K "
            f"micro-batches (M <= {K} or a multiple of {K}), which no weighed M and virtual_stages gave"
        )
    return f"schedule={schedule!r} is not weighed at K={K}: {why}"


def _reasons(
    best: Candidate, fitting: list[Candidate], every: list[Candidate], budget: float, skipped: Sequence[str] = ()
) -> list[str]:
    reasons: list[str] = list(skipped)
    # With a batch per pipeline, K decides how many samples a step trains on: only times per sample compare.
    per_sample = len({c.samples for c in every}) > 1

    def best_of(pool: list[Candidate]) -> Candidate | None:
        return min(pool, key=_key) if pool else None

    for K in sorted({c.pipe_size for c in every}):
        if best.pipe_size == K:
            continue
        fits = best_of([c for c in fitting if c.pipe_size == K])
        if fits is None:
            least = min((c for c in every if c.pipe_size == K), key=lambda c: c.peak)
            reasons.append(f"K={K} does not fit: at best {_gib(least.peak)} per device > {_gib(budget)}")
        elif _key(fits)[0] == _key(best)[0]:
            reasons.append(
                f"K={K} fits and is as fast, {_speed(fits, per_sample)}, but peaks at {_gib(fits.peak)}, at best "
                f"with {fits.label()}"
            )
        else:
            reasons.append(f"K={K} fits but is slower: {_speed(fits, per_sample)}, at best with {fits.label()}")
    same_pipe = [c for c in every if c.pipe_size == best.pipe_size]
    variants = sorted({(c.schedule, c.virtual_stages) for c in same_pipe}, key=lambda s: (SCHEDULES.index(s[0]), s[1]))
    for variant in variants:
        if variant == (best.schedule, best.virtual_stages):
            continue
        pool = [c for c in same_pipe if (c.schedule, c.virtual_stages) == variant]
        name, fits = pool[0].schedule_label, best_of([c for c in pool if c.peak <= budget])
        if fits is None:
            least = min(pool, key=lambda c: c.peak)
            reasons.append(
                f"{name} does not fit: at best {_gib(least.peak)} with M={least.chunks}, "
                f"checkpoint={least.checkpoint!r}"
            )
        elif _key(fits)[0] == _key(best)[0]:
            reasons.append(
                f"{name} is as fast, peaking at {_gib(fits.peak)} with M={fits.chunks}, checkpoint={fits.checkpoint!r}"
            )
        else:
            reasons.append(
                f"{name} is slower: {_speed(fits, per_sample)}, bubble {fits.bubble:.0%}, at best with "
                f"M={fits.chunks}, checkpoint={fits.checkpoint!r}"
            )
    same_k = [c for c in same_pipe if (c.schedule, c.virtual_stages) == (best.schedule, best.virtual_stages)]
    for mode in CHECKPOINT_MODES:
        if mode == best.checkpoint:
            continue
        pool = [c for c in same_k if c.checkpoint == mode]
        fits = best_of([c for c in pool if c.peak <= budget])
        if fits is None and pool:
            least = min(pool, key=lambda c: c.peak)
            reasons.append(f"checkpoint={mode!r} does not fit: at best {_gib(least.peak)} with M={least.chunks}")
        elif fits is not None and _key(fits)[0] == _key(best)[0]:
            reasons.append(f"checkpoint={mode!r} is as fast, peaking at {_gib(fits.peak)} with M={fits.chunks}")
        elif fits is not None:
            reasons.append(
                f"checkpoint={mode!r} is slower: {fits.step_time * 1e3:.1f} ms per step with M={fits.chunks}"
            )
    for count in sorted({c.chunks for c in same_k}):
        if count == best.chunks:
            continue
        pool = [c for c in same_k if c.chunks == count and c.checkpoint == best.checkpoint]
        fits = best_of([c for c in pool if c.peak <= budget])
        if fits is None and pool:
            reasons.append(f"M={count} does not fit ({_gib(min(c.peak for c in pool))})")
        elif fits is not None:
            reasons.append(f"M={count}: {fits.step_time * 1e3:.1f} ms per step, bubble {fits.bubble:.0%}")
    reasons.append(
        f"chosen: the fastest configuration that fits, {_speed(best, per_sample)}, bubble {best.bubble:.0%}, peak "
        f"{_gib(best.peak)} of {_gib(budget)}"
    )
    return reasons


def _smallest_microbatch(layers: nn.Module) -> int:
    # Training-mode BatchNorm needs two samples per channel; a micro-batch of one would fail (or, on a 1x1 map,
    # raise "Expected more than 1 value per channel").
    return 2 if any(isinstance(m, BatchNormBase) for m in layers.modules()) else 1


def _batch_norm_pipe_sizes(
    pipe_sizes: list[int], devices: int, batch_size: int, per_pipeline: bool, smallest: int
) -> tuple[list[int], list[str]]:
    """The K whose pipelines read at least ``smallest`` samples per step, and why the others are not weighed.

    Raises:
        ValueError: no K does; the message names the micro-batch size and the batch that would do.
    """
    kept: list[int] = []
    skipped: list[str] = []
    for K in pipe_sizes:
        replicas = devices // K
        per_replica = batch_size if per_pipeline else math.ceil(batch_size / replicas)
        if per_replica >= smallest:
            kept.append(K)
            continue
        need = smallest if per_pipeline else smallest * replicas
        skipped.append(
            f"K={K} is not weighed: its micro-batches would hold {per_replica} sample(s) ({replicas} pipeline(s) of "
            f"{per_replica}), and BatchNorm needs at least {smallest} per micro-batch in training "
            f"(batch_size={need} would do)"
        )
    if not kept:
        K = max(pipe_sizes)
        replicas = devices // K
        per_replica = batch_size if per_pipeline else math.ceil(batch_size / replicas)
        need = smallest if per_pipeline else smallest * replicas
        raise ValueError(
            f"batch_size={batch_size} on devices={devices} gives micro-batches of {per_replica} sample(s) even at "
            f"K={K} ({replicas} pipeline(s) of {per_replica}, one micro-batch each), but the model's BatchNorm layers "
            f"need at least {smallest} samples per micro-batch in training (torch would stop with 'Expected more "
            f"than 1 value per channel'). HINT: use batch_size >= {need}, or replace BatchNorm by GroupNorm or "
            "LayerNorm"
        )
    return kept, skipped


def _layers_of(model: nn.Module) -> nn.Sequential:
    if isinstance(model, nn.Sequential):
        return model
    from lightning_gpipe.partition.sequence import find_sequence

    return find_sequence(model)[1]


def plan(
    model: nn.Module,
    sample: Any,
    *,
    devices: int,
    memory_per_device: float | str,
    batch_size: int,
    device: Any = None,
    loss_fn: Callable[[Any], Tensor] | None = None,
    optimizer_slots: float = 2.0,
    chunks: Sequence[int] | None = None,
    checkpoints: Sequence[str] = CHECKPOINT_MODES,
    schedules: Sequence[str] = SCHEDULES,
    bandwidth: float | None = None,
    latency: float | None = None,
    overhead: float | None = None,
    boundary_overhead: float | None = None,
    flops_per_second: float | None = None,
    profile: ModelProfile | None = None,
    pipe_sizes: Sequence[int] | None = None,
    per_pipeline_batch: bool = False,
    optimizer: OptimizerFactory | None = torch.optim.Adam,
    compiled: bool = False,
    virtual_stages: Sequence[int] = DEFAULT_VIRTUAL_STAGES,
) -> Plan:
    """Choose K, M, balance, checkpoint mode and schedule for training ``model`` on ``devices`` devices.

    Args:
        model: an ``nn.Sequential`` or a module holding one (a zoo model, a LightningModule); real or on meta.
        sample: input of the first layer with a batch dimension (any number of rows), on the target device.
        devices: how many devices (processes) the job has; K divides it, the rest are data-parallel replicas.
        memory_per_device: bytes, or a string such as ``"16GB"``.
        batch_size: samples per optimizer step, over all replicas.
        device: where to profile; defaults to the sample's device.
        loss_fn: ``loss_fn(last_output) -> scalar``, profiled with the last layer (the loss's own activations).
        optimizer_slots: parameter-sized optimizer tensors per parameter: 2 for Adam, 1 for SGD with momentum.
        optimizer: builds the optimizer whose step is timed per layer (on copies), from a list of parameters: give
            the one training will use (``functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)``), ``None`` to
            leave the step out of the predicted step time.
        chunks: the M values to consider; default the powers of two up to the per-replica batch.
        checkpoints: the re-materialization modes to consider.
        schedules: the schedules to consider; default all five
            (:data:`~lightning_gpipe.engine.schedule.SCHEDULES`).
        bandwidth: bytes per second across a stage boundary (default by device type: ``DEFAULT_BANDWIDTH``).
        latency: seconds per boundary message (default by device type: ``DEFAULT_LATENCY``).
        overhead: the engine's seconds per micro-batch and stage (default: ``DEFAULT_MICROBATCH_OVERHEAD``).
        boundary_overhead: a stage's seconds per micro-batch and boundary (default: ``DEFAULT_BOUNDARY_OVERHEAD``).
        flops_per_second: time layers from their FLOPs at this rate instead of measuring them.
        profile: a profile made earlier with :func:`profile_layers` (skips profiling).
        pipe_sizes: the K values to consider (each must divide ``devices``); default every divisor.
        per_pipeline_batch: ``batch_size`` is what each pipeline reads per step (a DataLoader's ``batch_size`` under
            :class:`~lightning_gpipe.GPipeStrategy`, where ``devices / K`` replicas read that many each), not the
            whole step's; configurations are then ranked by time per sample.
        compiled: the stages' layers will be compiled (``compile=True``): ``"selective"`` then re-materializes
            every micro-batch, the last included.
        virtual_stages: the stages per process to weigh for ``"interleaved"`` (each v with K·v at most the layers and
            M in rounds that split it; none at K = 1).

    Raises:
        InfeasiblePlanError: nothing fits; the message names the smallest device count and memory that would.
        ValueError: bad arguments (the message names the value and the fix).
    """
    budget = parse_bytes(memory_per_device)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices={devices!r} must be an int >= 1: the number of processes of the job")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be an int >= 1: the samples of one optimizer step")
    modes = [validate_mode(mode) for mode in checkpoints]
    kinds = [validate_schedule(name) for name in schedules]
    if isinstance(virtual_stages, (str, int)) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 2 for v in virtual_stages
    ):
        raise ValueError(
            f"virtual_stages={virtual_stages!r} must be a list of ints >= 2: the stages per process to weigh for "
            "schedule='interleaved'"
        )
    layers = _layers_of(model)
    L = len(layers)
    divisors = [K for K in range(1, min(devices, L) + 1) if devices % K == 0]
    if pipe_sizes is not None:
        wrong = [K for K in pipe_sizes if K not in divisors]
        if wrong or not pipe_sizes:
            raise ValueError(
                f"pipe_sizes={list(pipe_sizes)!r}: each K must divide devices={devices} and be at most the {L} "
                f"layers; choose among {divisors}"
            )
        divisors = sorted(set(pipe_sizes))
    smallest = _smallest_microbatch(layers)
    divisors, skipped = _batch_norm_pipe_sizes(divisors, devices, batch_size, per_pipeline_batch, smallest)
    if profile is None:
        sizes: set[int] = set()
        for K in divisors:
            replicas = devices // K
            per_replica = batch_size if per_pipeline_batch else math.ceil(batch_size / replicas)
            sizes |= {microbatch_sizes(per_replica, m)[0] for m in _microbatch_counts(per_replica, chunks, smallest)}
        profile = profile_layers(
            layers,
            sample,
            microbatch_sizes=sorted(sizes),
            device=device,
            loss_fn=loss_fn,
            flops_per_second=flops_per_second,
            rematerialized=any(mode not in ("never", "selective") for mode in modes),
            optimizer=optimizer,
            selective="selective" in modes,
            split=any(name in SPLIT_BACKWARD for name in kinds),
        )
    options: dict[str, Any] = {
        "optimizer_slots": optimizer_slots,
        "bandwidth": bandwidth,
        "latency": latency,
        "overhead": overhead,
        "boundary_overhead": boundary_overhead,
        "compiled": compiled,
        "virtual_stages": tuple(virtual_stages),  # weighed by _search, which passes the others on to evaluate
    }
    every = _search(
        profile, divisors, devices, batch_size, chunks, modes, kinds, smallest, per_pipeline_batch, **options
    )
    fitting = [c for c in every if c.peak <= budget]
    if not fitting:
        raise _infeasible(profile, devices, budget, batch_size, chunks, modes, kinds, every, smallest, options)
    best = min(fitting, key=_key)
    unweighed = [name for name in kinds if name not in {c.schedule for c in every if c.pipe_size == best.pipe_size}]
    skipped += [_not_weighed(name, best.pipe_size, len(profile)) for name in unweighed]
    reasons = _reasons(best, fitting, every, budget, skipped)
    ranked = tuple(sorted(fitting, key=_key)[:10])
    return Plan(best, devices, budget, batch_size, tuple(reasons), ranked, profile, per_pipeline_batch)


def _infeasible(
    profile: ModelProfile,
    devices: int,
    budget: float,
    batch_size: int,
    chunks: Sequence[int] | None,
    modes: list[CheckpointMode],
    kinds: list[str],
    every: list[Candidate],
    smallest: int,
    options: dict[str, Any],
) -> InfeasiblePlanError:
    least = min(every, key=lambda c: c.peak)
    min_devices: int | None = None
    for K in range(devices + 1, len(profile) + 1):
        # One pipeline of K devices, each with the asked memory, the thriftiest settings first.
        if any(
            c.peak <= budget for c in _search(profile, [K], K, batch_size, chunks, modes, kinds, smallest, **options)
        ):
            min_devices = K
            break
    more = (
        f"{min_devices} devices of {_gib(budget)} fit"
        if min_devices is not None
        else f"no pipeline of up to {len(profile)} devices (one layer each) fits {_gib(budget)}"
    )
    message = (
        f"nothing fits {devices} device(s) with {_gib(budget)} each for batch {batch_size}: the thriftiest "
        f"configuration ({least.label()}) peaks at {_gib(least.peak)} per device. HINT: {more}, or give each of the "
        f"{devices} device(s) at least {_gib(least.peak)}; a smaller batch_size or optimizer state also helps."
    )
    return InfeasiblePlanError(message, min_devices=min_devices, min_memory=least.peak)
