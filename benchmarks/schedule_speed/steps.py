"""The training step of each engine under each schedule, as built inside a worker process, and what it counts.

Every job trains the same model (same seed, same layers) on the same mini-batch with the same mean-reduced MSE loss
and plain SGD. The model is cut into ``K·v`` equal stages (``v`` stages per process: 2 for ``"interleaved"`` and
``"zbv"``, else 1), process ``r`` holding the stages the schedule gives it
(:func:`~lightning_gpipe.engine.schedule.stages_of`). Both engines keep every activation (``checkpoint="never"``:
torch.distributed.pipelining has no re-materialization).

Variants of our step: ``"compiled"`` compiles each layer in place (``torch.compile``, static shapes, as
``GPipeStrategy(compile=True)`` does); ``"varlen"`` changes the sequence length at every step (``T - T/4``, ``T``,
``T + T/4`` in turn: the same tokens per step on average). torch's counterparts are built too, to record what torch
does with them (:func:`torch_refusal`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.engine_speed.worker import Job
from benchmarks.engine_speed.workloads import schedule_step
from benchmarks.schedule_memory.run import SavedBytes
from lightning_gpipe.engine.layout import new_link_groups
from lightning_gpipe.engine.pipeline import Pipeline
from lightning_gpipe.engine.schedule import MULTI_STAGE, SCHEDULES, process_of, stages_of
from lightning_gpipe.engine.timeline import Timeline
from lightning_gpipe.engine.transport import ProcessGroupTransport

__all__ = [
    "ENGINES",
    "MULTI_STAGE",
    "SCHEDULE_NAMES",
    "VARIANTS",
    "Model",
    "ScheduleJob",
    "engine_runs",
    "schedule_job",
    "stage_cells",
    "stages_per_process",
    "torch_refusal",
]

SCHEDULE_NAMES: tuple[str, ...] = ("gpipe", "1f1b", "zero_bubble", "interleaved", "zbv")
ENGINES: tuple[str, ...] = ("ours", "torch")
VARIANTS: tuple[str, ...] = ("", "compiled", "varlen")
VIRTUAL_STAGES = 2  # v of "interleaved"; "zbv" always holds 2 stages per process

Step = Callable[[], None]

# torch.distributed.pipelining's class for each schedule (one stage per rank for the first three, a list for the rest).
TORCH_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
    "interleaved": "ScheduleInterleaved1F1B",
    "zbv": "ScheduleZBVZeroBubble",
}


def stages_per_process(schedule: str) -> int:
    """``v``: the stages each process holds under ``schedule``."""
    return VIRTUAL_STAGES if schedule in MULTI_STAGE else 1


def engine_runs(schedule: str) -> bool:
    """Whether our engine runs ``schedule`` in this checkout (the multi-stage ones land later)."""
    return schedule in SCHEDULES


@dataclass(frozen=True)
class Model:
    """``layers`` Transformer encoder layers of width ``width``, trained on ``batch`` samples of ``tokens`` tokens."""

    layers: int = 8
    width: int = 128
    heads: int = 4
    batch: int = 16
    tokens: int = 64

    def build(self) -> list[nn.Module]:
        torch.manual_seed(0)  # every process builds the same model and keeps its own stages
        return [
            nn.TransformerEncoderLayer(self.width, self.heads, 4 * self.width, dropout=0.0, batch_first=True)
            for _ in range(self.layers)
        ]

    def data(self, tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The same ``(x, y)`` at every step (only speed is measured), ``tokens`` long (default :attr:`tokens`)."""
        generator = torch.Generator().manual_seed(1)
        shape = (self.batch, tokens or self.tokens, self.width)
        return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)

    def title(self) -> str:
        return (
            f"{self.layers} x TransformerEncoderLayer(d_model={self.width}, nhead={self.heads}, "
            f"ff={4 * self.width}), batch {self.batch} x seq {self.tokens}"
        )


def varlen_delta(model: Model) -> int:
    """The variable-length step cycles through ``T - d``, ``T``, ``T + d`` tokens: the same ``T`` on average."""
    return model.tokens // 4


