"""PipelineConfig: the settings a pipeline's stages run by, validated once where the user gives them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_gpipe.engine.microbatch import validate_chunks
from lightning_gpipe.engine.rematerialization import CheckpointMode, validate_mode
from lightning_gpipe.engine.schedule import (
    MULTI_STAGE,
    SPLIT_BACKWARD,
    interleaved_round,
    stages_per_process,
    validate_schedule,
)

__all__ = ["PipelineConfig", "config_from", "validate_flag"]


@dataclass(frozen=True)
class PipelineConfig:
    """The settings of :class:`~lightning_gpipe.engine.pipeline.Pipeline` and its stage, checked in ``__post_init__``.

    Each bad value raises a ``ValueError`` or ``TypeError`` that names it, the rule and the fix; the layers that
    receive a valid configuration need not check it again. The settings of the layers above (how the module is cut,
    how the strategy starts its processes) extend this class: :class:`~lightning_gpipe.partition.config.BuildConfig`,
    :class:`~lightning_gpipe.config.StrategyConfig`. ``chunks=None`` defers to the world size, as
    :meth:`~lightning_gpipe.partition.config.BuildConfig.resolve` resolves it; a ``Pipeline`` needs it set.

    ``virtual_stages`` is the number of stages each process holds under ``schedule="interleaved"`` (2 or more); ZB-V
    always places two (``"zbv"`` takes 1 or 2); the other schedules one.

    What the schedule implies is resolved once, here, into the attributes that everything after reads:
    :attr:`stages_per_process`, :attr:`split_backward` and :attr:`multi_stage`.
    """

    chunks: int | None = None
    checkpoint: CheckpointMode = "except_last"
    schedule: str = "gpipe"
    detect_anomalies: bool = False
    virtual_stages: int = 1
    stages_per_process: int = field(init=False, repr=False, compare=False, default=1)
    """How many stages each process holds: ``virtual_stages`` under ``"interleaved"``, 2 under ``"zbv"``, else 1."""
    split_backward: bool = field(init=False, repr=False, compare=False, default=False)
    """Whether each backward is split into an input and a weight pass (``"zero_bubble"``, ``"zbv"``)."""
    multi_stage: bool = field(init=False, repr=False, compare=False, default=False)
    """Whether the schedule's actions come per process, naming their stages (``"interleaved"``, ``"zbv"``)."""

    def __post_init__(self) -> None:
        if self.chunks is not None:
            validate_chunks(self.chunks)
        validate_mode(self.checkpoint)
        schedule = validate_schedule(self.schedule)
        validate_flag("detect_anomalies", self.detect_anomalies)
        object.__setattr__(self, "stages_per_process", stages_per_process(schedule, self.virtual_stages))
        object.__setattr__(self, "split_backward", schedule in SPLIT_BACKWARD)
        object.__setattr__(self, "multi_stage", schedule in MULTI_STAGE)

    def check_chunks(self, num_processes: int) -> None:
        """Refuse ``chunks`` that ``schedule="interleaved"`` cannot split into rounds over ``num_processes`` processes
        (the message says the rule and the values that fit); nothing to check for the other schedules."""
        if self.schedule == "interleaved" and self.chunks is not None:
            interleaved_round(num_processes, self.chunks)


def validate_flag(name: str, value: object) -> bool:
    """Return ``value`` if it is a bool, else raise a ``TypeError`` naming the setting ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False, not {type(value).__name__}")
    return value


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
        raise TypeError(f"{owner} got config={config!r}; give a PipelineConfig or None, or the settings as keywords")
    if given:
        listing = ", ".join(f"{name}={value!r}" for name, value in given.items())
        raise ValueError(
            f"{owner} got a config and also {listing}; give each setting once, in the config or as keywords"
        )
    return config
