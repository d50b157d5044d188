"""The scaled-down zoo models and the settings of the memory benchmark, importable without torch.

Settings (the GPipe paper's Table 1 columns):

- ``naive-1``: the whole model on one rank, plain forward, backward and optimizer step on the whole mini-batch;
- ``pipeline-1``: the engine on one rank, ``Pipeline(chunks=M, checkpoint="always")``: M micro-batches, every
  micro-batch re-materialized during backward;
- ``pipeline-2``: the same on K = 2 ranks (one process each, gloo over loopback), the layers split by
  ``lightning_gpipe.profile.cost.memory_cost`` with ``balance_by_cost``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import zoo

__all__ = ["MODELS", "SEQUENCE_LENGTH", "SETTINGS", "ModelScale", "Probe"]

SETTINGS: tuple[str, ...] = ("naive-1", "pipeline-1", "pipeline-2")


@dataclass(frozen=True)
class ModelScale:
    """A zoo model scaled down with the paper's proportions; ``size`` (the searched knob) is set per probe."""

    name: str  # the zoo registry name
    knob: str  # the constructor argument the search varies
    fixed: tuple[tuple[str, Any], ...]  # the other constructor arguments
    batch_size: int
    chunks: int  # M of the pipelined settings
    slots: int  # parameter-sized optimizer tensors per parameter (2: Adam, RMSProp with momentum)
    step: int  # the knob moves in multiples of this (AmoebaNet's filters are multiples of 4)
    budget_mib: int  # the fixed memory budget per rank the search fits models into

    def build(self, size: int) -> zoo.ZooModule:
        """The zoo model with ``knob=size``."""
        import zoo  # here: the orchestrator reads these scales without importing torch

        model = zoo.create_model(self.name, **dict(self.fixed), **{self.knob: size})
        assert isinstance(model, zoo.ZooModule)
        return model


# Transformer-L (paper: D 2048, H 8192, 32 heads of 64 channels, V 32k, T 1024, batch 32): D, H, V and the heads
# divided by 32 (one head of 64 channels: the same per-head width and D:H:V ratios), T by 8 and the batch by 4.
# AmoebaNet-D (paper: (18, D), 224 px, batch 128): 6 normal cells, 56 px, batch 16; the filters D are searched.
MODELS: dict[str, ModelScale] = {
    "transformer_lm": ModelScale(
        "transformer_lm",
        "num_layers",
        (("d_model", 64), ("ff_dim", 256), ("num_heads", 1), ("vocab_size", 1000), ("dropout", 0.1)),
        batch_size=8,
        chunks=8,
        slots=2,
        step=1,
        budget_mib=40,
    ),
    "amoebanet_d": ModelScale(
        "amoebanet_d",
        "num_filters",
        (("num_layers", 6), ("num_classes", 100), ("image_size", 56)),
        batch_size=16,
        chunks=4,
        slots=2,
        step=4,
        budget_mib=24,
    ),
}
SEQUENCE_LENGTH = 128  # tokens per Transformer-L sample (predicting T tokens needs T + 1)


@dataclass(frozen=True)
class Probe:
    """One fresh-process measurement: ``model`` at ``size`` (layers or filters) in ``setting``."""

    model: str
    size: int
    setting: str

    @property
    def world_size(self) -> int:
        return 2 if self.setting == "pipeline-2" else 1

    def __str__(self) -> str:
        return f"{self.model}({MODELS[self.model].knob}={self.size})/{self.setting}"
