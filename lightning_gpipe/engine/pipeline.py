"""The GPipe engine without a Trainer: one training or evaluation step of a pipeline, per stage or in-process.

:class:`Pipeline` is one stage's view of a step: scatter the mini-batch into micro-batches, run them through the step
driver (:class:`~lightning_gpipe.engine.driver.StepDriver`: the schedule's actions, each micro-batch's loss weighted by
its share of the batch), and gather. Every stage of a pipeline is handed the same mini-batch; stage 0 feeds
``input_fn(micro-batch)`` to its cell and the last stage computes ``loss_fn(output, micro-batch)``. After ``train_step``
the parameters' ``.grad`` hold exactly what ``loss.backward()`` of the unpartitioned model on the whole mini-batch would
have accumulated (up to float round-off from summing micro-batches).

:func:`run_in_threads` runs all the stages of a pipeline in one process, one thread each, for tests and notebooks; each
stage keeps its own device and its own random streams, as it would in a process of its own.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from lightning_gpipe.engine.config import PipelineConfig, config_from
from lightning_gpipe.engine.driver import StepDriver
from lightning_gpipe.engine.fingerprint import Fingerprint
from lightning_gpipe.engine.microbatch import Microbatch, gather, split_batch
from lightning_gpipe.engine.rematerialization import CheckpointMode
from lightning_gpipe.engine.stage import Stage
from lightning_gpipe.engine.step import StepRun
from lightning_gpipe.engine.timeline import Timeline
from lightning_gpipe.engine.transport import DEFAULT_TIMEOUT, ThreadTransport, Transport
from lightning_gpipe.engine.tree import map_tensors

__all__ = ["LossFn", "Pipeline", "first_element", "run_in_threads"]

LossFn = Callable[[Any, Any], torch.Tensor]
"""The loss of one micro-batch: ``loss_fn(last_stage_output, microbatch) -> scalar tensor``."""
InputFn = Callable[[Any], Any]


def first_element(batch: Any) -> Any:
    """The default ``input_fn``: ``x`` of an ``(x, y, ...)`` batch, or the batch itself."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


