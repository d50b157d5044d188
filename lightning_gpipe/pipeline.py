"""The GPipe engine without a Trainer: one training or evaluation step of a pipeline, per stage or in-process.

:class:`Pipeline` is one stage's view of a step: scatter the mini-batch into micro-batches, run the schedule's
actions through the :class:`~lightning_gpipe.stage.Stage`, weight each micro-batch's loss by its share of the batch,
and gather. Every stage of a pipeline is handed the same mini-batch; stage 0 feeds ``input_fn(micro-batch)`` to its
cell and the last stage computes ``loss_fn(output, micro-batch)``. After ``train_step`` the parameters' ``.grad``
hold exactly what ``loss.backward()`` of the unpartitioned model on the whole mini-batch would have accumulated (up
to float round-off from summing micro-batches).

:func:`run_in_threads` runs all the stages of a pipeline in one process, one thread each, for tests and notebooks.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_gpipe.checkpoint import CheckpointMode
from lightning_gpipe.microbatch import gather, scatter, validate_chunks
from lightning_gpipe.schedule import Phase, stage_actions, validate_schedule
from lightning_gpipe.stage import Stage
from lightning_gpipe.timeline import Timeline
from lightning_gpipe.transport import DEFAULT_TIMEOUT, ThreadTransport, Transport

__all__ = ["LossFn", "Pipeline", "first_element", "run_in_threads"]

LossFn = Callable[[Any, Any], torch.Tensor]
"""The loss of one micro-batch: ``loss_fn(last_stage_output, microbatch) -> scalar tensor``."""
InputFn = Callable[[Any], Any]


def first_element(batch: Any) -> Any:
    """The default ``input_fn``: ``x`` of an ``(x, y, ...)`` batch, or the batch itself."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


class Pipeline:
    """One stage of a GPipe pipeline: ``cell`` linked to its neighbours by ``transport``.

    Args:
        cell: this stage's layers.
        transport: links to the other stages; its ``stage`` is this stage's index.
        chunks: M, the number of micro-batches per mini-batch.
        checkpoint: re-materialization mode.
        schedule: ``"gpipe"`` (fill-drain) or ``"1f1b"``.
        timeline: records every action's start and end when given.
        detect_anomalies: raise where a NaN or Inf first appears (stage and micro-batch named); see :class:`Stage`.
    """

    def __init__(
        self,
        cell: nn.Module,
        transport: Transport,
        *,
        chunks: int,
        checkpoint: CheckpointMode = "except_last",
        schedule: str = "gpipe",
        timeline: Timeline | None = None,
        compute_guard: Callable[[], Any] | None = None,
        detect_anomalies: bool = False,
    ) -> None:
        self.chunks = validate_chunks(chunks)
        self.schedule = validate_schedule(schedule)
        self.stage = Stage(
            cell,
            transport,
            checkpoint=checkpoint,
            timeline=timeline,
            compute_guard=compute_guard,
            detect_anomalies=detect_anomalies,
        )

    def train_step(self, batch: Any, loss_fn: LossFn, input_fn: InputFn = first_element) -> torch.Tensor | None:
        """Forward and backward of one mini-batch; returns its (detached) loss on the last stage, else ``None``."""
        stage = self.stage
        microbatches = scatter(batch, self.chunks)
        K, M = stage.num_stages, len(microbatches)
        # The next stage sends gradients in its backward order; knowing it, this stage posts their receives early.
        gradient_order = None
        if not stage.is_last:
            later = stage_actions(self.schedule, stage.index + 1, K, M)
            gradient_order = [action.microbatch for action in later if action.phase is Phase.BACKWARD]
        stage.begin_step([mb.size for mb in microbatches], gradient_order=gradient_order)
        losses: dict[int, torch.Tensor] = {}
        try:
            for action in stage_actions(self.schedule, stage.index, K, M):
                mb = microbatches[action.microbatch]
                if action.phase is Phase.FORWARD:
                    output = stage.forward(mb.index, input_fn(mb.value) if stage.is_first else None)
                    if stage.is_last:
                        losses[mb.index] = loss_fn(output, mb.value) * mb.weight
                else:
                    stage.backward(mb.index, losses.get(mb.index))
            stage.end_step()
        except BaseException as error:
            stage.abort(repr(error))
            raise
        if not stage.is_last:
            return None
        return torch.stack([losses[i].detach() for i in sorted(losses)]).sum()

    @torch.no_grad()
    def eval_step(self, batch: Any, input_fn: InputFn = first_element) -> Any:
        """Forward only, without gradients; returns the gathered last-stage outputs there, else ``None``."""
        stage = self.stage
        microbatches = scatter(batch, self.chunks)
        stage.begin_step([mb.size for mb in microbatches])
        try:
            outputs = [stage.forward(mb.index, input_fn(mb.value) if stage.is_first else None) for mb in microbatches]
            stage.end_step()
        except BaseException as error:
            stage.abort(repr(error))
            raise
        return gather(outputs) if stage.is_last else None