@dataclass(frozen=True)
class ScheduleJob(Job):
    """One ``engine`` (``"ours"`` or ``"torch"``) under one ``schedule`` on ``processes`` processes; make it with
    :func:`schedule_job`, which names it ``workload = "<schedule>/K=<processes>"``, ``config = "<engine>[+variant]"``.

    The step counts the activations autograd saves on its first (warm-up) call and reports their peak per process
    (:meth:`CountingStep.report`), so the timed steps run without the counting hooks.
    """

    schedule: str = "gpipe"
    engine: str = "ours"
    processes: int = 2
    variant: str = ""
    model: Model = Model()

    @property
    def world_size(self) -> int:
        return self.processes

    @property
    def threads(self) -> int:
        return 1

    def build_step(self, rank: int, timeline: Timeline | None) -> CountingStep:
        cells = stage_cells(self.model, self.schedule, rank, self.processes)
        if self.engine != "ours":
            return CountingStep(_torch_step(self.schedule, cells, self.processes, self.chunks, self.model))
        # A variant's activations are not compared; and compiling under the counting hooks compiles other graphs.
        return CountingStep(_ours_step(self, cells, timeline), count=not self.variant)


def schedule_job(
    schedule: str,
    engine: str,
    processes: int,
    chunks: int,
    steps: tuple[int, int],
    variant: str = "",
    model: Model = Model(),
    record_timeline: bool = False,
) -> ScheduleJob:
    """The job of ``engine`` under ``schedule``, K = ``processes``, M = ``chunks``, ``steps`` = (warm-up, timed)."""
    config = f"{engine}+{variant}" if variant else engine
    return ScheduleJob(
        f"{schedule}/K={processes}",
        config,
        chunks,
        *steps,
        record_timeline=record_timeline,
        schedule=schedule,
        engine=engine,
        processes=processes,
        variant=variant,
        model=model,
    )


def stage_cells(model: Model, schedule: str, rank: int, processes: int) -> dict[int, nn.Sequential]:
    """The stages process ``rank`` holds, by stage index: ``K·v`` equal slices of ``model``'s layers."""
    layers = model.build()
    v = stages_per_process(schedule)
    if len(layers) % (processes * v):
        raise ValueError(f"{len(layers)} layers do not cut into K*v = {processes * v} equal stages")
    per_stage = len(layers) // (processes * v)
    return {
        s: nn.Sequential(*layers[s * per_stage : (s + 1) * per_stage]) for s in stages_of(schedule, rank, processes, v)
    }


class CountingStep:
    """A step whose first call counts the bytes autograd saves at once at its peak (:meth:`report` gives them)."""

    def __init__(self, step: Step, count: bool = True) -> None:
        self._step = step
        self._count = count
        self._counter: SavedBytes | None = None

    def __call__(self) -> None:
        if self._counter is not None or not self._count:
            self._step()
            return
        # Only in the main thread: the hooks are thread-local, and every engine here computes in its caller's thread.
        assert threading.current_thread() is threading.main_thread()
        self._counter = SavedBytes()
        with self._counter.hooks():
            self._step()

    def report(self) -> int:
        """The peak saved-activation bytes of the first step (0 before it ran)."""
        return self._counter.peak if self._counter is not None else 0


def _sgd(cells: Mapping[int, nn.Module]) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for cell in cells.values() for p in cell.parameters()], lr=1e-3)


