"""One bubble measurement in K fresh processes: equal Transformer stages, the engine's timeline of every timed step.

Shapes: ``B`` samples per mini-batch, ``T`` tokens per sample, ``D`` model width, ``M`` micro-batches, ``K`` stages.

Every stage holds the same number of the zoo's Transformer-L layers (``zoo.TransformerLM(...).layers`` without its
embedding and softmax, so that the stages are equal), runs one thread, and trains on the same ``[B, T, D]`` batch
with an MSE loss and SGD. ``checkpoint="never"``: the formula assumes each micro-batch's forward and backward take the
same time on every stage, which re-materialization breaks (the last micro-batch of ``except_last`` is not recomputed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zoo
from benchmarks.engine_speed.cpuload import foreign_cores, snapshot
from lightning_gpipe.engine.pipeline import Pipeline
from lightning_gpipe.engine.timeline import SpanRecord, Timeline
from lightning_gpipe.engine.transport import ProcessGroupTransport

__all__ = ["BATCH", "LAYERS_PER_STAGE", "Job", "JobResult", "measure_rank", "stage_layers"]

# One stage = 2 layers of Transformer-L scaled to D 128, H 512, 2 heads of 64 (the paper's D:H ratio and head width),
# on B x T = 32 x 64 tokens: a step is about half a second of compute per stage, split into M <= 32 micro-batches.
LAYERS_PER_STAGE, D_MODEL, FF_DIM, HEADS = 2, 128, 512, 2
BATCH, TOKENS = 32, 64


@dataclass(frozen=True)
class Job:
    """``stages`` processes, ``chunks`` micro-batches, ``warmup`` untimed then ``steps`` timed training steps."""

    stages: int
    chunks: int
    warmup: int
    steps: int


@dataclass
class JobResult:
    """Per timed step, the spans of all stages merged; and the cores other processes kept busy meanwhile."""

    timelines: list[list[SpanRecord]] = field(default_factory=list)
    foreign_cores: float = 0.0


def stage_layers(stages: int, stage: int) -> nn.Sequential:
    """Stage ``stage``'s equal share of a Transformer-L of ``stages x LAYERS_PER_STAGE`` layers (same seed on all)."""
    torch.manual_seed(0)
    model = zoo.create_model(
        "transformer_lm",
        num_layers=stages * LAYERS_PER_STAGE,
        d_model=D_MODEL,
        ff_dim=FF_DIM,
        num_heads=HEADS,
        vocab_size=8,
        dropout=0.0,
    )
    assert isinstance(model.layers, nn.Sequential)
    blocks = list(model.layers)[1:-1]  # the Transformer layers, without the embedding and the softmax
    return nn.Sequential(*blocks[stage * LAYERS_PER_STAGE : (stage + 1) * LAYERS_PER_STAGE])


def _gather(value: object, world_size: int) -> list[object]:
    gathered: list[object] = [None] * world_size
    dist.all_gather_object(gathered, value)
    return gathered


def measure_rank(rank: int, world_size: int, job: Job, observer_pid: int) -> JobResult | None:
    """Run ``job`` as stage ``rank``; rank 0 returns the merged timelines and the foreign load, the others ``None``."""
    cell = stage_layers(world_size, rank)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, TOKENS, D_MODEL, generator=generator)
    batch = (x, torch.randn(BATCH, TOKENS, D_MODEL, generator=generator))
    timeline = Timeline()
    pipeline = Pipeline(cell, ProcessGroupTransport(list(range(world_size))), chunks=job.chunks, checkpoint="never",
                        timeline=timeline)  # fmt: skip
    optimizer = torch.optim.SGD(cell.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        pipeline.train_step(batch, lambda output, mb: F.mse_loss(output, mb[1]))
        optimizer.step()

    for _ in range(job.warmup):
        step()
    pids = [int(pid) for pid in _gather(os.getpid(), world_size)] + [observer_pid]  # type: ignore[call-overload]
    dist.barrier()
    start = snapshot(pids)
    records: list[list[SpanRecord]] = []
    for _ in range(job.steps):
        timeline.clear()
        dist.barrier()  # every step starts together, so its span is the pipeline's and not a straggler's
        step()
        records.append(timeline.to_records())
    dist.barrier()
    load = foreign_cores(start, snapshot(pids))
    everyone = _gather(records, world_size)
    if rank != 0:
        return None
    merged = [sorted(sum((stage[n] for stage in everyone), [])) for n in range(job.steps)]  # type: ignore[index]
    return JobResult(merged, load)
