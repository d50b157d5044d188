"""BuildConfig: the engine's settings plus how to cut the user's module into stages, validated once, resolved once.

:class:`BuildConfig` holds the values as the user gives them and checks each in ``__post_init__``;
:meth:`BuildConfig.resolve` turns them and the run's context (world size, rank, a planner's choice) into a
:class:`ResolvedPipeline`, which assembly, the engine and the strategy read without checking it again.
"""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

from lightning_gpipe.engine.config import PipelineConfig, validate_flag
from lightning_gpipe.engine.layout import ProcessLayout
from lightning_gpipe.engine.rematerialization import CheckpointMode
from lightning_gpipe.engine.transport import DEFAULT_TIMEOUT
from lightning_gpipe.partition.balance import checked_entries
from lightning_gpipe.partition.compile import Compile, check_compile, compile_options
from lightning_gpipe.profile.cost import COST_SOURCES, CostFn

__all__ = ["DATA_PARALLEL", "Balance", "BuildConfig", "DataParallel", "ResolvedPipeline"]

Balance = list[int] | Literal["params", "flops", "time", "memory"] | CostFn | None
"""Layers per stage (a list of ``K·v`` ints: one per stage of the pipeline), or how to find them: a cost name of
:data:`~lightning_gpipe.profile.cost.COST_SOURCES`, a callable ``cost(layer)``, or ``None``."""

DataParallel = Literal["ddp", "fsdp"]
"""How the replicas of a stage share it: each holds it whole and gradients are averaged (``"ddp"``), or each holds a
shard of its parameters, gradients and optimizer state (``"fsdp"``, :mod:`lightning_gpipe.partition.fsdp`)."""
DATA_PARALLEL: tuple[str, ...] = get_args(DataParallel)
"""The values of :data:`DataParallel`, for checks and messages."""


