"""The planner's search: every configuration that a model, a device count and a batch allow, weighed, the best kept.

:func:`plan` profiles the model's layers (:func:`~lightning_gpipe.profile.layer_profile.profile_layers`), then, for
every pipeline size K that divides the device count, every M, both balances (by time and by memory), every checkpoint
mode and schedule (``"interleaved"`` with each of a few ``virtual_stages``), predicts each configuration
(:func:`~lightning_gpipe.plan.evaluate.evaluate`) and keeps the fastest that fits.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gpipe.engine.microbatch import microbatch_sizes
from lightning_gpipe.engine.rematerialization import CHECKPOINT_MODES, CheckpointMode, validate_mode
from lightning_gpipe.engine.schedule import SCHEDULES, SPLIT_BACKWARD, validate_schedule
from lightning_gpipe.engine.torch_compat import BatchNormBase
from lightning_gpipe.partition.balance import balance_by_cost
from lightning_gpipe.partition.config import DataParallel
from lightning_gpipe.partition.discovery import find_sequence
from lightning_gpipe.plan.evaluate import evaluate
from lightning_gpipe.plan.reasons import data_parallel_reason, not_weighed, reasons
from lightning_gpipe.plan.result import Candidate, InfeasiblePlanError, Plan, format_bytes, parse_bytes
from lightning_gpipe.plan.sharding import PlannedDataParallel, Sharing, check_data_parallel
from lightning_gpipe.profile.layer_profile import ModelProfile, profile_layers
from lightning_gpipe.profile.optimizer_step import OptimizerFactory

__all__ = ["DEFAULT_VIRTUAL_STAGES", "plan"]

DEFAULT_VIRTUAL_STAGES = (2, 3, 4)
"""The stages per process :func:`plan` weighs for ``"interleaved"``: each divides the bubble by ``v`` for ``v`` times
the boundary messages, which past four costs more than it saves on any link the planner knows."""


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
    data_parallel: PlannedDataParallel = "auto",
) -> Plan:
    """Choose K, M, balance, checkpoint mode, schedule and data parallelism for training ``model`` on ``devices``
    devices.

    Args:
        model: an ``nn.Sequential`` or a module holding one (a zoo model, a LightningModule); real or on meta.
        sample: input of the first layer with a batch dimension (any number of rows), on the target device.
        devices: how many devices (processes) the job has; K divides it, the rest are data-parallel replicas.
        memory_per_device: bytes, or a string such as ``"16GB"``.
        batch_size: samples per optimizer step, over all replicas; with ``per_pipeline_batch``, what each pipeline
            reads per step (a DataLoader's ``batch_size`` under the strategy), configurations then ranked per sample.
        device, loss_fn, flops_per_second, optimizer: how to profile (:func:`profile_layers`): where (default: the
            sample's device), the loss of the last output, FLOPs per second to time layers by instead of measuring
            them, the optimizer whose step is timed (the one training will use; ``None`` leaves it out).
        optimizer_slots: parameter-sized optimizer tensors per parameter: 2 for Adam, 1 for SGD with momentum.
        pipe_sizes, chunks, checkpoints, schedules, virtual_stages: the K (each dividing ``devices``; default every
            divisor), M (default the powers of two up to the batch), re-materialization modes, schedules and stages
            per process of ``"interleaved"`` to weigh (a v where K·v stages fill the layers and M splits in rounds).
        bandwidth, latency, overhead, boundary_overhead: a link's bytes per second and seconds per message, the
            engine's seconds per micro-batch and stage, and per boundary (default by device type: ``DEFAULT_*``).
        profile: a profile made earlier with :func:`profile_layers` (skips profiling).
        compiled: the stages' layers will be compiled: ``"selective"`` then re-materializes every micro-batch.
        data_parallel: how the replicas of each stage (``devices / K`` of them) share it: ``"ddp"`` weighs them
            whole, ``"fsdp"`` sharded (a K with one replica runs as ``"ddp"``), ``"auto"`` whole and, only when no
            configuration fits whole, sharded (:mod:`~lightning_gpipe.plan.sharding`). Compiled layers run whole.

    Raises:
        InfeasiblePlanError: nothing fits; the message names the smallest device count and memory that would.
        ValueError: bad arguments (the message names the value and the fix).
    """
    budget = parse_bytes(memory_per_device)
    modes, kinds = _checked(devices, batch_size, checkpoints, schedules, virtual_stages)
    requested = _planned_data_parallel(data_parallel, compiled)
    layers = find_sequence(model)[1] if not isinstance(model, nn.Sequential) else model
    smallest = _smallest_microbatch(layers)
    weighed = _pipe_sizes(pipe_sizes, devices, len(layers))
    weighed, skipped = _batch_norm_pipe_sizes(weighed, devices, batch_size, per_pipeline_batch, smallest)
    costs = {"bandwidth": bandwidth, "latency": latency, "overhead": overhead, "boundary_overhead": boundary_overhead}
    search = _Search(
        None, devices, batch_size, chunks, modes, kinds, tuple(virtual_stages), smallest, per_pipeline_batch,
        {"optimizer_slots": optimizer_slots, "compiled": compiled, **costs}, requested,
    )  # fmt: skip
    if profile is None:
        profile = profile_layers(
            layers, sample, microbatch_sizes=search.profiled_sizes(weighed), device=device, loss_fn=loss_fn,
            flops_per_second=flops_per_second, rematerialized=any(mode not in ("never", "selective") for mode in modes),
            optimizer=optimizer, selective="selective" in modes, split=any(name in SPLIT_BACKWARD for name in kinds),
        )  # fmt: skip
    return replace(search, profile=profile).best(weighed, budget, skipped)


@dataclass(frozen=True)
class _Search:
    """The configurations to weigh for one request, and how to weigh them."""

    profile: ModelProfile | None
    devices: int
    batch_size: int
    chunks: Sequence[int] | None
    modes: list[CheckpointMode]
    kinds: list[str]
    virtual_stages: tuple[int, ...]
    smallest: int  # samples a micro-batch needs at least (BatchNorm: two)
    per_pipeline: bool  # batch_size is each pipeline's
    options: dict[str, Any]  # passed on to evaluate
    data_parallel: PlannedDataParallel = "ddp"  # what to weigh: whole replicas, sharded ones, or sharded if none fits

    def _per_replica(self, K: int) -> tuple[int, int]:
        """The step's samples and each pipeline's at K, for its ``devices / K`` pipelines."""
        replicas = self.devices // K
        # A pipeline's batch is fixed (a DataLoader's batch_size under the strategy): replicas add samples per step.
        total = self.batch_size * replicas if self.per_pipeline else self.batch_size
        return total, math.ceil(total / replicas)

    def profiled_sizes(self, pipe_sizes: Sequence[int]) -> list[int]:
        """The micro-batch sizes the search will weigh, to profile the layers at: the largest of each split."""
        sizes = set()
        for K in pipe_sizes:
            per_replica = self._per_replica(K)[1]
            sizes |= {microbatch_sizes(per_replica, M)[0] for M in self._counts(per_replica)}
        return sorted(sizes)

    def _counts(self, batch: int) -> list[int]:
        """The M values to weigh: ``chunks``, or the powers of two, the engine's micro-batches never under
        ``smallest`` samples."""
        counts = self.chunks if self.chunks is not None else [1 << p for p in range(16)]
        fit = {m for m in counts if 1 <= m <= batch and min(microbatch_sizes(batch, m)) >= self.smallest}
        return sorted(fit or {1})

    def candidates(self, pipe_sizes: Sequence[int], data_parallel: DataParallel = "ddp") -> list[Candidate]:
        """Every configuration weighed at each of ``pipe_sizes``, balanced by time and (K > 1) by memory, its
        replicas sharing each stage as ``data_parallel`` says (whole where a K leaves one replica)."""
        assert self.profile is not None
        found: list[Candidate] = []
        for K in pipe_sizes:
            total, per_replica = self._per_replica(K)
            for M, mode, schedule in itertools.product(self._counts(per_replica), self.modes, self.kinds):
                for v in _virtual_stages(schedule, K, M, len(self.profile), self.virtual_stages):
                    settings = {"pipe_size": K, "chunks": M, "checkpoint": mode, "schedule": schedule}
                    by_time = self._evaluate(
                        batch_size=total, replicas=self.devices // K, virtual_stages=v, data_parallel=data_parallel,
                        **settings,
                    )  # fmt: skip
                    found.append(by_time)
                    if K > 1:
                        found.append(_memory_balanced(self.profile, by_time, total, self.options))
        return found

    def weighed(self, pipe_sizes: Sequence[int], budget: float) -> tuple[list[Candidate], list[Candidate]]:
        """The candidates to choose from, and under ``"auto"`` the whole ones that made it weigh sharded ones: whole
        replicas first, then (``"auto"``, none fitting) sharded ones; ``"fsdp"`` sharded ones only."""
        first: DataParallel = "fsdp" if self.data_parallel == "fsdp" else "ddp"
        every = self.candidates(pipe_sizes, first)
        shardable = [K for K in pipe_sizes if self.devices // K > 1]
        if self.data_parallel != "auto" or not shardable or any(c.peak <= budget for c in every):
            return every, []
        alone = [c for c in every if c.replicas == 1]  # nothing to shard: as they were
        return self.candidates(shardable, "fsdp") + alone, every

    def _evaluate(self, **settings: Any) -> Candidate:
        assert self.profile is not None
        return evaluate(self.profile, **settings, **self.options)

    def best(self, pipe_sizes: Sequence[int], budget: float, skipped: list[str]) -> Plan:
        """The fastest configuration within ``budget`` bytes per device, with the reasons; or the error saying what
        would fit."""
        assert self.profile is not None
        every, whole = self.weighed(pipe_sizes, budget)
        fitting = sorted((c for c in every if c.peak <= budget), key=lambda c: c.preference)
        if not fitting:
            raise self._infeasible(every, budget, whole)
        best = fitting[0]
        weighed = {c.schedule for c in every if c.pipe_size == best.pipe_size}
        skipped += [not_weighed(name, best.pipe_size, len(self.profile)) for name in self.kinds if name not in weighed]
        sharing = data_parallel_reason(best, self.data_parallel, whole, budget)
        why = tuple(reasons(best, every, budget, [*skipped, *sharing]))
        ranked = tuple(fitting[:10])
        return Plan(best, self.devices, budget, self.batch_size, why, ranked, self.profile, self.per_pipeline)

    def _infeasible(self, every: list[Candidate], budget: float, whole: list[Candidate]) -> InfeasiblePlanError:
        assert self.profile is not None
        least = min(every, key=lambda c: c.peak)
        min_devices: int | None = None
        for K in range(self.devices + 1, len(self.profile) + 1):
            # One pipeline of K devices, each with the asked memory, the thriftiest settings first.
            one_pipeline = replace(self, devices=K, per_pipeline=False)
            if any(c.peak <= budget for c in one_pipeline.candidates([K])):
                min_devices = K
                break
        more = (
            f"{min_devices} devices of {format_bytes(budget)} fit"
            if min_devices is not None
            else f"no pipeline of up to {len(self.profile)} devices (one layer each) fits {format_bytes(budget)}"
        )
        message = (
            f"nothing fits {self.devices} device(s) with {format_bytes(budget)} each for batch {self.batch_size}: the "
            f"thriftiest configuration ({least.label()}) peaks at {format_bytes(least.peak)} per device"
            f"{self._sharing_note(every, whole, budget)}. HINT: {more}, or give each of the {self.devices} device(s) "
            f"at least {format_bytes(least.peak)}; a smaller batch_size or optimizer state also helps."
        )
        return InfeasiblePlanError(message, min_devices=min_devices, min_memory=least.peak)

    def _sharing_note(self, every: list[Candidate], whole: list[Candidate], budget: float) -> str:
        """What the replicas could hold, whole and sharded, for the message of a request that nothing fits."""
        if self.devices == 1:
            return ""
        shardable = sorted({c.pipe_size for c in every if c.replicas > 1})
        if not shardable:
            return "; no K weighed leaves a stage several replicas to shard it over (data_parallel='fsdp')"
        parts = []
        if self.data_parallel != "fsdp":
            least = min(whole or every, key=lambda c: c.peak)
            parts.append(f"with whole replicas (data_parallel='ddp') at best {format_bytes(least.peak)}")
        sharded = [c for c in every if c.data_parallel == "fsdp"] or self.candidates(shardable, "fsdp")
        least = min(sharded, key=lambda c: c.peak)
        fits = ", which fits: plan with data_parallel='fsdp' or 'auto'" if least.peak <= budget else ""
        parts.append(f"sharded over them (data_parallel='fsdp') at best {format_bytes(least.peak)}{fits}")
        return "; " + ", ".join(parts)


def _memory_balanced(profile: ModelProfile, like: Candidate, batch_size: int, options: dict[str, Any]) -> Candidate:
    """The same configuration with the layers balanced by the bytes each holds instead of by time."""
    n, slots = like.microbatch_size, options.get("optimizer_slots", 2.0)
    held = like.chunks if like.schedule == "gpipe" else like.pipe_size  # micro-batches in flight, about
    selective = like.checkpoint == "selective"
    sharing = Sharing.of(like.data_parallel, like.replicas)
    costs = [
        sharing.state([layer], slots)
        # Sharded, a step also holds the layer's parameters gathered and its gradients whole.
        + sharing.gathered([layer])
        + sharing.gradients([layer])[0]
        + n * (layer.saved_bytes if like.checkpoint == "never" else layer.saved_bytes / max(1, held))
        # A selective micro-batch keeps its kept operators' outputs until its backward.
        + (n * held * (layer.selective_bytes + layer.selective_output_bytes) if selective else 0)
        for layer in profile.layers
    ]
    return evaluate(
        profile, pipe_size=like.pipe_size, chunks=like.chunks, batch_size=batch_size, checkpoint=like.checkpoint,
        schedule=like.schedule, balance=balance_by_cost(costs, len(like.balance)), replicas=like.replicas,
        virtual_stages=like.virtual_stages, data_parallel=like.data_parallel, **options,
    )  # fmt: skip


def _checked(
    devices: object, batch_size: object, checkpoints: Sequence[str], schedules: Sequence[str], virtual_stages: object
) -> tuple[list[CheckpointMode], list[str]]:
    """The request's counts checked, and its modes and schedules as the checked names."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices={devices!r} must be an int >= 1: the number of processes of the job")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be an int >= 1: the samples of one optimizer step")
    modes, kinds = [validate_mode(mode) for mode in checkpoints], [validate_schedule(name) for name in schedules]
    if isinstance(virtual_stages, (str, int)) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 2
        for v in virtual_stages  # type: ignore[attr-defined]
    ):
        raise ValueError(f"virtual_stages={virtual_stages!r} must be a list of ints >= 2 (stages per process)")
    return modes, kinds


def _planned_data_parallel(data_parallel: object, compiled: bool) -> PlannedDataParallel:
    """The request's ``data_parallel``, checked; compiled layers run whole (the strategy does not shard them yet)."""
    requested = check_data_parallel(data_parallel)
    if compiled and requested == "fsdp":
        raise ValueError(
            "data_parallel='fsdp' cannot be planned for compiled layers (not sharded yet): use 'ddp' or 'auto', or "
            "drop compile"
        )
    return "ddp" if compiled else requested


def _pipe_sizes(pipe_sizes: Sequence[int] | None, devices: int, layers: int) -> list[int]:
    """The K to weigh: ``pipe_sizes``, or every divisor of ``devices`` up to one layer per stage."""
    divisors = [K for K in range(1, min(devices, layers) + 1) if devices % K == 0]
    if pipe_sizes is None:
        return divisors
    if not pipe_sizes or any(K not in divisors for K in pipe_sizes):
        raise ValueError(
            f"pipe_sizes={list(pipe_sizes)!r}: each K must divide devices={devices} and be at most the {layers} "
            f"layers; choose among {divisors}"
        )
    return sorted(set(pipe_sizes))


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
            f"batch_size={batch_size} on devices={devices} gives micro-batches of {per_replica} sample(s); "
            f"BatchNorm needs {smallest} per micro-batch: use batch_size >= {need}, or GroupNorm"
        )
    return kept, skipped
