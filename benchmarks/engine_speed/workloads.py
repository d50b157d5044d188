"""The two workloads and the training step of every configuration, as built inside a worker process.

Shapes: ``B`` samples per mini-batch, ``T`` tokens per sample, ``D`` model width, ``M`` micro-batches, ``K`` stages.

Every configuration trains the same model (same seed, same layers) on the same mini-batch with the same mean-reduced
MSE loss and plain SGD, so they differ only in how the work is spread over threads, micro-batches and processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_gpipe.engine.pipeline import Pipeline
from lightning_gpipe.engine.timeline import Timeline
from lightning_gpipe.engine.transport import ProcessGroupTransport

__all__ = [
    "CONFIGS",
    "K",
    "PIPELINED",
    "WORKLOADS",
    "Step",
    "Workload",
    "build_step",
    "schedule_step",
]

K = 2  # stages, one process each
CONFIGS: tuple[str, ...] = (
    "unpipelined",
    "accumulation",
    "two_threads",
    "ours",
    "ours_described",
    "torch_pipelining",
)
PIPELINED: frozenset[str] = frozenset({"ours", "ours_described", "torch_pipelining"})

Step = Callable[[], None]
Batch = tuple[torch.Tensor, torch.Tensor]  # x, y: input and regression target, both (B, *sample_shape)


@dataclass(frozen=True)
class Workload:
    """A model cut into ``K`` equal halves, and the mini-batch every configuration trains on."""

    name: str
    title: str
    batch_size: int
    sample_shape: tuple[int, ...]  # one sample's input (and target) shape
    build_layers: Callable[[], list[nn.Module]]

    def batch(self) -> Batch:
        """The same ``(x, y)`` for every step and configuration: only speed is measured."""
        generator = torch.Generator().manual_seed(1)
        shape = (self.batch_size, *self.sample_shape)
        return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


# Realistic: 8 Transformer encoder layers, B, T, D = 16, 64, 256: 0.65-0.75 s per unpipelined step on one thread here.
TRANSFORMER_LAYERS, B_TFM, T_TFM, D_TFM = 8, 16, 64, 256


def _transformer_layers() -> list[nn.Module]:
    return [
        nn.TransformerEncoderLayer(D_TFM, nhead=8, dim_feedforward=4 * D_TFM, dropout=0.1, batch_first=True)
        for _ in range(TRANSFORMER_LAYERS)
    ]


# Overhead-bound: 4 x (Linear(64, 64) + ReLU) per stage on B = 256: each pass is tens of microseconds of math, so
# the step time is the engine's own per-micro-batch cost (Python, messages).
SMALL_LAYERS, B_SMALL, D_SMALL = 8, 256, 64


def _small_layers() -> list[nn.Module]:
    return [nn.Sequential(nn.Linear(D_SMALL, D_SMALL), nn.ReLU()) for _ in range(SMALL_LAYERS)]


WORKLOADS: dict[str, Workload] = {
    "transformer": Workload(
        "transformer",
        f"{TRANSFORMER_LAYERS} x TransformerEncoderLayer(d_model={D_TFM}, nhead=8, ff={4 * D_TFM}), "
        f"batch {B_TFM} x seq {T_TFM}",
        B_TFM,
        (T_TFM, D_TFM),
        _transformer_layers,
    ),
    "small": Workload(
        "small",
        f"{SMALL_LAYERS} x (Linear({D_SMALL}, {D_SMALL}) + ReLU), batch {B_SMALL}",
        B_SMALL,
        (D_SMALL,),
        _small_layers,
    ),
}


def _mse_on_target(output: torch.Tensor, batch: Batch) -> torch.Tensor:
    return F.mse_loss(output, batch[1])


def _sgd(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=1e-3)


def _single_process_step(model: nn.Module, batch: Batch, chunks: int) -> Step:
    optimizer = _sgd(model)
    x, y = batch
    pieces = list(zip(x.tensor_split(chunks), y.tensor_split(chunks), strict=True))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for x_mb, y_mb in pieces:
            # Weighted by the micro-batch's share: the summed gradient is the whole batch's mean-loss gradient.
            (F.mse_loss(model(x_mb), y_mb) * (x_mb.shape[0] / x.shape[0])).backward()
        optimizer.step()

    return step


def _ours_step(cell: nn.Module, batch: Batch, chunks: int, timeline: Timeline | None, described: bool = False) -> Step:
    # checkpoint="never": torch.distributed.pipelining has no built-in re-materialization, so for a like-for-like
    # comparison both engines keep every micro-batch's activations until its backward.
    pipeline = Pipeline(cell, ProcessGroupTransport([0, 1]), chunks=chunks, checkpoint="never", timeline=timeline)
    outbox = pipeline.stage._outbox
    if described and outbox is not None:
        # What shapes that vary per micro-batch cost in messages alone, on the same arithmetic: the link sends every
        # step as after a shape change (a layout message per micro-batch, receives posted one micro-batch ahead).
        outbox._ragged = True
    optimizer = _sgd(cell)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        pipeline.train_step(batch, _mse_on_target)
        optimizer.step()

    return step


def _torch_pipelining_step(cell: nn.Module, batch: Batch, chunks: int, rank: int) -> Step:
    # Imported here: the module costs seconds to import, and only this configuration needs it.
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    x, y = batch
    if x.shape[0] % chunks:
        raise ValueError(f"torch.distributed.pipelining needs equal micro-batches: {x.shape[0]} % {chunks} != 0")
    # STATIC mode (input_args and output_args on every stage): no shape-inference pass on uninitialized memory.
    # Boundary examples must require grad, or no gradient is exchanged and stage 0's backward fails.
    boundary = torch.zeros((x.shape[0] // chunks, *x.shape[1:]), requires_grad=True)
    stage_input = x[: x.shape[0] // chunks] if rank == 0 else boundary
    with torch.no_grad():
        # A real stage output requires grad (it comes out of layers with parameters); the example must say so too.
        stage_output = cell(stage_input).requires_grad_(True)
    stage = PipelineStage(cell, rank, K, torch.device("cpu"), input_args=(stage_input,), output_args=(stage_output,))
    schedule = ScheduleGPipe(stage, chunks, loss_fn=F.mse_loss, scale_grads=True)
    return schedule_step(schedule, _sgd(cell), rank, x, y)


def schedule_step(
    schedule: Any, optimizer: torch.optim.Optimizer, rank: int, inputs: Any, target: Any, scores: bool | None = None
) -> Step:
    """One training step of a ``torch.distributed.pipelining`` schedule: rank 0 (stage 0) feeds ``inputs``, the rank
    that ``scores`` (holds the last stage; by default every other rank) scores ``target``; the losses stay inside the
    schedule (``return_outputs=False``, as in our pipeline)."""
    losses: list[torch.Tensor] = []
    args = (inputs,) if rank == 0 else ()
    scored = rank != 0 if scores is None else scores

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        if scored:
            losses.clear()
            schedule.step(*args, target=target, losses=losses, return_outputs=False)
        else:
            schedule.step(*args, return_outputs=False)
        optimizer.step()

    return step


def build_step(workload: Workload, config: str, chunks: int, rank: int, timeline: Timeline | None = None) -> Step:
    """One training step of ``config`` for this process (``rank`` is the stage of the pipelined configurations)."""
    torch.manual_seed(0)  # every process builds the same model and keeps its own half
    layers = workload.build_layers()
    batch = workload.batch()
    if config in PIPELINED:
        half = len(layers) // K
        cell = nn.Sequential(*layers[rank * half : (rank + 1) * half])
        if config in ("ours", "ours_described"):
            return _ours_step(cell, batch, chunks, timeline, described=config == "ours_described")
        return _torch_pipelining_step(cell, batch, chunks, rank)
    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}; use one of {', '.join(CONFIGS)}")
    model = nn.Sequential(*layers)
    # unpipelined and two_threads run the whole batch at once; accumulation splits it like the pipelines do.
    return _single_process_step(model, batch, chunks if config == "accumulation" else 1)