class Pipeline:
    """One stage of a GPipe pipeline: ``cell`` linked to its neighbours by ``transport``.

    The settings come validated in a :class:`~lightning_gpipe.engine.config.PipelineConfig` (``config``, as the strategy
    passes its own), or one by one as keywords, which build it: ``Pipeline(cell, transport, chunks=8)``. Either
    way they are checked once, here, and never again per step.

    Args:
        cell: this stage's layers.
        transport: links to the other stages; its ``stage`` is this stage's index.
        config: the settings, validated already; its ``chunks`` must be set. A pipeline uses ``chunks``,
            ``checkpoint``, ``schedule`` and ``detect_anomalies``.
        chunks: M, the number of micro-batches per mini-batch (required without ``config``).
        checkpoint: re-materialization mode (default ``"except_last"``).
        schedule: ``"gpipe"`` (fill-drain, the default), ``"1f1b"`` or ``"zero_bubble"`` (ZB-H1).
        timeline: records every action's start and end when given.
        detect_anomalies: raise where a NaN or Inf first appears (stage and micro-batch named); see :class:`Stage`.
    """

    def __init__(
        self,
        cell: nn.Module,
        transport: Transport,
        config: PipelineConfig | None = None,
        *,
        chunks: int | None = None,
        checkpoint: CheckpointMode | None = None,
        schedule: str | None = None,
        timeline: Timeline | None = None,
        compute_guard: Callable[[], AbstractContextManager[Any]] | None = None,
        detect_anomalies: bool | None = None,
    ) -> None:
        given = {"chunks": chunks, "checkpoint": checkpoint, "schedule": schedule, "detect_anomalies": detect_anomalies}
        self.config = config_from(config, "Pipeline", **given)
        if self.config.chunks is None:
            raise TypeError(
                "Pipeline needs chunks, M, the number of micro-batches per mini-batch: e.g. chunks=8 (or a config "
                "with chunks set); 4 per stage keeps the bubble small"
            )
        self.chunks: int = self.config.chunks
        self.schedule = self.config.schedule
        self._guard = compute_guard or nullcontext
        self.stage = Stage(cell, transport, self.config, timeline=timeline, compute_guard=compute_guard)

    def begin(self, batch: Any, *, training: bool = True, fingerprint: Fingerprint | None = None) -> StepRun:
        """Scatter ``batch`` and begin a step on this stage; drive it through the returned :class:`StepRun`."""
        return StepRun(
            self.stage, self.schedule, split_batch(batch, self.chunks), training=training, fingerprint=fingerprint
        )

    def train_step(self, batch: Any, loss_fn: LossFn, input_fn: InputFn = first_element) -> torch.Tensor | None:
        """Forward and backward of one mini-batch; returns its (detached) loss on the last stage, else ``None``."""
        driver = StepDriver(self.begin(batch), hook="train_step")

        def step(mb: Microbatch) -> torch.Tensor | None:
            output = driver.call(self._input(input_fn, mb.value))
            if not self.stage.is_last:
                return None
            # Under the guard: a random loss draws from this stage's stream, as in a process of its own. Only the loss
            # is kept: the output (a language model's logits) is freed before the backward passes that follow.
            with self._guard():
                return loss_fn(output, mb.value)

        # The driver keeps each loss weighted; the unweighted one (which may hold an output-sized buffer) is dropped.
        outputs = driver.forward_phase(step, keep_outputs=False)
        total = driver.weigh(outputs) if self.stage.is_last else None
        driver.backward_phase()
        return total

    @torch.no_grad()
    def eval_step(self, batch: Any, input_fn: InputFn = first_element) -> Any:
        """Forward only, without gradients; returns the gathered last-stage outputs there, else ``None``."""
        run = self.begin(batch, training=False)
        driver = StepDriver(run, hook="eval_step")
        outputs = driver.forward_phase(lambda mb: driver.call(self._input(input_fn, mb.value)))
        driver.finish()
        return gather(outputs, [mb.size for mb in run.microbatches]) if self.stage.is_last else None

    def _input(self, input_fn: InputFn, microbatch: Any) -> Any:
        """What stage 0 feeds its cell (random augmentation draws from its stream); ``None`` on later stages."""
        if not self.stage.is_first:
            return None
        with self._guard():
            return input_fn(microbatch)