@dataclass(frozen=True)
class BuildConfig(PipelineConfig):
    """The settings of :func:`~lightning_gpipe.partition.assembly.assemble_stage`: a pipeline's, and how to build it.

    ``pipe_size=None`` and ``chunks=None`` defer to the world size (see :meth:`resolve`); ``timeout`` is how long a
    stage waits for a peer, in the pipeline and in the collectives of the build; ``compile`` compiles each layer of
    the stage (``True`` or ``torch.compile``'s keyword arguments, see :mod:`lightning_gpipe.partition.compile`);
    ``data_parallel`` how the replicas of a stage share it (:data:`DataParallel`).
    """

    pipe_size: int | None = None
    balance: Balance = None
    module_name: str | None = None
    deferred_batch_norm: bool = False
    timeout: datetime.timedelta = DEFAULT_TIMEOUT
    compile: Compile = False
    data_parallel: DataParallel = "ddp"

    def __post_init__(self) -> None:
        super().__post_init__()
        pipe_size = self.pipe_size
        if pipe_size is not None and (isinstance(pipe_size, bool) or not isinstance(pipe_size, int) or pipe_size < 1):
            raise ValueError(f"pipe_size={pipe_size!r} must be a positive int, or None for all ranks")
        stages = None if pipe_size is None else pipe_size * self.stages_per_process
        object.__setattr__(self, "balance", _check_balance(self.balance, stages, self.stages_per_process))
        if pipe_size is not None:
            self.check_chunks(pipe_size)
        _check_module_name(self.module_name)
        validate_flag("deferred_batch_norm", self.deferred_batch_norm)
        _check_timeout(self.timeout)
        object.__setattr__(self, "compile", check_compile(self.compile))  # a copy: the caller's dict may change
        _check_data_parallel(self.data_parallel, self.compile)

    def sizes(self, world_size: int, chosen: Mapping[str, Any] | None = None) -> tuple[int, int]:
        """K and M in a job of ``world_size`` processes: ``pipe_size`` (default: the world size) and ``chunks``
        (default ``4 * K``), or those ``chosen`` for the user (see :meth:`resolve`)."""
        chosen = chosen or {}
        K = chosen.get("pipe_size", self.pipe_size) or world_size
        return K, chosen.get("chunks", self.chunks) or 4 * K

    def resolve(self, world_size: int, rank: int, chosen: Mapping[str, Any] | None = None) -> ResolvedPipeline:
        """These settings for process ``rank`` of a job of ``world_size``: K and M as numbers, this process's place.

        ``pipe_size=None`` becomes the world size and ``chunks=None`` ``4 * pipe_size``. ``chosen`` holds settings made
        for the user, which take the place of these: under ``plan="auto"`` the planner's ``pipe_size``, ``chunks``,
        ``balance``, ``checkpoint``, ``schedule``, ``virtual_stages`` and ``data_parallel`` (the strategy refuses a
        plan beside them). ``data_parallel="fsdp"`` with a single replica (nothing to shard over) warns and resolves
        to ``"ddp"``.

        Raises:
            ValueError: the world cannot be cut into pipelines of ``pipe_size`` processes, a list balance has
                another number of stages than the pipelines (``pipe_size`` times the stages per process), or
                ``schedule="interleaved"`` cannot run ``chunks`` in rounds.
        """
        chosen = dict(chosen or {})
        K, M = self.sizes(world_size, chosen)
        schedule = chosen.get("schedule", self.schedule)
        # A planned schedule comes with its own virtual_stages (1 where it takes none).
        virtual_stages = chosen.get("virtual_stages", 1) if "schedule" in chosen else self.virtual_stages
        layout = ProcessLayout(world_size, K, rank, schedule, virtual_stages)  # refuses a world that K does not divide
        balance = chosen.get("balance", self.balance)
        # A list was checked against the stages where it was given with pipe_size; else the stages are known now.
        checked = self.pipe_size is not None and not chosen.keys() & {"pipe_size", "balance", "schedule"}
        if isinstance(balance, list) and not checked and len(balance) != layout.num_stages:
            per = f" ({K} processes x {len(layout.stages)} stages each)" if layout.num_stages != K else ""
            raise ValueError(
                f"balance={balance} has {len(balance)} stages but the pipelines have {layout.num_stages}{per} "
                f"(world_size={world_size}, pipe_size={self.pipe_size}); give one number per stage"
            )
        if M < K:
            warnings.warn(
                f"chunks={M} is smaller than pipe_size={K}: at most {M} of {K} stages can work at once. Use "
                f"chunks >= {4 * K} for a small bubble.",
                stacklevel=3,
            )
        engine = PipelineConfig(
            chunks=M,
            checkpoint=chosen.get("checkpoint", self.checkpoint),
            schedule=schedule,
            detect_anomalies=self.detect_anomalies,
            virtual_stages=virtual_stages,
        )
        engine.check_chunks(K)
        return ResolvedPipeline(
            layout,
            engine,
            balance,
            self.module_name,
            self.deferred_batch_norm,
            self.timeout,
            compile_options(self.compile),
            _resolve_data_parallel(chosen.get("data_parallel", self.data_parallel), layout),
        )


