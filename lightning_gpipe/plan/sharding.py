"""How the replicas of a process's stages share them, as the planner predicts it: whole (``"ddp"``) or sharded
(``"fsdp"``).

Under ``"ddp"`` each replica holds its stages whole: parameters, gradients and optimizer state live between steps, and
the gradients are averaged by one all-reduce after the step. Under ``"fsdp"`` each layer is an FSDP2 unit sharded over
the R replicas, run as :mod:`~lightning_gpipe.engine.sharding` runs it, so a process holds:

- between steps, 1/R of every parameter, of its gradient and of its optimizer state (buffers stay whole);
- from the step's start to its end, every unit's parameters gathered whole (:meth:`Sharing.gathered`), and while a
  unit's gather is copied out, its flat all-gather output beside them (:meth:`Sharing.gathering`);
- from a stage's first backward pass to the step's end, the stage's gradients accumulated whole
  (:meth:`Sharing.gradients`);
- at the step's end, one unit at a time, the unit's gradients copied into a flat reduce-scatter input beside its output
  shard (:meth:`Sharing.reducing`; under ``"ddp"`` every gradient copied into the all-reduce's flat buckets), then the
  whole gradients and parameters freed;
- in the optimizer step, which runs on the shards, 1/R of the temporaries.

In time, a step's gathers all start when it begins and a process runs its first action once they are done
(:meth:`Sharing.gather_seconds`); each stage reduce-scatters its gradients after its last action, before its optimizer
step (:meth:`Sharing.reduce_seconds`); each moves (R-1)/R of the bytes, over the same link as the ``"ddp"``
all-reduce, which moves twice that (:meth:`Sharing.allreduce_seconds`). FSDP pads each parameter's first dimension
to a multiple of R, which the planner leaves out (at most R - 1 rows per parameter).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from lightning_gpipe.partition.config import DataParallel
from lightning_gpipe.profile.layer_profile import LayerProfile, ModelProfile

__all__ = ["DATA_PARALLEL_CHOICES", "PlannedDataParallel", "Sharing", "check_data_parallel"]

PlannedDataParallel = Literal["ddp", "fsdp", "auto"]
"""What the planner weighs: whole replicas (``"ddp"``), sharded ones (``"fsdp"``), or whole ones and, only when no
configuration fits whole, sharded ones (``"auto"``)."""
DATA_PARALLEL_CHOICES: tuple[str, ...] = get_args(PlannedDataParallel)
"""The values of :data:`PlannedDataParallel`, for checks and the command line."""


def check_data_parallel(value: object) -> PlannedDataParallel:
    """``value`` if it is one of :data:`DATA_PARALLEL_CHOICES`.

    Raises:
        ValueError: any other value.
    """
    if value not in DATA_PARALLEL_CHOICES:
        raise ValueError(f"data_parallel={value!r} is not a way to plan the replicas; use 'ddp', 'fsdp' or 'auto'")
    return value  # type: ignore[return-value]


@dataclass(frozen=True)
class Sharing:
    """The ``replicas`` of a process's stages and how they share them (see the module's docstring); build it with
    :meth:`of`, which runs ``"fsdp"`` over one replica as ``"ddp"``, as the strategy does."""

    data_parallel: DataParallel = "ddp"
    replicas: int = 1

    @classmethod
    def of(cls, data_parallel: DataParallel, replicas: int) -> Sharing:
        """How ``replicas`` replicas run under ``data_parallel``: one replica has nothing to shard over."""
        return cls(data_parallel if replicas > 1 else "ddp", replicas)

    @property
    def sharded(self) -> bool:
        """Whether each replica holds a shard of the stages rather than the whole."""
        return self.data_parallel == "fsdp" and self.replicas > 1

    def _share(self, nbytes: float) -> float:
        return nbytes / self.replicas if self.sharded else float(nbytes)

    def state(self, layers: Sequence[LayerProfile], optimizer_slots: float) -> float:
        """Bytes held between steps: parameters, gradients, optimizer slots (each 1/R when sharded) and buffers."""
        trainable = sum(layer.trainable_bytes for layer in layers)
        held = sum(layer.param_bytes for layer in layers) + trainable * (1.0 + optimizer_slots)
        return self._share(held) + sum(layer.buffer_bytes for layer in layers)

    def gathered(self, layers: Sequence[LayerProfile]) -> float:
        """Bytes of parameters gathered whole for the whole step (none when whole already)."""
        return float(sum(layer.param_bytes for layer in layers)) if self.sharded else 0.0

    def gathering(self, layers: Sequence[LayerProfile]) -> float:
        """Bytes beside the gathered parameters while a unit's gather is copied out: its flat all-gather output."""
        return float(max((layer.param_bytes for layer in layers), default=0)) if self.sharded else 0.0

    def gradients(self, layers: Sequence[LayerProfile]) -> tuple[float, ...]:
        """For each layer, the whole gradients of it and the layers after it: what a stage's first backward pass has
        created by the time it reaches that layer (all zero when whole: the gradients are state)."""
        created, total = [], 0.0
        for layer in reversed(layers):
            total += layer.trainable_bytes if self.sharded else 0.0
            created.append(total)
        return tuple(reversed(created))

    def reducing(self, layers: Sequence[LayerProfile]) -> float:
        """Bytes beside the gradients while the replicas average them: sharded, the largest unit's flat reduce-scatter
        input and its output shard; whole, every gradient copied into the all-reduce's flat buckets, all started
        before the first is waited for (:func:`~lightning_gpipe.engine.gradients.average_gradients`)."""
        if self.replicas == 1:
            return 0.0
        if not self.sharded:
            return float(sum(layer.trainable_bytes for layer in layers))
        return max((layer.trainable_bytes for layer in layers), default=0) * (1.0 + 1.0 / self.replicas)

    def optimizer(self, layers: Sequence[LayerProfile], optimizer_slots: float) -> float:
        """Temporaries of the optimizer step (``foreach`` kernels): about one copy of what it updates."""
        return self._share(sum(layer.trainable_bytes for layer in layers)) if optimizer_slots > 0 else 0.0

    def update_seconds(self, profile: ModelProfile, cell: range) -> float:
        """Seconds of the optimizer step of a stage holding the layers ``cell``: over 1/R of each layer's parameters
        when sharded, the step's own cost per call whole."""
        whole = profile.stage_update(cell)
        if not self.sharded or not profile.updates:
            return whole
        layers = sum(profile.updates[i] for i in cell)
        return whole - layers + layers / self.replicas

    def gather_seconds(self, layers: Sequence[LayerProfile], bandwidth: float) -> float:
        """Seconds before a process's first action: its stages' parameters gathered over the replicas' link."""
        if not self.sharded:
            return 0.0
        return (self.replicas - 1) / self.replicas * sum(layer.param_bytes for layer in layers) / bandwidth

    def reduce_seconds(self, layers: Sequence[LayerProfile], bandwidth: float) -> float:
        """Seconds of a stage's reduce-scatter of its gradients at the step's end (none when whole)."""
        if not self.sharded:
            return 0.0
        return (self.replicas - 1) / self.replicas * sum(layer.trainable_bytes for layer in layers) / bandwidth

    def allreduce_seconds(self, layers: Sequence[LayerProfile], bandwidth: float) -> float:
        """Seconds of a ring all-reduce of a process's gradients after the step (none when sharded, or alone)."""
        if self.sharded or self.replicas == 1:
            return 0.0
        return 2 * (self.replicas - 1) / self.replicas * sum(layer.trainable_bytes for layer in layers) / bandwidth
