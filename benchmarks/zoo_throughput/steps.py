"""The training step of every configuration of the zoo throughput benchmark, as built inside a worker process.

Shapes: ``B`` samples per mini-batch, ``M`` micro-batches, ``K`` stages.

=====================  ========================  ==================================================================
configuration          processes x threads       step
=====================  ========================  ==================================================================
``unpipelined``        1 x 1                     whole batch: forward, backward, SGD
``accumulation``       1 x 1                     M-way gradient accumulation: what smaller micro-batches cost alone
``two_threads``        1 x 2                     whole batch with 2 intra-op threads
``ours_k1``            1 x 1                     ``Pipeline`` of one stage (K = 1), M micro-batches
``ours``               2 x 1                     ``Pipeline`` over ``ProcessGroupTransport``, K = 2
``torch_pipelining``   2 x 1                     ``PipelineStage`` + ``ScheduleGPipe``, STATIC, gloo, K = 2
``torchgpipe``         1 x (2 stage threads)     ``torchgpipe.GPipe``, ``devices=["cpu", "cpu"]``, K = 2
=====================  ========================  ==================================================================

Every pipeline keeps all activations (``checkpoint="never"``; torch.distributed.pipelining has no
re-materialization) and uses the same FLOPs-balanced split.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

import zoo
from benchmarks.engine_speed.workloads import schedule_step
from benchmarks.zoo_throughput.models import Batch, LossFn, Workload
from lightning_gpipe.engine.pipeline import Pipeline
from lightning_gpipe.engine.thread_transport import ThreadTransport
from lightning_gpipe.engine.timeline import Timeline
from lightning_gpipe.engine.transport import ProcessGroupTransport, Transport
from lightning_gpipe.partition.balance import split

__all__ = ["CONFIGS", "PROCESSES", "Step", "build_step"]

Step = Callable[[], None]

CONFIGS: tuple[str, ...] = (
    "unpipelined",
    "accumulation",
    "two_threads",
    "ours_k1",
    "ours",
    "torch_pipelining",
    "torchgpipe",
)
PROCESSES: dict[str, int] = {config: 2 if config in ("ours", "torch_pipelining") else 1 for config in CONFIGS}


def _sgd(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=1e-3)


def _accumulation_step(workload: Workload, model: nn.Module, loss_fn: LossFn, batch: Batch, chunks: int) -> Step:
    optimizer = _sgd(model)
    x, target = workload.split(batch)
    pieces = list(zip(x.tensor_split(chunks), target.tensor_split(chunks), strict=True))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for x_mb, target_mb in pieces:
            # Weighted by the micro-batch's share: the summed gradient is the whole batch's mean-loss gradient.
            (loss_fn(model(x_mb), target_mb) * (x_mb.shape[0] / x.shape[0])).backward()
        optimizer.step()

    return step


def _ours_step(
    workload: Workload,
    cell: nn.Module,
    loss_fn: LossFn,
    batch: Batch,
    chunks: int,
    transport: Transport,
    timeline: Timeline | None,
) -> Step:
    pipeline = Pipeline(cell, transport, chunks=chunks, checkpoint="never", timeline=timeline)
    optimizer = _sgd(cell)

    def input_fn(microbatch: Batch) -> torch.Tensor:
        return workload.split(microbatch)[0]

    def micro_loss(output: torch.Tensor, microbatch: Batch) -> torch.Tensor:
        return loss_fn(output, workload.split(microbatch)[1])

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        pipeline.train_step(batch, micro_loss, input_fn)
        optimizer.step()

    return step


class _PositionalStage(nn.Module):
    """A zoo cell under ``PipelineStage``, which passes a tuple boundary as separate positional arguments.

    The zoo's layers take one value (a tensor or a tuple of tensors), so the arguments are packed back into the tuple.
    """

    def __init__(self, cell: nn.Module) -> None:
        super().__init__()
        self.cell = cell

    def forward(self, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        output: torch.Tensor | tuple[torch.Tensor, ...] = self.cell(args[0] if len(args) == 1 else args)
        return output


def _as_tuple(value: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)


def _torch_pipelining_step(
    workload: Workload, cells: Sequence[nn.Module], loss_fn: LossFn, batch: Batch, chunks: int, rank: int
) -> Step:
    # Imported here: the module costs seconds to import, and only this configuration needs it.
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    x, target = workload.split(batch)
    if x.shape[0] % chunks:
        raise ValueError(f"torch.distributed.pipelining needs equal micro-batches: {x.shape[0]} % {chunks} != 0")
    # STATIC mode (input_args and output_args on every stage): no shape-inference pass on uninitialized memory, which
    # would also corrupt BatchNorm statistics. Examples are one micro-batch, computed by running the cells before.
    value: torch.Tensor | tuple[torch.Tensor, ...] = x[: x.shape[0] // chunks]
    with torch.no_grad():
        for cell in cells[:rank]:
            value = cell(value)
        stage_input = _as_tuple(value)
        stage_output = _as_tuple(cells[rank](value))
    if rank > 0:
        # Boundary examples must require grad, or no gradient is exchanged and the previous stage's backward fails.
        stage_input = tuple(t.clone().requires_grad_(t.is_floating_point()) for t in stage_input)
    stage_output = tuple(t.clone().requires_grad_(t.is_floating_point()) for t in stage_output)
    stage = PipelineStage(
        _PositionalStage(cells[rank]),
        rank,
        len(cells),
        torch.device("cpu"),
        input_args=stage_input,
        output_args=stage_output,
    )
    schedule = ScheduleGPipe(stage, chunks, loss_fn=loss_fn, scale_grads=True)
    return schedule_step(schedule, _sgd(cells[rank]), rank, x, target)


def _torchgpipe_step(
    workload: Workload, model: nn.Sequential, loss_fn: LossFn, batch: Batch, chunks: int, balance: Sequence[int]
) -> Step:
    from torchgpipe import GPipe

    # Its stages are threads of this one process; checkpoint="never" keeps every activation, like the others.
    pipe = GPipe(model, list(balance), devices=["cpu"] * len(balance), chunks=chunks, checkpoint="never")
    optimizer = _sgd(pipe)
    x, target = workload.split(batch)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(pipe(x), target).backward()
        optimizer.step()

    return step


def build_step(
    workload: Workload,
    config: str,
    chunks: int,
    balance: Sequence[int],
    rank: int = 0,
    timeline: Timeline | None = None,
    model: zoo.ZooModule | None = None,
) -> Step:
    """One training step of ``config`` for this process (``rank`` is the stage of a two-process configuration).

    ``model`` is the model to train (its parameters are updated in place); by default the workload builds it.
    """
    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}; use one of {', '.join(CONFIGS)}")
    model = workload.build() if model is None else model
    loss_fn = workload.loss_fn(model)
    layers = model.layers
    batch = workload.batch()
    if config == "ours":
        cell = split(layers, balance)[rank]
        return _ours_step(workload, cell, loss_fn, batch, chunks, ProcessGroupTransport([0, 1]), timeline)
    if config == "ours_k1":
        return _ours_step(workload, layers, loss_fn, batch, chunks, ThreadTransport.create(1)[0], timeline)
    if config == "torch_pipelining":
        return _torch_pipelining_step(workload, split(layers, balance), loss_fn, batch, chunks, rank)
    if config == "torchgpipe":
        return _torchgpipe_step(workload, layers, loss_fn, batch, chunks, balance)
    # unpipelined and two_threads run the whole batch at once; accumulation splits it like the pipelines do.
    return _accumulation_step(workload, layers, loss_fn, batch, chunks if config == "accumulation" else 1)
