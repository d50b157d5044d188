"""Checkpoint IO of a partitioned model: every stage's part gathered and merged on one rank, and split back on load.

A checkpoint holds the whole model, keyed as the unpartitioned module's ``state_dict`` and optimizer state are
(:mod:`lightning_gpipe.partition.state_dict`), so that it loads into any number of stages, or none. Saving is a
collective of the pipeline: each stage sends its part to the pipeline's last-stage rank (global rank 0 for the first
pipeline), which merges them and writes the file beside its target, then renames it.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import LightningModule

from lightning_gpipe.compat import optimizers_to_device
from lightning_gpipe.engine.collectives import portable
from lightning_gpipe.engine.errors import collective_errors
from lightning_gpipe.engine.layout import ProcessLayout
from lightning_gpipe.partition.state_dict import (
    ModelNames,
    check_loadable,
    local_optimizer_state,
    merge_optimizer_states,
    merge_state_dicts,
    optimizer_state_by_name,
)

__all__ = ["StageCheckpoints", "save_atomically"]

_SAVE_ARRIVAL_TIMEOUT = datetime.timedelta(seconds=30)  # how long saving waits for every rank to arrive


class StageCheckpoints:
    """One stage's side of the checkpoint collectives.

    Args:
        layout: which stage of which replica this process runs.
        names: the whole module's state-dict keys, shapes and parameter order (recorded before it was cut).
        object_group: the pipeline's group for object collectives (gloo: parts stay in host memory).
        control_group: a gloo group on which a barrier can give up after a while.
        timeout: the strategy's timeout; the save barrier waits at most this.
    """

    def __init__(
        self,
        layout: ProcessLayout,
        names: ModelNames,
        object_group: dist.ProcessGroup | None,
        control_group: dist.ProcessGroup | None,
        timeout: datetime.timedelta,
    ) -> None:
        self.layout = layout
        self.names = names
        self.object_group = object_group
        self.control_group = control_group
        self.timeout = timeout

    def gather(self, part: Any) -> list[Any] | None:
        """Every stage's ``part`` on its pipeline's last-stage rank (global rank 0 for the first pipeline)."""
        if self.layout.pipe_size == 1:
            return [part]
        dst = self.layout.last_stage_rank
        parts: list[Any] | None = [None] * self.layout.pipe_size if self.layout.rank == dst else None
        with collective_errors(self.layout.stage, f"gathering the stages' parts on global rank {dst}"):
            dist.gather_object(portable(part), parts, dst=dst, group=self.object_group)
        return parts

    def check_every_rank_saves(self) -> None:
        """Fail at once, with the fix, when ``trainer.save_checkpoint`` runs on some ranks only.

        Under DDP ``if trainer.is_global_zero: trainer.save_checkpoint(...)`` works, since rank 0 holds the whole
        model; here each stage holds its own part, so saving is a collective. The ranks meet in a barrier that gives
        up after a short wait and names the ranks that did not come, instead of a hang until ``timeout``.
        """
        if self.layout.pipe_size == 1 or self.control_group is None:
            return
        wait = min(self.timeout, _SAVE_ARRIVAL_TIMEOUT)
        try:
            dist.monitored_barrier(self.control_group, timeout=wait, wait_all_ranks=True)
        except RuntimeError as error:
            raise RuntimeError(
                f"trainer.save_checkpoint was called on global rank {self.layout.rank}, but not on every rank "
                f"within {wait.total_seconds():.0f} s ({error}). Under GPipeStrategy every rank must call "
                "trainer.save_checkpoint, since the stages hold different parts of the model and optimizer: remove "
                "an `if trainer.is_global_zero:` guard around it (only global rank 0 writes the file)."
            ) from error

    def module_state(self, module: LightningModule) -> dict[str, Any]:
        """The whole module's state dict on the last-stage rank (this stage's part elsewhere)."""
        self.check_every_rank_saves()
        local = {key: value.cpu() for key, value in module.state_dict().items()}
        parts = self.gather(local)
        return local if parts is None else merge_state_dicts(parts, self.names.keys)

    def optimizer_state(self, optimizer: Any, module: LightningModule) -> dict[str, Any]:
        """The whole model's optimizer state, keyed by parameter name, on the last-stage rank."""
        local = _to_cpu(optimizer_state_by_name(optimizer, module, self.names.aliases))
        parts = self.gather(local)
        return local if parts is None else merge_optimizer_states(parts, self.names.parameter_order)

    def load_module_state(self, module: LightningModule, saved: Mapping[str, Any], strict: bool) -> None:
        """Load this stage's part of the whole module's ``saved`` state dict, checked against the whole module."""
        check_loadable(saved, self.names.keys, self.names.shapes, strict)
        local_keys = module.state_dict().keys()
        module.load_state_dict({key: saved[key] for key in local_keys if key in saved}, strict=strict)

    def load_optimizer_states(
        self, optimizers: list[Any], saved: list[Any], module: LightningModule, device: torch.device
    ) -> None:
        """Load this stage's parameters' part of each whole-model optimizer state in ``saved``."""
        for optimizer, state in zip(optimizers, saved, strict=True):
            optimizer.load_state_dict(
                local_optimizer_state(state, optimizer, module, self.names.parameter_order, self.names.aliases)
            )
            optimizers_to_device([optimizer], device)


def save_atomically(io: CheckpointIO, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
    """Write ``checkpoint`` with ``io`` beside a local ``filepath``, then rename it there (remote paths: directly).

    A crash mid-write leaves the previous checkpoint intact.
    """
    if not isinstance(filepath, (str, os.PathLike)) or "://" in str(filepath):
        io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        return
    path = Path(filepath)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        io.save_checkpoint(checkpoint, temporary, storage_options=storage_options)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_cpu(item) for item in value]
    return value
