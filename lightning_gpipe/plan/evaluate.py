"""One configuration weighed: its step time (simulated from the profile's pass times) and its memory per process.

:func:`evaluate` predicts what K, M, a balance, a re-materialization mode and a schedule give for a mini-batch; the
``DEFAULT_*`` figures are what the engine and its links cost beyond the layers' profiled passes, by device type,
measured by ``benchmarks.plan_calibration`` (see docs/benchmarks/plan.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_gpipe.engine.microbatch import microbatch_sizes
from lightning_gpipe.engine.rematerialization import CheckpointMode, checkpoint_stop
from lightning_gpipe.engine.schedule import SPLIT_BACKWARD, stage_table
from lightning_gpipe.partition.balance import balance_by_cost, cell_bounds, checked_entries
from lightning_gpipe.partition.config import DataParallel
from lightning_gpipe.plan.memory import StageMemory, process_memory
from lightning_gpipe.plan.result import Candidate
from lightning_gpipe.plan.sharding import Sharing
from lightning_gpipe.plan.simulate import simulate_step
from lightning_gpipe.profile.layer_profile import LayerProfile, ModelProfile

__all__ = [
    "DEFAULT_BANDWIDTH",
    "DEFAULT_BOUNDARY_OVERHEAD",
    "DEFAULT_LATENCY",
    "DEFAULT_MICROBATCH_OVERHEAD",
    "DEFAULT_REMATERIALIZATION_OVERHEAD",
    "evaluate",
]

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
    data_parallel: DataParallel = "ddp",
) -> Candidate:
    """Predict one configuration: step time, bubble and per-process memory for a mini-batch of ``batch_size`` samples.

    ``batch_size`` is the whole mini-batch; each of ``replicas`` pipelines gets its share, split into micro-batches
    as the engine splits it (:func:`~lightning_gpipe.engine.microbatch.microbatch_sizes`). ``pipe_size`` is K; under
    ``"interleaved"`` (``virtual_stages=v``) and ``"zbv"`` (two) each process holds several stages, and ``balance``,
    the layers per stage (default: the one that best balances the stages' pass times), has one entry per stage.
    ``bandwidth``, ``latency``, ``overhead`` and ``boundary_overhead`` default by device type (``DEFAULT_*``: see
    :class:`_EngineCosts`); ``first_send_parked`` (default: on CPU stages, whose transport is gloo) holds each
    stage's first message until its next forward (:func:`~lightning_gpipe.plan.simulate.simulate_step`).
    ``compiled`` layers re-materialize every micro-batch under ``"selective"``, the last included.
    ``data_parallel`` is how the ``replicas`` of each stage share it (:mod:`~lightning_gpipe.plan.sharding`): whole,
    their gradients all-reduced after the step (``"ddp"``), or sharded (``"fsdp"``, with more than one replica): the
    parameters gathered before a process's first action, each stage's gradients reduce-scattered before its optimizer
    step, which then updates a shard.

    Raises:
        ValueError: ``virtual_stages`` that the schedule does not take, a ``balance`` of another number of stages, or
            (``"interleaved"``) ``chunks`` its rounds cannot split.
    """
    table = stage_table(schedule, pipe_size, virtual_stages)  # refuses a virtual_stages the schedule does not take
    sizes = microbatch_sizes(math.ceil(batch_size / replicas), chunks)  # as the engine splits each replica's batch
    M, n = len(sizes), sizes[0]  # the largest micro-batch sets each pass's time and bytes
    forward, backward = profile.pass_times(n)
    stop = checkpoint_stop(checkpoint, M, compiled=compiled)
    cells = cell_bounds(_stage_balance(balance, forward, backward, stop / M, schedule, table))
    costs = _EngineCosts.of(profile, bandwidth, latency, overhead, boundary_overhead)
    owner = {s: r for r, held in enumerate(table) for s in held}
    sharing = Sharing.of(data_parallel, replicas)
    held = _process_layers(profile, cells, owner, pipe_size)
    stage_f, stage_b, weight = _stage_times(profile, cells, owner, schedule, n, (forward, backward), costs)
    transfer = [costs.latency + n * profile.layers[cell.stop - 1].output_bytes / costs.bandwidth for cell in cells[:-1]]
    wrapped, recompute = _recompute_times(profile, cells, checkpoint, n, forward, costs.replay)
    parked = costs.kind == "cpu" if first_send_parked is None else first_send_parked
    step = simulate_step(
        schedule, stage_f, stage_b, M, transfer=transfer, recompute=recompute, checkpoint_stop=stop,
        update=_updates(profile, cells, sharing, costs.bandwidth), checkpoint_forward=wrapped,
        first_send_parked=parked, weight=weight, virtual_stages=virtual_stages,
        ready=[sharing.gather_seconds(layers, costs.bandwidth) for layers in held],
    )  # fmt: skip
    memory = _memory(
        profile, cells, pipe_size, n, sizes, checkpoint, schedule, virtual_stages, optimizer_slots, compiled, sharing
    )
    step_time = step.makespan + max(sharing.allreduce_seconds(layers, costs.bandwidth) for layers in held)
    v = virtual_stages if schedule == "interleaved" else 1
    balanced = tuple(len(cell) for cell in cells)
    return Candidate(
        pipe_size, replicas, M, n, balanced, checkpoint, schedule, step_time, step.bubble, memory, step.busy,
        batch_size, v, sharing.data_parallel,
    )  # fmt: skip


@dataclass(frozen=True)
class _EngineCosts:
    """What the engine and its links cost beyond the layers' passes, on one kind of device.

    The engine's cost per micro-batch and stage is split evenly between forward and backward; a re-materialized
    micro-batch adds :data:`DEFAULT_REMATERIALIZATION_OVERHEAD`, scaled alike when the engine's cost is given. A stage
    pays the boundary cost per micro-batch and boundary to another process.
    """

    kind: str  # the profile's device type
    bandwidth: float  # bytes per second across a boundary
    latency: float  # seconds per boundary message
    engine: float  # seconds per micro-batch and stage
    boundary: float  # seconds per micro-batch and boundary to another process
    replay: float  # seconds a re-materialized micro-batch adds, where the profile did not measure it

    @classmethod
    def of(
        cls,
        profile: ModelProfile,
        bandwidth: float | None,
        latency: float | None,
        overhead: float | None,
        boundary_overhead: float | None,
    ) -> _EngineCosts:
        """The given figures, the others by the profile's device type."""
        kind = profile.device.split(":")[0]
        engine = overhead if overhead is not None else DEFAULT_MICROBATCH_OVERHEAD.get(kind, 0.0)
        # Scaled alike when an overhead is given: the re-materialized share keeps its measured ratio to the plain one.
        base = DEFAULT_MICROBATCH_OVERHEAD.get(kind, 0.0)
        return cls(
            kind,
            bandwidth if bandwidth is not None else DEFAULT_BANDWIDTH.get(kind, 2e9),
            latency if latency is not None else DEFAULT_LATENCY.get(kind, 1e-4),
            engine,
            boundary_overhead if boundary_overhead is not None else DEFAULT_BOUNDARY_OVERHEAD.get(kind, 0.0),
            DEFAULT_REMATERIALIZATION_OVERHEAD.get(kind, 0.0) * (engine / base if base > 0 else 0.0),
        )


def _stage_balance(
    balance: Sequence[int] | None,
    forward: list[float],
    backward: list[float],
    replayed: float,
    schedule: str,
    table: tuple[tuple[int, ...], ...],
) -> list[int]:
    """``balance`` checked against the stages, or the one that best balances the stages' pass times, where a share
    ``replayed`` of the micro-batches repeats its forward."""
    K, S = len(table), len(table) * len(table[0])
    if balance is None:
        return balance_by_cost([f + b + replayed * f for f, b in zip(forward, backward, strict=True)], S)
    entries = checked_entries(balance)
    if len(entries) != S:
        raise ValueError(
            f"balance={entries} has {len(entries)} stages, but schedule={schedule!r} on K={K} processes has {S}: "
            "give one number of layers per stage"
        )
    return entries


def _stage_times(
    profile: ModelProfile,
    cells: list[range],
    owner: dict[int, int],
    schedule: str,
    n: int,
    passes: tuple[list[float], list[float]],
    costs: _EngineCosts,
) -> tuple[list[float], list[float], list[float]]:
    """Each stage's forward, backward and weight-pass seconds for a micro-batch of ``n`` samples, from each layer's
    forward and backward ``passes``.

    Per micro-batch, each stage pays the engine's own cost and that of each boundary to another process (a middle stage
    two; two neighbouring stages on one process pass their values in memory), half in each direction. The zero-bubble
    schedules' input and weight passes I and W are the profile's times of the engine's split
    (``profile_layers(split=True)``), each layer's own plus what it pays per autograd node of the layers before it in
    its stage: on the first stage, whose input takes no gradient, I only walks the graph and W runs the whole
    backward. W also pays the engine's cost of one pass. A profile without them (from FLOPs) takes W as half the
    backward of each layer with trainable parameters (a linear layer's input and weight gradients are one matrix
    product each).
    """
    forward, backward = passes
    S = len(cells)
    remote = [sum(0 <= t < S and owner[t] != owner[s] for t in (s - 1, s + 1)) for s in range(S)]
    host = [costs.engine + costs.boundary * links for links in remote]
    extra = costs.engine / 2 if schedule in SPLIT_BACKWARD else 0.0  # W: one pass more, paying as F and I do
    stage_f = [sum(forward[i] for i in cell) + cost / 2 for cell, cost in zip(cells, host, strict=True)]
    stage_b = [sum(backward[i] for i in cell) + cost / 2 + extra for cell, cost in zip(cells, host, strict=True)]
    weight = [sum(backward[i] / 2 for i in cell if profile.layers[i].trainable_bytes) + extra for cell in cells]
    split = profile.split_times(n) if schedule in SPLIT_BACKWARD else None
    if split is not None:  # measured: the engine's split costs more than the whole backward (its walk, its calls)
        for s, (cell, cost) in enumerate(zip(cells, host, strict=True)):
            if s == 0:  # its input takes no gradient: the input pass only walks the graph, the weight pass is whole
                own_input, own_weight = sum(split.walk[i] for i in cell), sum(backward[i] for i in cell)
            else:
                own_input = _split_stage(profile, cell, split.input, split.input_below)
                own_weight = _split_stage(profile, cell, split.weight, split.weight_below)
            weight[s] = own_weight + extra
            stage_b[s] = own_input + cost / 2 + weight[s]
    return stage_f, stage_b, weight


def _split_stage(profile: ModelProfile, cell: range, own: Sequence[float], per_node: Sequence[float]) -> float:
    """Seconds of one pass of a stage's split backward: its layers' own, and what each pays per autograd node of the
    layers before it in the stage (the walks per group of parameters go down the whole graph below)."""
    total, below = 0.0, 0
    for i in cell:
        total += own[i] + per_node[i] * below
        below += profile.layers[i].graph_nodes
    return total


def _recompute_times(
    profile: ModelProfile, cells: list[range], checkpoint: CheckpointMode, n: int, forward: list[float], replay: float
) -> tuple[list[float], list[float]]:
    """Each stage's seconds that re-materialization adds to a micro-batch: in its forward, and in its backward.

    Selective re-materialization as measured under its own wrapper; unmeasured, it is charged as the whole replay.
    """
    selective = checkpoint == "selective" and bool(profile.selective_recompute)
    extra = profile.recompute_times(n, selective=selective)
    if extra is None:  # a re-materialized backward repeats the layers' forward and pays the checkpoint wrapper's work
        return [0.0] * len(cells), [sum(forward[i] for i in cell) + replay for cell in cells]
    # Measured: the replayed forward and the checkpoint's hooks on every saved tensor, their share in the first forward.
    first = profile.recompute_forward_times(n, selective=selective)
    wrapped = [sum(first[i] for i in cell) for cell in cells]
    recompute = [
        sum(extra[i] for i in cell) - share + profile.recompute_call for cell, share in zip(cells, wrapped, strict=True)
    ]
    return wrapped, recompute


def _memory(
    profile: ModelProfile,
    cells: list[range],
    K: int,
    n: int,
    sizes: list[int],
    checkpoint: CheckpointMode,
    schedule: str,
    virtual_stages: int,
    optimizer_slots: float,
    compiled: bool,
    sharing: Sharing,
) -> tuple[StageMemory, ...]:
    """Each process's peak memory (its stages together, shared among their replicas as ``sharing`` says) over a step
    of micro-batches of ``sizes`` samples."""
    return tuple(
        process_memory(
            profile,
            cells,
            rank=r,
            num_processes=K,
            num_microbatches=len(sizes),
            microbatch_size=n,
            batch_size=sum(sizes),
            checkpoint=checkpoint,
            schedule=schedule,
            virtual_stages=virtual_stages,
            optimizer_slots=optimizer_slots,
            compiled=compiled,
            data_parallel=sharing.data_parallel,
            replicas=sharing.replicas,
        )
        for r in range(K)
    )


def _process_layers(
    profile: ModelProfile, cells: list[range], owner: dict[int, int], K: int
) -> list[list[LayerProfile]]:
    """The layers each of the ``K`` processes holds, its stages together."""
    held: list[list[LayerProfile]] = [[] for _ in range(K)]
    for s, cell in enumerate(cells):
        held[owner[s]] += [profile.layers[i] for i in cell]
    return held


def _updates(profile: ModelProfile, cells: list[range], sharing: Sharing, bandwidth: float) -> list[float]:
    """Each stage's seconds after its last action: under ``"fsdp"`` its gradients' reduce-scatter, then its optimizer
    step (over its shards)."""
    return [
        sharing.reduce_seconds([profile.layers[i] for i in cell], bandwidth) + sharing.update_seconds(profile, cell)
        for cell in cells
    ]
