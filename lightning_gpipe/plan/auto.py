"""``GPipeStrategy(plan="auto")``: the planner run at setup, on rank 0, and its settings agreed by every rank.

:class:`AutoPlan` is the request: the memory budget (on CUDA, the device's own by default), the batch each pipeline
reads, the sample input of the pipelined sequence, and optional restrictions of the search. :func:`auto_plan`
validates the strategy's ``plan=`` argument against the explicit settings it would override; :func:`planned_batch`
finds the batch to plan for (the request's, else the run's DataLoader's, never the sample's rows) and
:func:`check_planned_batch` holds the first real batch to it; :func:`plan_for_module` plans a LightningModule's
sequence; :func:`agreed_settings` runs that on global rank 0 only (measured times differ between processes, and so
could the plans) and hands every rank the same keyword arguments, or the same error; :func:`planned_settings` is the
three in the order the strategy's setup runs them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_gpipe.engine.rematerialization import validate_mode
from lightning_gpipe.engine.schedule import validate_schedule
from lightning_gpipe.engine.tree import flatten
from lightning_gpipe.partition.config import BuildConfig
from lightning_gpipe.plan.result import Plan, parse_bytes
from lightning_gpipe.plan.search import plan
from lightning_gpipe.plan.sharding import PlannedDataParallel, check_data_parallel

__all__ = [
    "DEVICE_MEMORY_SHARE",
    "AutoPlan",
    "agreed_settings",
    "auto_plan",
    "check_planned_batch",
    "loader_batch_size",
    "plan_for_module",
    "planned_batch",
    "planned_settings",
]

DEVICE_MEMORY_SHARE = 0.9
"""The share of a CUDA device's total memory a plan may fill when no budget is given: the CUDA context, the caching
allocator's rounding and the communication buffers take the rest."""

_PLANNED = ("pipe_size", "chunks", "balance", "checkpoint", "schedule", "virtual_stages", "data_parallel")
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(BuildConfig) if f.name in _PLANNED}


