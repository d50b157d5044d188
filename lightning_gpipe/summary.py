"""The pipeline's summary: which process holds which stages, layers and parameters, printed once on global rank 0.

Lightning's model summary runs on rank 0 and sees only its own stage; this table shows the whole pipeline.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_gpipe.engine.layout import ProcessLayout
from lightning_gpipe.partition.assembly import AssembledStage

__all__ = ["describe_pipeline"]


def describe_pipeline(layout: ProcessLayout, chunks: int, assembled: AssembledStage) -> None:
    """Gather every rank's stage (a collective over the world) and print the first pipeline's through Lightning's
    logger, with the (all, trainable) parameter counts of each stage and of the unsplit module."""
    path, num_layers = assembled.partition.path, len(assembled.partition.original)
    rows: list[Any] = [None] * layout.world_size
    bounds = assembled.partition.bounds
    held = [(stage, list(bounds[stage])) for stage in layout.stages]
    own = (layout.replica, min(layout.stages), layout.rank, held, assembled.stage_parameters)
    dist.all_gather_object(rows, own)
    pipelines = "pipeline" if layout.num_replicas == 1 else "data-parallel pipelines"
    per = len(layout.stages)
    stages = f"{layout.num_stages} stage{'s' if layout.num_stages > 1 else ''}"
    if per > 1:
        stages += f" ({per} per process)"
    microbatches = (
        "one micro-batch per batch (chunks=1)"
        if chunks == 1
        else f"up to chunks={chunks} micro-batches per batch (a batch of N < {chunks} samples runs N)"
    )
    lines = [f"GPipe: {layout.num_replicas} {pipelines} of {stages}, {microbatches}; {path!r} has {num_layers} layers"]
    for _replica, _first, rank, held, (count, trainable) in sorted(row for row in rows if row[0] == 0):
        stages = ", ".join(str(stage) for stage, _ in held)
        ranges = " and ".join(f"{layers[0]}-{layers[-1]}" for _, layers in held)
        lines.append(
            f"  stage{'s' if len(held) > 1 else ''} {stages} (rank {rank}): layers {ranges}, {count:,} parameters "
            f"({trainable:,} trainable)"
        )
    whole = assembled.whole_parameters
    lines.append(
        f"  whole model: {whole[0]:,} parameters ({whole[1]:,} trainable); Lightning's model summary counts only "
        f"stage{'s' if per > 1 else ''} {', '.join(map(str, layout.stages))}, the one{'s' if per > 1 else ''} on "
        f"rank {layout.rank}"
    )
    rank_zero_info("\n".join(lines))