class _StageRandomness:
    """Gives each thread-stage private CPU and CUDA random streams, as it would have in a process of its own.

    Threads share torch's global generators, so dropout masks would depend on thread timing, and a re-materialized
    forward, whose replay restores the generator state saved when it first ran, would draw other masks than the first
    time whenever another stage drew in between. So all stages' computation (cells, backward passes with their
    recomputation, ``input_fn`` and ``loss_fn``) is serialized by one lock, and each stage's generator states (the CPU
    one and, for a CUDA stage, its device's) are swapped into the global generators around it.

    Stage ``j`` starts from generators seeded ``seeds[j]``, like a process that called ``torch.manual_seed``; without
    seeds every stage starts from the caller's current state, like processes seeded alike, and :meth:`hand_back`
    leaves the caller's generators where stage 0's stream ended, so that successive steps draw new numbers.
    """

    def __init__(self, devices: Sequence[torch.device], seeds: Sequence[int] | None) -> None:
        self._lock = threading.Lock()
        self._cuda = [_cuda_index(device) for device in devices]
        self._states = [self._initial(cuda, None if seeds is None else seeds[j]) for j, cuda in enumerate(self._cuda)]

    @staticmethod
    def _initial(cuda: int | None, seed: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        with torch.random.fork_rng(devices=[] if cuda is None else [cuda], device_type="cuda"):
            if seed is not None:
                torch.random.default_generator.manual_seed(seed)
                if cuda is not None:
                    with torch.cuda.device(cuda):
                        torch.cuda.manual_seed(seed)
            return _get_states(cuda)

    @contextmanager
    def scope(self, stage: int) -> Iterator[None]:
        """Run the body with stage ``stage``'s streams in torch's global generators, and no other stage computing."""
        cuda = self._cuda[stage]
        with self._lock:
            outer = _get_states(cuda)
            _set_states(cuda, self._states[stage])
            try:
                yield
            finally:
                self._states[stage] = _get_states(cuda)
                _set_states(cuda, outer)

    def hand_back(self, stage: int) -> None:
        """Leave torch's global generators where stage ``stage``'s streams are now."""
        with self._lock:
            _set_states(self._cuda[stage], self._states[stage])


def _cuda_index(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def _get_states(cuda: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), None if cuda is None else torch.cuda.get_rng_state(cuda)


def _set_states(cuda: int | None, states: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    cpu, device = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        assert device is not None
        torch.cuda.set_rng_state(device, cuda)


def _cell_device(cell: nn.Module) -> torch.device:
    """Where ``cell`` computes: the device of its first parameter (or buffer); the CPU for a cell with neither."""
    for tensor in [*cell.parameters(), *cell.buffers()]:
        return tensor.device
    return torch.device("cpu")


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
    concurrent: bool = False,
) -> torch.Tensor:
    """One training step of the pipeline made of ``cells``, every stage a thread of this process.

    Gradients accumulate into the cells' parameters. Each stage runs on its cell's device (that of its first parameter
    or buffer; the CPU for a cell with neither), receives its neighbours' tensors there and is handed the batch there,
    so cells may sit on different CUDA devices or on the CPU.

    Each stage draws random numbers (its cell, ``input_fn`` on stage 0, ``loss_fn`` on the last) from private CPU and
    CUDA streams, as it would in a process of its own, so dropout is replayed exactly under re-materialization. With
    ``seeds`` (one per stage) stage ``j``'s streams are seeded ``seeds[j]``, which equals a run with one process per
    stage in which process ``j`` called ``torch.manual_seed(seeds[j])``. Without, every stage starts from the
    caller's generator state (processes seeded alike), and the caller's generators end where stage 0's did. For that,
    the stages take turns: one computes at a time, as torch has one global generator per device.

    ``concurrent=True`` lets the stages compute at the same time instead, so that a timeline shows the schedule's
    overlap as separate devices would run it. The threads then share torch's global generators, so it is for cells,
    ``input_fn`` and ``loss_fn`` that draw no random numbers (no dropout); it cannot be combined with ``seeds``.

    The first stage error is re-raised here; the other stages are stopped, never left hanging.
    """
    if seeds is not None and len(seeds) != len(cells):
        raise ValueError(f"seeds has {len(seeds)} entries for {len(cells)} stages; give one seed per stage")
    if concurrent and seeds is not None:
        raise ValueError(
            "concurrent=True shares torch's global random generators between the stages, so seeds cannot give each "
            "stage its own stream: drop seeds, or drop concurrent=True to have the stages take turns"
        )
    # Checked here, once: a bad setting raises in the caller's thread, not in every stage's.
    config = PipelineConfig(chunks=chunks, checkpoint=checkpoint, schedule=schedule, detect_anomalies=detect_anomalies)
    devices = [_cell_device(cell) for cell in cells]
    transports = ThreadTransport.create(len(cells), devices, timeout=datetime.timedelta(seconds=timeout))
    randomness = _StageRandomness(devices, seeds)
    results: dict[int, Any] = {}
    errors: list[tuple[int, BaseException]] = []

    def work(stage: int) -> None:
        device = devices[stage]
        pipeline = Pipeline(
            cells[stage],
            transports[stage],
            config,
            timeline=timeline,
            compute_guard=None if concurrent else lambda: randomness.scope(stage),
        )
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the current device is per thread; tensors a cell creates land there
            # A process of its own would have moved its batch to its device too.
            own_batch = map_tensors(lambda tensor: tensor.to(device), batch)
            results[stage] = pipeline.train_step(own_batch, loss_fn, input_fn)
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
    if seeds is None and not concurrent:
        randomness.hand_back(0)
    return results[len(cells) - 1]
