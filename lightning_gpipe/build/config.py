"""BuildConfig: the engine's settings plus how to cut the user's module into stages, validated once."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Literal

from lightning_gpipe.build.balance import validate_balance
from lightning_gpipe.build.cost import CostFn
from lightning_gpipe.engine.config import PipelineConfig, validate_flag
from lightning_gpipe.engine.transport import DEFAULT_TIMEOUT

__all__ = ["BALANCE_NAMES", "Balance", "BuildConfig"]

Balance = list[int] | Literal["params", "flops", "time", "memory"] | CostFn | None
"""Layers per stage (a list of K ints), or how to find them: a cost name, a callable ``cost(layer)``, or ``None``."""
BALANCE_NAMES: tuple[str, ...] = ("params", "flops", "time", "memory")
"""The ways to find a balance by measuring the layers (see :mod:`lightning_gpipe.build.cost`)."""


@dataclass(frozen=True)
class BuildConfig(PipelineConfig):
    """The settings of :func:`~lightning_gpipe.build.assembly.assemble_stage`: a pipeline's, and how to build it.

    ``pipe_size=None`` defers to the world size (see the strategy); ``timeout`` is how long a stage waits for a
    peer, in the pipeline and in the collectives of the build.
    """

    pipe_size: int | None = None
    balance: Balance = None
    module_name: str | None = None
    deferred_batch_norm: bool = False
    timeout: datetime.timedelta = DEFAULT_TIMEOUT

    def __post_init__(self) -> None:
        super().__post_init__()
        pipe_size = self.pipe_size
        if pipe_size is not None and (isinstance(pipe_size, bool) or not isinstance(pipe_size, int) or pipe_size < 1):
            raise ValueError(
                f"pipe_size={pipe_size!r} must be a positive int (stages per pipeline) or None (all ranks)"
            )
        object.__setattr__(self, "balance", _check_balance(self.balance, pipe_size))
        _check_module_name(self.module_name)
        validate_flag("deferred_batch_norm", self.deferred_batch_norm)
        _check_timeout(self.timeout)


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


def _check_timeout(timeout: object) -> datetime.timedelta:
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(
            f"timeout={timeout!r} must be a datetime.timedelta, e.g. timeout=datetime.timedelta(minutes=30): how "
            "long a stage waits for a peer"
        )
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout={timeout!r} must be positive: how long a stage waits for a peer before it gives up")
    return timeout