def _mse_on_target(output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(output, batch[1])


def _ours_step(job: ScheduleJob, cells: dict[int, nn.Sequential], timeline: Timeline | None) -> Step:
    schedule, K, M, model, variant = job.schedule, job.processes, job.chunks, job.model, job.variant
    if not engine_runs(schedule):
        raise RuntimeError(f"our engine does not run schedule={schedule!r} yet (it runs {', '.join(SCHEDULES)})")
    if variant == "compiled":
        from lightning_gpipe.partition.compile import compile_layers

        compile_layers([layer for cell in cells.values() for layer in cell], {"dynamic": False})
    v = stages_per_process(schedule)
    if v == 1:
        (cell,) = cells.values()
        pipeline = Pipeline(
            cell,
            ProcessGroupTransport(list(range(K))),
            chunks=M,
            checkpoint="never",
            schedule=schedule,
            timeline=timeline,
        )
    else:
        ranks = [process_of(schedule, s, K, v) for s in range(K * v)]
        # Groups per link between two processes: several links join the same two processes, and must not mix.
        links = new_link_groups(ranks)
        transports = ProcessGroupTransport.for_stages(ranks, tuple(cells), links=links)
        pipeline = Pipeline(
            cells,
            transports,
            chunks=M,
            checkpoint="never",
            schedule=schedule,
            virtual_stages=v,
            timeline=timeline,
        )
    optimizer = _sgd(cells)
    delta = varlen_delta(model)
    lengths = [model.tokens - delta, model.tokens, model.tokens + delta] if variant == "varlen" else []
    batches = [model.data(tokens) for tokens in lengths] or [model.data()]
    count = 0

    def step() -> None:
        nonlocal count
        optimizer.zero_grad(set_to_none=True)
        pipeline.train_step(batches[count % len(batches)], _mse_on_target)
        optimizer.step()
        count += 1

    return step


def _torch_schedule(schedule: str, cells: Mapping[int, nn.Module], K: int, M: int, model: Model) -> Any:
    # Imported here: the module costs seconds to import (the worker server preloads it).
    from torch.distributed import pipelining

    x, _ = model.data()
    micro = x.shape[0] // M
    num_stages = K * stages_per_process(schedule)
    stages = []
    for index, cell in cells.items():
        # STATIC mode (input_args and output_args on every stage): no shape-inference pass. Boundary examples must
        # require grad, or no gradient is exchanged; a real stage output requires grad, so its example says so too.
        example = x[:micro] if index == 0 else torch.zeros((micro, *x.shape[1:]), requires_grad=True)
        with torch.no_grad():
            output = cell(example).requires_grad_(True)
        stages.append(
            pipelining.PipelineStage(
                cell, index, num_stages, torch.device("cpu"), input_args=(example,), output_args=(output,)
            )
        )
    schedule_class = getattr(pipelining, TORCH_CLASSES[schedule])
    return schedule_class(stages if len(stages) > 1 or schedule == "zero_bubble" else stages[0], M, F.mse_loss)


def _torch_step(
    schedule: str, cells: Mapping[int, nn.Module], K: int, M: int, model: Model, tokens: tuple[int, ...] = ()
) -> Step:
    """torch's step, built for ``model``'s shapes; ``tokens`` (default: ``model.tokens``) are the sequence lengths
    of its successive steps."""
    x, _ = model.data()
    if x.shape[0] % M:
        raise ValueError(f"torch.distributed.pipelining needs equal micro-batches: {x.shape[0]} % {M} != 0")
    scores = K * stages_per_process(schedule) - 1 in cells
    schedule_object, optimizer, rank = _torch_schedule(schedule, cells, K, M, model), _sgd(cells), dist.get_rank()
    steps = [schedule_step(schedule_object, optimizer, rank, *model.data(t), scores=scores) for t in tokens]
    if not steps:
        return schedule_step(schedule_object, optimizer, rank, *model.data(), scores=scores)
    count = 0

    def step() -> None:
        nonlocal count
        steps[count % len(steps)]()
        count += 1

    return step


def torch_refusal(rank: int, world_size: int, schedule: str, variant: str, model: Model, chunks: int) -> str:
    """What torch does with a ``variant`` of ``schedule`` (run in fresh ranks): ``"ran"`` or the error it raised.

    ``"compiled"``: the stages' layers wrapped by ``torch.compile`` (an ``OptimizedModule``), one step. ``"varlen"``:
    a step of ``model.tokens`` tokens, then one :func:`varlen_delta` tokens longer (a rank that gloo aborts ends the job
    instead; the orchestrator reports that).
    """
    cells = stage_cells(model, schedule, rank, world_size)
    if variant == "compiled":
        cells = {s: nn.Sequential(cast(nn.Module, torch.compile(cell))) for s, cell in cells.items()}
    tokens = (model.tokens, model.tokens + varlen_delta(model)) if variant == "varlen" else (model.tokens,)
    try:
        step = _torch_step(schedule, cells, world_size, chunks, model, tokens)
        for _ in tokens:
            step()
    except Exception as error:  # what torch raised is the finding
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return "ran"
