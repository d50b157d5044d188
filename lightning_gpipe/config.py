"""PipelineConfig: the settings of a GPipe pipeline, validated once where the user gives them."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Literal

from lightning_gpipe.checkpoint import CheckpointMode, validate_mode
from lightning_gpipe.cost import CostFn
from lightning_gpipe.microbatch import validate_chunks
from lightning_gpipe.partition import validate_balance
from lightning_gpipe.schedule import validate_schedule
from lightning_gpipe.transport import DEFAULT_TIMEOUT

__all__ = ["BALANCE_NAMES", "START_METHODS", "Balance", "PipelineConfig", "StartMethod", "config_from"]

Balance = list[int] | Literal["params", "flops", "time", "memory"] | CostFn | None
"""Layers per stage (a list of K ints), or how to find them: a cost name, a callable ``cost(layer)``, or ``None``."""
StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
"""How the strategy starts one process per device (see :data:`START_METHODS`)."""
BALANCE_NAMES: tuple[str, ...] = ("params", "flops", "time", "memory")
"""The ways to find a balance by measuring the layers (see :mod:`lightning_gpipe.cost`)."""
START_METHODS: tuple[str, ...] = ("popen", "spawn", "fork", "forkserver")
"""How the strategy starts its processes: re-run the script per rank, or start workers from this process."""


@dataclass(frozen=True)
class PipelineConfig:
    """Every setting of :class:`~lightning_gpipe.strategy.GPipeStrategy`, checked in ``__post_init__``.

    Each bad value raises a ``ValueError`` or ``TypeError`` that names it, the rule and the fix; the layers that
    receive a valid configuration need not check it again. The attributes mean what the strategy's arguments of the
    same names mean; ``None`` for ``pipe_size`` and ``chunks`` defers to the world size (see the strategy).
    """

    pipe_size: int | None = None
    chunks: int | None = None
    balance: Balance = None
    checkpoint: CheckpointMode = "except_last"
    schedule: str = "gpipe"
    module_name: str | None = None
    deferred_batch_norm: bool = False
    process_group_backend: str | None = None
    timeout: datetime.timedelta = DEFAULT_TIMEOUT
    start_method: StartMethod = "popen"
    detect_anomalies: bool = False
    verify_batches: bool = True

    def __post_init__(self) -> None:
        pipe_size = self.pipe_size
        if pipe_size is not None and (isinstance(pipe_size, bool) or not isinstance(pipe_size, int) or pipe_size < 1):
            raise ValueError(
                f"pipe_size={pipe_size!r} must be a positive int (stages per pipeline) or None (all ranks)"
            )
        if self.chunks is not None:
            validate_chunks(self.chunks)
        object.__setattr__(self, "balance", _check_balance(self.balance, pipe_size))
        validate_mode(self.checkpoint)
        validate_schedule(self.schedule)
        _check_module_name(self.module_name)
        for name in ("deferred_batch_norm", "detect_anomalies", "verify_batches"):
            _check_flag(name, getattr(self, name))
        _check_backend(self.process_group_backend)
        _check_timeout(self.timeout)
        if self.start_method not in START_METHODS:
            raise ValueError(
                f"start_method={self.start_method!r} is not a way to start the processes; use one of "
                f"{', '.join(map(repr, START_METHODS))} ('popen' re-runs the script per rank, 'fork' works in "
                "notebooks)"
            )


def _check_balance(balance: Any, pipe_size: int | None) -> Balance:
    if balance is None or callable(balance):
        return balance
    if isinstance(balance, str):
        if balance not in BALANCE_NAMES:
            raise ValueError(
                f"balance={balance!r} is not a way to balance stages; use a list of layers per stage, one of "
                f"{', '.join(map(repr, BALANCE_NAMES))}, or a callable cost(layer) -> float"
            )
        return balance  # type: ignore[return-value]
    if isinstance(balance, (list, tuple)):
        entries = list(balance)
        if pipe_size is not None and len(entries) != pipe_size:
            raise ValueError(
                f"balance={entries} has {len(entries)} stages but pipe_size={pipe_size}; give one number of "
                "layers per stage"
            )
        validate_balance(entries, sum(e for e in entries if isinstance(e, int)))  # entries' own checks
        return entries
    raise TypeError(
        f"balance={balance!r} must be a list of ints (layers per stage), a cost name or a callable, "
        f"not {type(balance).__name__}"
    )


def _check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False, not {type(value).__name__}")
    return value


def _check_module_name(module_name: object) -> str | None:
    if module_name is None:
        return None
    if not isinstance(module_name, str):
        raise TypeError(
            f"module_name={module_name!r} must be a str, the dotted attribute path of the nn.Sequential to pipeline "
            "(e.g. 'layers' or 'backbone.layers'), or None to find it"
        )
    if not module_name or not all(part.isidentifier() or part.isdigit() for part in module_name.split(".")):
        raise ValueError(
            f"module_name={module_name!r} is not an attribute path; give attribute names joined by dots, e.g. "
            "'layers' or 'backbone.layers'"
        )
    return module_name


def _check_backend(backend: object) -> str | None:
    if backend is None:
        return None
    if not isinstance(backend, str) or not backend:
        raise TypeError(
            f"process_group_backend={backend!r} must be the name of a torch.distributed backend, e.g. 'gloo' or "
            "'nccl', or None to choose by device"
        )
    return backend


def _check_timeout(timeout: object) -> datetime.timedelta:
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(
            f"timeout={timeout!r} must be a datetime.timedelta, e.g. timeout=datetime.timedelta(minutes=30): how "
            "long a stage waits for a peer"
        )
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout={timeout!r} must be positive: how long a stage waits for a peer before it gives up")
    return timeout


def config_from(config: PipelineConfig | None, owner: str, **settings: Any) -> PipelineConfig:
    """``config`` as given, or a :class:`PipelineConfig` of those keyword ``settings`` that are not ``None``.

    The engine's constructors take either a configuration validated already (the strategy's) or its settings one by
    one (``Pipeline(cell, transport, chunks=4)``), and validate only the latter; ``owner`` names the constructor in
    the message when both are given.
    """
    given = {name: value for name, value in settings.items() if value is not None}
    if config is None:
        return PipelineConfig(**given)
    if not isinstance(config, PipelineConfig):
        raise TypeError(
            f"{owner} got config={config!r}, which must be a PipelineConfig or None; give the settings as keywords "
            "instead, e.g. chunks=4"
        )
    if given:
        listing = ", ".join(f"{name}={value!r}" for name, value in given.items())
        raise ValueError(
            f"{owner} got a config and also {listing}; give each setting once: in the config "
            f"(dataclasses.replace(config, {listing})) or as keywords without a config"
        )
    return config
