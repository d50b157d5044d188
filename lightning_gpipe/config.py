"""StrategyConfig: every setting of :class:`~lightning_gpipe.strategy.GPipeStrategy`, validated once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from lightning_gpipe.compat import default_process_group_backend
from lightning_gpipe.engine.config import validate_flag
from lightning_gpipe.partition.config import BuildConfig, ResolvedPipeline

__all__ = [
    "START_METHODS",
    "STATE_DICT_TYPES",
    "StartMethod",
    "StateDictType",
    "StrategyConfig",
    "eager_selective_advice",
]

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
"""How the strategy starts one process per device (see :data:`START_METHODS`)."""
START_METHODS: tuple[str, ...] = ("popen", "spawn", "fork", "forkserver")
"""How the strategy starts its processes: re-run the script per rank, or start workers from this process."""
StateDictType = Literal["full", "sharded"]
"""How ``trainer.save_checkpoint`` writes: one file of the whole model, or a directory with a shard per rank."""
STATE_DICT_TYPES: tuple[str, ...] = ("full", "sharded")
"""The checkpoint formats, as Lightning's ``FSDPStrategy(state_dict_type=...)`` names them."""


@dataclass(frozen=True)
class StrategyConfig(BuildConfig):
    """The strategy's settings: a build's (:class:`~lightning_gpipe.partition.config.BuildConfig`), and how to run it.

    The attributes mean what the strategy's arguments of the same names mean; ``None`` for ``pipe_size`` and
    ``chunks`` defers to the world size (see :meth:`~lightning_gpipe.partition.config.BuildConfig.resolve`).
    """

    process_group_backend: str | None = None
    start_method: StartMethod = "popen"
    verify_batches: bool = True
    state_dict_type: StateDictType = "full"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_backend(self.process_group_backend)
        if self.start_method not in START_METHODS:
            raise ValueError(
                f"start_method={self.start_method!r} is not a way to start the processes; use one of "
                f"{', '.join(map(repr, START_METHODS))}"
            )
        validate_flag("verify_batches", self.verify_batches)
        if self.state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(
                f"state_dict_type={self.state_dict_type!r} is not a checkpoint format; use 'full' or 'sharded'"
            )

    def backend_for(self, device: torch.device) -> str:
        """The ``torch.distributed`` backend on ``device``: the one given, else NCCL on CUDA and gloo on CPU.

        Raises:
            ValueError: ``"gloo"`` for a CUDA device, whose tensors gloo's send and receive cannot move.
        """
        backend = self.process_group_backend or default_process_group_backend(device)
        if backend == "gloo" and device.type == "cuda":
            raise ValueError(f"process_group_backend='gloo' cannot send tensors on {device}; use 'nccl' or None")
        return backend


def _check_backend(backend: object) -> str | None:
    if backend is None:
        return None
    if not isinstance(backend, str) or not backend:
        raise TypeError(f"process_group_backend={backend!r} must be a backend name ('gloo', 'nccl') or None")
    return backend


def eager_selective_advice(settings: ResolvedPipeline, device: torch.device) -> str | None:
    """What to say to a run that re-materializes selectively, uncompiled, on a GPU; ``None`` for any other run.

    Eager, torch's selective policy runs in Python for every operation of a forward and its replay, and a GPU can wait
    for that host work (measured in docs/benchmarks/gpu.md).
    """
    if settings.pipeline.checkpoint != "selective" or settings.compile is not None or device.type != "cuda":
        return None
    return (
        "checkpoint='selective' without compile=True runs torch's selective-checkpoint policy in Python for every "
        "operation, and on a GPU the device can end up waiting for that host work (measured slower than "
        "checkpoint='except_last' on an H100: docs/benchmarks/gpu.md). Pass compile=True to compile the policy into "
        "each layer, or use checkpoint='except_last'."
    )