@dataclass(frozen=True)
class AutoPlan:
    """What ``GPipeStrategy(plan=AutoPlan(...))`` plans for; ``plan="auto"`` is ``AutoPlan()``.

    Args:
        memory_per_device: the budget of each device, bytes or a string such as ``"16GB"``. Default on CUDA:
            :data:`DEVICE_MEMORY_SHARE` of the device's total memory. Required on the CPU, which has no such figure.
        batch_size: samples each pipeline reads per step; default: the ``batch_size`` of the DataLoader the run
            reads (the training one under ``fit``), read at setup. With ``devices / K`` data-parallel replicas, a step
            trains on that many times more. The first training batch must have this many samples.
        sample: one input of the pipelined sequence with a batch dimension (any number of rows: it is what the layers
            are profiled on, not the batch); default: the LightningModule's ``example_input_array``.
        optimizer_slots: parameter-sized optimizer tensors per parameter: 2 for Adam, 1 for SGD with momentum.
        pipe_sizes, chunks, checkpoints, schedules: restrict the search to these K, M, re-materialization modes and
            schedules (default: all of them). This is how to fix one setting and plan the others.
        virtual_stages: the stages per process to weigh for ``schedule="interleaved"`` (default:
            :data:`~lightning_gpipe.plan.DEFAULT_VIRTUAL_STAGES`).
        data_parallel: how the replicas of each stage may share it: ``"auto"`` (default) keeps them whole
            (``"ddp"``) unless no configuration fits whole, then shards them (``"fsdp"``); ``"ddp"`` or ``"fsdp"``
            plans for that one (:mod:`~lightning_gpipe.plan.sharding`).
    """

    memory_per_device: float | str | None = None
    batch_size: int | None = None
    sample: Any = field(default=None, repr=False)
    optimizer_slots: float = 2.0
    pipe_sizes: Sequence[int] | None = None
    chunks: Sequence[int] | None = None
    checkpoints: Sequence[str] | None = None
    schedules: Sequence[str] | None = None
    virtual_stages: Sequence[int] | None = None
    data_parallel: PlannedDataParallel = "auto"

    def __post_init__(self) -> None:
        if self.memory_per_device is not None:
            parse_bytes(self.memory_per_device)
        size = self.batch_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"AutoPlan(batch_size={size!r}) must be an int >= 1 (samples per pipeline)")
        slots = self.optimizer_slots
        if isinstance(slots, bool) or not isinstance(slots, (int, float)) or not (0 <= slots < math.inf):
            raise ValueError(
                f"AutoPlan(optimizer_slots={slots!r}) must be a number >= 0: 2 for Adam, 1 for SGD with momentum"
            )
        for name in ("pipe_sizes", "chunks"):
            values = getattr(self, name)
            if values is not None and (
                isinstance(values, (str, int)) or not values or not all(_positive_int(v) for v in values)
            ):
                raise ValueError(f"AutoPlan({name}={values!r}) must be a non-empty list of ints >= 1, or None")
        stages = self.virtual_stages
        if stages is not None and (
            isinstance(stages, (str, int)) or not stages or not all(_positive_int(v) and v >= 2 for v in stages)
        ):
            raise ValueError(f"AutoPlan(virtual_stages={stages!r}) must be a non-empty list of ints >= 2, or None")
        check_data_parallel(self.data_parallel)
        for mode in self.checkpoints or ():
            validate_mode(mode)
        for name in self.schedules or ():
            validate_schedule(name)


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def auto_plan(value: object, config: BuildConfig) -> AutoPlan | None:
    """The request behind the strategy's ``plan=`` argument, refusing it beside settings it would choose itself.

    ``config`` holds the strategy's settings; with a plan its ``pipe_size``, ``chunks``, ``balance``, ``checkpoint``,
    ``schedule``, ``virtual_stages`` and ``data_parallel`` must be left at their defaults.

    Raises:
        TypeError: ``value`` is neither ``None``, ``"auto"`` nor an :class:`AutoPlan`.
        ValueError: ``value`` is another string, or a plan comes with a setting it chooses.
    """
    if value is None:
        return None
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f"plan={value!r} is not a plan; use plan='auto', plan=AutoPlan(...) or None")
        value = AutoPlan()
    if not isinstance(value, AutoPlan):
        raise TypeError(
            f"plan={value!r} must be 'auto' or a lightning_gpipe.plan.AutoPlan(...), not {type(value).__name__}"
        )
    explicit = {name: getattr(config, name) for name in _PLANNED}
    given = {name: setting for name, setting in explicit.items() if setting != _DEFAULTS[name]}
    if given:
        settings = ", ".join(f"{name}={setting!r}" for name, setting in given.items())
        restrict = {
            "pipe_size": "pipe_sizes",
            "chunks": "chunks",
            "checkpoint": "checkpoints",
            "schedule": "schedules",
            "virtual_stages": "virtual_stages",
        }
        hints = [f"{restrict[name]}=[{setting!r}]" for name, setting in given.items() if name in restrict]
        if "data_parallel" in given:  # one value, not a list of them
            hints.append(f"data_parallel={given['data_parallel']!r}")
        how = f"plan=AutoPlan({', '.join(hints)})" if hints else "the balance the plan finds"
        raise ValueError(
            f"plan chooses the layout, but {settings} {'was' if len(given) == 1 else 'were'} given as well: drop "
            f"{'it' if len(given) == 1 else 'them'}, restrict the plan ({how}), or drop plan="
        )
    return value


def loader_batch_size(loader: Any) -> int | None:
    """The samples per batch that ``loader`` says it gives: a ``DataLoader``'s ``batch_size`` (or its batch sampler's).

    ``None`` when it does not say: no loader, an ``IterableDataset`` that batches itself, a batch sampler without a
    ``batch_size``, or several loaders (a collection, or Lightning's ``CombinedLoader`` of more than one).
    """
    loaders = getattr(loader, "flattened", None)  # Lightning's CombinedLoader
    if loaders is None:
        loaders = [leaf for leaf in flatten(loader)[0] if leaf is not None]
    if len(loaders) != 1 or not isinstance(loaders[0], DataLoader):
        return None
    size = loaders[0].batch_size
    if size is None:
        size = getattr(loaders[0].batch_sampler, "batch_size", None)
    return size if _positive_int(size) else None


def planned_batch(request: AutoPlan, loader: Callable[[], Any]) -> int:
    """The batch each pipeline reads per step, which the plan is made for: the request's, else the run's DataLoader's.

    ``loader()`` gives the DataLoader the run reads (called only when the request names no batch). A sample's rows are
    never taken for the batch: a module's ``example_input_array`` often has a few rows, set for profiling or FLOPs.

    Raises:
        ValueError: the request names no batch and the loader does not say its own.
    """
    if request.batch_size is not None:
        return request.batch_size
    given = loader()
    size = loader_batch_size(given)
    if size is None:
        raise ValueError(
            f"plan='auto' cannot read the batch_size of the run's loader (a {type(given).__name__}): pass "
            "plan=AutoPlan(batch_size=...), the samples per pipeline and step"
        )
    return size