class _StageRandomness:
    """Gives each thread-stage a private CPU random stream, as it would have in a process of its own.

    Threads share torch's global generator, so dropout masks would depend on thread timing. Computation of all stages
    is serialized by one lock, and each stage's generator state is swapped in and out around it.
    """

    def __init__(self, seeds: Sequence[int]) -> None:
        self._lock = threading.Lock()
        self._states = []
        for seed in seeds:
            generator = torch.Generator().manual_seed(seed)
            self._states.append(generator.get_state())

    @contextmanager
    def scope(self, stage: int) -> Iterator[None]:
        with self._lock:
            outer = torch.get_rng_state()
            torch.set_rng_state(self._states[stage])
            try:
                yield
            finally:
                self._states[stage] = torch.get_rng_state()
                torch.set_rng_state(outer)


def run_in_threads(
    cells: Sequence[nn.Module],
    batch: Any,
    loss_fn: LossFn,
    *,
    chunks: int,
    input_fn: InputFn = first_element,
    checkpoint: CheckpointMode = "except_last",
    schedule: str = "gpipe",
    timeline: Timeline | None = None,
    seeds: Sequence[int] | None = None,
    timeout: float = DEFAULT_TIMEOUT.total_seconds(),
    detect_anomalies: bool = False,
) -> torch.Tensor:
    """One training step of the pipeline made of ``cells``, every stage a thread of this process.

    Gradients accumulate into the cells' parameters. With ``seeds`` (one per stage) each stage draws random numbers
    from its own generator seeded so, which makes dropout reproducible and equal to a run with one process per stage
    seeded the same way. The first stage error is re-raised here; the other stages are stopped, never left hanging.
    """
    transports = ThreadTransport.create(len(cells), timeout=datetime.timedelta(seconds=timeout))
    randomness = _StageRandomness(seeds) if seeds is not None else None
    if seeds is not None and len(seeds) != len(cells):
        raise ValueError(f"seeds has {len(seeds)} entries for {len(cells)} stages; give one seed per stage")
    results: dict[int, Any] = {}
    errors: list[tuple[int, BaseException]] = []

    def work(stage: int) -> None:
        guard = (lambda: randomness.scope(stage)) if randomness is not None else None
        pipeline = Pipeline(
            cells[stage],
            transports[stage],
            chunks=chunks,
            checkpoint=checkpoint,
            schedule=schedule,
            timeline=timeline,
            compute_guard=guard,
            detect_anomalies=detect_anomalies,
        )
        try:
            results[stage] = pipeline.train_step(batch, loss_fn, input_fn)
        except BaseException as error:
            errors.append((stage, error))

    threads = [threading.Thread(target=work, args=(stage,), name=f"gpipe-stage-{stage}") for stage in range(len(cells))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        # The stage that failed first aborted the others, whose errors only say so: report the original.
        original = [(stage, error) for stage, error in errors if "the pipeline was aborted" not in str(error)]
        raise (original or errors)[0][1]
    return results[len(cells) - 1]