@dataclass(frozen=True)
class ResolvedPipeline:
    """A :class:`BuildConfig` resolved against the run by :meth:`BuildConfig.resolve`: what everything after reads.

    The user's values were checked where they were given and the run's context once, by ``resolve``; nothing that
    reads these checks them again.

    Attributes:
        layout: this process's place: K (``layout.pipe_size``), its stages and its replica.
        pipeline: what :class:`~lightning_gpipe.engine.pipeline.Pipeline` and its stages run by; ``chunks`` is M.
        balance: layers per stage (``K·v`` ints), or how assembly finds them from the sequence (``resolve_balance``).
        module_name, deferred_batch_norm, timeout: as given (see :class:`BuildConfig`).
        compile: ``torch.compile``'s keyword arguments for each layer of the stage, or ``None``: not compiled.
        data_parallel: how the stage's replicas share it; ``"fsdp"`` only where there are several replicas.
    """

    layout: ProcessLayout
    pipeline: PipelineConfig
    balance: Balance
    module_name: str | None
    deferred_batch_norm: bool
    timeout: datetime.timedelta
    compile: dict[str, Any] | None = None
    data_parallel: DataParallel = "ddp"

    @property
    def pipe_size(self) -> int:
        """K, the number of stages per pipeline."""
        return self.layout.pipe_size

    @property
    def num_stages(self) -> int:
        """The stages of a pipeline: K times the stages each process holds."""
        return self.layout.num_stages

    @property
    def chunks(self) -> int:
        """M, the number of micro-batches per mini-batch."""
        return cast(int, self.pipeline.chunks)  # set by resolve

    @property
    def checkpoint(self) -> CheckpointMode:
        """The re-materialization mode."""
        return self.pipeline.checkpoint

    @property
    def schedule(self) -> str:
        """The pipeline schedule."""
        return self.pipeline.schedule


def _check_balance(balance: Any, num_stages: int | None, per_process: int = 1) -> Balance:
    if balance is None or callable(balance):
        return balance
    if isinstance(balance, str):
        if balance not in COST_SOURCES:
            raise ValueError(
                f"balance={balance!r} is not a cost source; use one of {', '.join(map(repr, COST_SOURCES))}, a list "
                "or a callable"
            )
        return balance  # type: ignore[return-value]
    if isinstance(balance, (list, tuple)):
        entries = list(balance)
        if num_stages is not None and len(entries) != num_stages:
            if per_process == 1:
                raise ValueError(
                    f"balance={entries} has {len(entries)} stages but pipe_size={num_stages}; give one per stage"
                )
            raise ValueError(
                f"balance={entries} has {len(entries)} stages but the pipeline has {num_stages}: pipe_size="
                f"{num_stages // per_process} x {per_process} stages each; give one per stage"
            )
        return checked_entries(entries)  # the sequence's length is checked once it is known: assembly
    raise TypeError(
        f"balance={balance!r} must be a list of ints, a cost name or a callable, not {type(balance).__name__}"
    )


def _check_data_parallel(data_parallel: object, compile: Compile) -> None:
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(f"data_parallel={data_parallel!r} is not a data-parallel mode; use 'ddp' or 'fsdp'")
    if data_parallel == "fsdp" and compile is not False:
        raise ValueError(
            f"compile={compile!r} with data_parallel='fsdp' is not supported yet; use compile=False or 'ddp'"
        )


def _resolve_data_parallel(data_parallel: DataParallel, layout: ProcessLayout) -> DataParallel:
    """``data_parallel`` for this run: ``"fsdp"`` over a single replica warns and runs as ``"ddp"``."""
    if data_parallel == "fsdp" and layout.num_replicas == 1:
        warnings.warn(
            f"data_parallel='fsdp' with a single replica (world_size={layout.world_size}, pipe_size="
            f"{layout.pipe_size}) has nothing to shard over: each stage runs as with 'ddp'. Shard with more "
            "processes than pipe_size.",
            stacklevel=4,
        )
        return "ddp"
    return data_parallel


def _check_module_name(module_name: object) -> str | None:
    if module_name is None:
        return None
    if not isinstance(module_name, str):
        raise TypeError(f"module_name={module_name!r} must be a str such as 'backbone.layers', or None")
    if not module_name or not all(part.isidentifier() or part.isdigit() for part in module_name.split(".")):
        raise ValueError(f"module_name={module_name!r} is not an attribute path such as 'backbone.layers'")
    return module_name


def _check_timeout(timeout: object) -> datetime.timedelta:
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"timeout={timeout!r} must be a datetime.timedelta, e.g. datetime.timedelta(minutes=30)")
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout={timeout!r} must be positive")
    return timeout