def check_planned_batch(planned: int, samples: int) -> None:
    """Refuse a first training batch of another size than the plan's: its memory and times were predicted for it.

    Raises:
        ValueError: ``samples`` differs from ``planned``; the message says the run is refused, not re-planned.
    """
    if samples != planned:
        raise ValueError(
            f"plan='auto' planned for batches of {planned} samples per pipeline, but the first training batch has "
            f"{samples}: pass plan=AutoPlan(batch_size={samples}), or DataLoader(batch_size={planned})"
        )


def _budget(request: AutoPlan, device: torch.device) -> float:
    if request.memory_per_device is not None:
        return parse_bytes(request.memory_per_device)
    if device.type == "cuda":
        return DEVICE_MEMORY_SHARE * torch.cuda.get_device_properties(device).total_memory
    raise ValueError(
        f"plan='auto' needs a memory budget per device on {device.type!r}: pass plan=AutoPlan(memory_per_device='4GB')"
    )


def plan_for_module(
    request: AutoPlan,
    sequence: nn.Module,
    example: Any,
    *,
    batch_size: int,
    devices: int,
    device: torch.device,
    compiled: bool = False,
) -> Plan:
    """Plan the pipelined ``sequence`` for ``devices`` processes on ``device`` as ``request`` asks.

    ``example`` is the LightningModule's ``example_input_array``, used when the request has no ``sample``;
    ``batch_size`` is what each pipeline reads per step (:func:`planned_batch`), whatever the sample's rows;
    ``compiled``: the stages will compile their layers (``"selective"`` then re-materializes every micro-batch).

    Raises:
        ValueError: no sample, or no budget on a device without a memory size.
        InfeasiblePlanError: nothing fits (the message names what would).
    """
    sample = request.sample if request.sample is not None else example
    if sample is None:
        raise ValueError(
            "plan='auto' needs a sample input to profile: set self.example_input_array (a few rows), or pass "
            "plan=AutoPlan(sample=...)"
        )
    budget = _budget(request, device)
    options: dict[str, Any] = {}
    if request.checkpoints is not None:
        options["checkpoints"] = list(request.checkpoints)
    if request.schedules is not None:
        options["schedules"] = list(request.schedules)
    if request.virtual_stages is not None:
        options["virtual_stages"] = list(request.virtual_stages)
    chosen = plan(
        sequence,
        sample,
        devices=devices,
        memory_per_device=budget,
        batch_size=batch_size,
        device=device,
        optimizer_slots=request.optimizer_slots,
        chunks=request.chunks,
        pipe_sizes=request.pipe_sizes,
        per_pipeline_batch=True,
        compiled=compiled,
        data_parallel=request.data_parallel,
        **options,
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the profiled copies' blocks, before this rank's stage is allocated
    return chosen


def agreed_settings(
    make: Callable[[], Plan],
    *,
    rank: int,
    broadcast: Callable[[Any], Any],
    report: Callable[[str], None],
) -> dict[str, Any]:
    """Run ``make`` on rank 0, ``report`` its table there, and return its strategy keyword arguments on every rank.

    ``broadcast(obj)`` must hand rank 0's ``obj`` to every rank (every rank calls it once). When planning fails on
    rank 0, rank 0 raises the error and every other rank a ``ValueError`` that quotes it, so that no rank waits for
    a plan that will not come.
    """
    outcome: tuple[str, Any] | None = None
    if rank == 0:
        try:
            chosen = make()
        except Exception as error:
            broadcast(("error", f"{type(error).__name__}: {error}"))
            raise
        settings = chosen.strategy_kwargs()
        report(f"GPipe plan (plan='auto'); the same without planning: {chosen.strategy_code()}\n{chosen}")
        outcome = ("plan", settings)
    kind, payload = broadcast(outcome)
    if kind == "error":
        raise ValueError(f"global rank 0 could not plan the pipeline, so this rank stops too: {payload}")
    return dict(payload)


def planned_settings(
    request: AutoPlan,
    sequence: nn.Module,
    example: Any,
    *,
    loader: Callable[[], Any],
    devices: int,
    device: torch.device,
    compiled: bool,
    rank: int,
    broadcast: Callable[[Any], Any],
    report: Callable[[str], None],
) -> tuple[dict[str, Any], int]:
    """``plan="auto"`` at setup: the settings rank 0 plans, the same on every rank, and the batch they are planned for.

    The batch is :func:`planned_batch`'s (``loader()`` gives the run's DataLoader: every rank reads the same
    ``batch_size``, so every rank can hold the first batch to it); the plan :func:`plan_for_module`'s for it, agreed by
    :func:`agreed_settings`.
    """
    batch = planned_batch(request, loader)

    def make() -> Plan:
        return plan_for_module(
            request, sequence, example, batch_size=batch, devices=devices, device=device, compiled=compiled
        )

    return agreed_settings(make, rank=rank, broadcast=broadcast, report=report), batch
