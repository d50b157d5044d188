"""The GPipe engine without a Trainer: a pipeline's training and evaluation steps and decoding calls, per process or
in-process.

:class:`Pipeline` is one process's view of a step: scatter the mini-batch into micro-batches, run them through the step
driver (:class:`~lightning_gpipe.engine.driver.StepDriver`: the schedule's actions, each micro-batch's loss weighted by
its share of the batch), and gather. A process holds one stage, or several under ``"interleaved"`` and ``"zbv"``.
Every process of a pipeline is handed the same mini-batch; stage 0 feeds ``input_fn(micro-batch)`` to its cell and the
last stage computes ``loss_fn(output, micro-batch)``. After ``train_step`` the parameters' ``.grad`` hold exactly what
``loss.backward()`` of the unpartitioned model on the whole mini-batch would have accumulated (up to float round-off
from summing micro-batches). :meth:`Pipeline.decode` runs a decoding call on every stage in rounds, each stage keeping
its caches (:mod:`~lightning_gpipe.engine.decoding`).

:func:`run_in_threads` runs all the processes of a pipeline in one process, one thread each, for tests and notebooks;
each keeps its own device and its own random streams, as it would in a process of its own.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from lightning_gpipe.engine.config import PipelineConfig, config_from
from lightning_gpipe.engine.decoding import Decoding, decode
from lightning_gpipe.engine.driver import StepDriver
from lightning_gpipe.engine.fingerprint import Fingerprint
from lightning_gpipe.engine.microbatch import Microbatch, gather, split_batch
from lightning_gpipe.engine.rematerialization import CheckpointMode
from lightning_gpipe.engine.schedule import stage_table
from lightning_gpipe.engine.stage import Stage
from lightning_gpipe.engine.step import StepRun
from lightning_gpipe.engine.thread_transport import ThreadTransport
from lightning_gpipe.engine.timeline import Timeline
from lightning_gpipe.engine.transport import DEFAULT_TIMEOUT, Transport
from lightning_gpipe.engine.tree import map_tensors

__all__ = ["LossFn", "Pipeline", "first_element", "run_in_threads"]

LossFn = Callable[[Any, Any], torch.Tensor]
"""The loss of one micro-batch: ``loss_fn(last_stage_output, microbatch) -> scalar tensor``."""
InputFn = Callable[[Any], Any]


def first_element(batch: Any) -> Any:
    """The default ``input_fn``: ``x`` of an ``(x, y, ...)`` batch, or the batch itself."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


class Pipeline:
    """One process of a GPipe pipeline: its stage's cell (or its stages' cells) linked to the others by ``transport``.

    The settings come validated in a :class:`~lightning_gpipe.engine.config.PipelineConfig` (``config``, as the strategy
    passes its own), or one by one as keywords, which build it: ``Pipeline(cell, transport, chunks=8)``. Either
    way they are checked once, here, and never again per step.

    Args:
        cells: this process's stage's layers; or, where it holds several stages (``schedule="interleaved"`` or
            ``"zbv"``), a mapping from each stage it holds (:func:`~lightning_gpipe.engine.schedule.stages_of`) to its
            layers.
        transport: links to the other stages, its ``stage`` this stage's index; for several stages a mapping with the
            same keys, one transport per stage (:meth:`ProcessGroupTransport.for_stages
            <lightning_gpipe.engine.transport.ProcessGroupTransport.for_stages>`, or :meth:`ThreadTransport.create
            <lightning_gpipe.engine.transport.ThreadTransport.create>` of ``K·v`` stages).
        config: the settings, validated already; its ``chunks`` must be set. A pipeline uses ``chunks``,
            ``checkpoint``, ``schedule``, ``virtual_stages`` and ``detect_anomalies``.
        chunks: M, the number of micro-batches per mini-batch (required without ``config``).
        checkpoint: re-materialization mode (default ``"except_last"``).
        schedule: ``"gpipe"`` (fill-drain, the default), ``"1f1b"``, ``"zero_bubble"`` (ZB-H1), ``"interleaved"`` or
            ``"zbv"`` (several stages per process).
        virtual_stages: the stages per process under ``"interleaved"`` (2 or more); ``"zbv"`` holds two.
        timeline: records every action's start and end when given.
        detect_anomalies: raise where a NaN or Inf first appears (stage and micro-batch named); see :class:`Stage`.
    """

    def __init__(
        self,
        cells: nn.Module | Mapping[int, nn.Module],
        transport: Transport | Mapping[int, Transport],
        config: PipelineConfig | None = None,
        *,
        chunks: int | None = None,
        checkpoint: CheckpointMode | None = None,
        schedule: str | None = None,
        virtual_stages: int | None = None,
        timeline: Timeline | None = None,
        compute_guard: Callable[[], AbstractContextManager[Any]] | None = None,
        detect_anomalies: bool | None = None,
    ) -> None:
        given = {
            "chunks": chunks,
            "checkpoint": checkpoint,
            "schedule": schedule,
            "virtual_stages": virtual_stages,
            "detect_anomalies": detect_anomalies,
        }
        self.config = config_from(config, "Pipeline", **given)
        if self.config.chunks is None:
            raise TypeError("Pipeline needs chunks (micro-batches per mini-batch), e.g. chunks=8")
        self.chunks: int = self.config.chunks
        self.schedule = self.config.schedule
        self._guard = compute_guard or nullcontext
        held = _held_stages(cells, transport, self.config)
        self.config.check_chunks(next(iter(held.values()))[1].num_stages // len(held))
        self.stages: tuple[Stage, ...] = tuple(
            Stage(cell, link, self.config, timeline=timeline, compute_guard=compute_guard)
            for cell, link in held.values()
        )
        """This process's stages, in model order."""

    @property
    def stage(self) -> Stage:
        """This process's one stage; a process holding several has :attr:`stages`."""
        if len(self.stages) > 1:
            raise AttributeError(
                f"this Pipeline holds stages {[stage.index for stage in self.stages]}, not one; use Pipeline.stages"
            )
        return self.stages[0]

    def begin(self, batch: Any, *, training: bool = True, fingerprint: Fingerprint | None = None) -> StepRun:
        """Scatter ``batch`` and begin a step on this process's stages; drive it through the returned
        :class:`StepRun`."""
        split = split_batch(batch, self.chunks)
        return StepRun(self.stages, self.schedule, split, training=training, fingerprint=fingerprint, batch=batch)

    def train_step(self, batch: Any, loss_fn: LossFn, input_fn: InputFn = first_element) -> torch.Tensor | None:
        """Forward and backward of one mini-batch; returns its (detached) loss where the process holds the last stage,
        else ``None``."""
        driver = StepDriver(self.begin(batch), hook="train_step", feed=self._feed(input_fn))
        call = driver.stage

        def step(mb: Microbatch) -> torch.Tensor | None:
            output = driver.call(self._input(input_fn, mb.value) if call.is_first else None)
            if not call.is_last:
                return None
            # Under the guard: a random loss draws from this process's stream, as in a process of its own. Only the
            # loss is kept: the output (a language model's logits) is freed before the backward passes that follow.
            with self._guard():
                return loss_fn(output, mb.value)

        # The driver keeps each loss weighted; the unweighted one (which may hold an output-sized buffer) is dropped.
        outputs = driver.forward_phase(step, keep_outputs=False)
        total = driver.weigh(outputs) if call.is_last else None
        driver.backward_phase()
        return total

    @torch.no_grad()
    def eval_step(self, batch: Any, input_fn: InputFn = first_element) -> Any:
        """Forward only, without gradients; returns the gathered last-stage outputs where the process holds the last
        stage, else ``None``."""
        run = self.begin(batch, training=False)
        driver = StepDriver(run, hook="eval_step", feed=self._feed(input_fn))
        call = driver.stage
        outputs = driver.forward_phase(
            lambda mb: driver.call(self._input(input_fn, mb.value) if call.is_first else None)
        )
        driver.finish()
        return gather(outputs, [mb.size for mb in run.microbatches]) if call.is_last else None

    def decode(self, decoding: Decoding) -> Any:
        """Run the decoding call ``decoding`` on every stage, its sequences in up to ``chunks`` micro-batches in flight,
        each stage keeping its caches (:mod:`~lightning_gpipe.engine.decoding`); its result where the process holds
        the last stage, else ``None``. Every process calls it with the same call."""
        if len(self.stages) > 1:
            raise ValueError(
                f"schedule={self.schedule!r} places {len(self.stages)} stages on each process; decode under 'gpipe' "
                "or '1f1b'"
            )
        return decode(self.stages[0], decoding, self.chunks)

    def _feed(self, input_fn: InputFn) -> Callable[[Microbatch], Any]:
        return lambda mb: self._input(input_fn, mb.value)

    def _input(self, input_fn: InputFn, microbatch: Any) -> Any:
        """What stage 0 feeds its cell (random augmentation draws from the process's stream)."""
        with self._guard():
            return input_fn(microbatch)


def _held_stages(
    cells: nn.Module | Mapping[int, nn.Module], transport: Transport | Mapping[int, Transport], config: PipelineConfig
) -> dict[int, tuple[nn.Module, Transport]]:
    """Each stage the process holds, in model order, with its cell and transport; checked against the schedule."""
    if not isinstance(cells, Mapping):
        if isinstance(transport, Mapping):
            raise TypeError("Pipeline got one cell but a mapping of transports; give one transport")
        if config.stages_per_process > 1:
            raise ValueError(
                f"schedule={config.schedule!r} places {config.stages_per_process} stages on each process, but "
                "Pipeline got one cell; give mappings {stage: cell} and {stage: transport}"
            )
        return {transport.stage: (cells, transport)}
    if not isinstance(transport, Mapping) or set(transport) != set(cells):
        keys = sorted(transport) if isinstance(transport, Mapping) else type(transport).__name__
        raise ValueError(
            f"Pipeline got cells for stages {sorted(cells)} and transports for {keys}; give a transport per stage"
        )
    wrong = {stage: link.stage for stage, link in transport.items() if link.stage != stage}
    if wrong:
        raise ValueError(f"transport[s].stage must be s, got {wrong} (key: its stage); pass each stage its transport")
    order = sorted(cells)
    total, v = transport[order[0]].num_stages, config.stages_per_process
    table = stage_table(config.schedule, max(1, total // v), v)
    if total % v or tuple(order) != table[order[0] % len(table)]:
        raise ValueError(
            f"Pipeline got cells for stages {order} of {total}, but schedule={config.schedule!r} with "
            f"virtual_stages={v} gives a process stages such as {list(table[0])}; give those"
        )
    return {stage: (cells[stage], transport[stage]) for stage in order}


class _ProcessRandomness:
    """Gives each thread-process private CPU and CUDA random streams, as it would have in a process of its own.

    Threads share torch's global generators, so dropout masks would depend on thread timing, and a re-materialized
    forward, whose replay restores the generator state saved when it first ran, would draw other masks than the first
    time whenever another thread drew in between. So all threads' computation (cells, backward passes with their
    recomputation, ``input_fn`` and ``loss_fn``) is serialized by one lock, and each thread's generator states (the CPU
    one and, for a CUDA process, its device's) are swapped into the global generators around it.

    Process ``r`` starts from generators seeded ``seeds[r]``, like a process that called ``torch.manual_seed``;
    without seeds every process starts from the caller's current state, like processes seeded alike, and
    :meth:`hand_back` leaves the caller's generators where process 0's stream ended, so that successive steps draw new
    numbers.
    """

    def __init__(self, devices: Sequence[torch.device], seeds: Sequence[int] | None) -> None:
        self._lock = threading.Lock()
        self._cuda = [_cuda_index(device) for device in devices]
        self._states = [self._initial(cuda, None if seeds is None else seeds[r]) for r, cuda in enumerate(self._cuda)]

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
    def scope(self, process: int) -> Iterator[None]:
        """Run the body with process ``process``'s streams in torch's global generators, and no other computing."""
        cuda = self._cuda[process]
        with self._lock:
            outer = _get_states(cuda)
            _set_states(cuda, self._states[process])
            try:
                yield
            finally:
                self._states[process] = _get_states(cuda)
                _set_states(cuda, outer)

    def hand_back(self, process: int) -> None:
        """Leave torch's global generators where process ``process``'s streams are now."""
        with self._lock:
            _set_states(self._cuda[process], self._states[process])


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


def _process_devices(cells: Sequence[nn.Module], held: Sequence[Sequence[int]]) -> list[torch.device]:
    """Each stage's device: its cell's, where a process's cells without parameters or buffers (an activation) compute
    on the device of the process's other cells, since a process computes on one device."""
    devices = [_cell_device(cell) for cell in cells]
    for stages in held:
        placed = {devices[s] for s in stages if any(True for _ in (*cells[s].parameters(), *cells[s].buffers()))}
        if len(placed) > 1:
            raise ValueError(
                f"the stages {list(stages)} of one process sit on devices {[str(devices[s]) for s in stages]}; put "
                "them on one"
            )
        for s in stages:
            devices[s] = next(iter(placed), devices[s])
    return devices


def run_in_threads(
    cells: Sequence[nn.Module],
    batch: Any,
    loss_fn: LossFn,
    *,
    chunks: int,
    input_fn: InputFn = first_element,
    checkpoint: CheckpointMode = "except_last",
    schedule: str = "gpipe",
    virtual_stages: int = 1,
    timeline: Timeline | None = None,
    seeds: Sequence[int] | None = None,
    timeout: float = DEFAULT_TIMEOUT.total_seconds(),
    detect_anomalies: bool = False,
    concurrent: bool = False,
) -> torch.Tensor:
    """One training step of the pipeline made of ``cells``, every process a thread of this process.

    ``cells`` lists every stage's cell in model order. Each process holds one stage, or under
    ``schedule="interleaved"`` (``virtual_stages=v``) and ``"zbv"`` several: with ``K·v`` cells, K threads, thread
    ``r`` holding the stages :func:`~lightning_gpipe.engine.schedule.stages_of` gives it. Gradients accumulate into
    the cells' parameters. Each stage runs on its cell's device (that of its first parameter or buffer; the CPU for a
    cell with neither), receives its neighbours' tensors there and is handed the batch there, so cells may sit on
    different CUDA devices or on the CPU (the cells of one process on one device).

    Each process draws random numbers (its cells, ``input_fn`` where it holds stage 0, ``loss_fn`` where it holds the
    last) from private CPU and CUDA streams, as it would in a process of its own, so dropout is replayed exactly under
    re-materialization. With ``seeds`` (one per process) process ``r``'s streams are seeded ``seeds[r]``, which equals a
    run with one process per thread in which process ``r`` called ``torch.manual_seed(seeds[r])``. Without, every
    process starts from the caller's generator state (processes seeded alike), and the caller's generators end where
    process 0's did. For that, the processes take turns: one computes at a time, as torch has one global generator per
    device.

    ``concurrent=True`` lets the processes compute at the same time instead, so that a timeline shows the schedule's
    overlap as separate devices would run it. The threads then share torch's global generators, so it is for cells,
    ``input_fn`` and ``loss_fn`` that draw no random numbers (no dropout); it cannot be combined with ``seeds``.

    The first error is re-raised here; the other processes are stopped, never left hanging.
    """
    # Checked here, once: a bad setting raises in the caller's thread, not in every process's.
    config = PipelineConfig(
        chunks=chunks,
        checkpoint=checkpoint,
        schedule=schedule,
        detect_anomalies=detect_anomalies,
        virtual_stages=virtual_stages,
    )
    held = _thread_stages(config, len(cells), seeds, concurrent)
    devices = _process_devices(cells, held)
    transports = ThreadTransport.create(len(cells), devices, timeout=datetime.timedelta(seconds=timeout))
    randomness = _ProcessRandomness([devices[stages[0]] for stages in held], seeds)
    results: dict[int, Any] = {}
    errors: list[tuple[int, BaseException]] = []

    def work(r: int) -> None:
        stages, device = held[r], devices[held[r][0]]
        one = len(stages) == 1
        pipeline = Pipeline(
            cells[stages[0]] if one else {s: cells[s] for s in stages},
            transports[stages[0]] if one else {s: transports[s] for s in stages},
            config,
            timeline=timeline,
            compute_guard=None if concurrent else lambda: randomness.scope(r),
        )
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the current device is per thread; tensors a cell creates land there
            # A process of its own would have moved its batch to its device too.
            own_batch = map_tensors(lambda tensor: tensor.to(device), batch)
            results[r] = pipeline.train_step(own_batch, loss_fn, input_fn)
        except BaseException as error:
            errors.append((r, error))

    _run_threads(work, len(held), errors)
    if seeds is None and not concurrent:
        randomness.hand_back(0)
    return results[next(r for r in range(len(held)) if len(cells) - 1 in held[r])]


def _thread_stages(
    config: PipelineConfig, num_cells: int, seeds: Sequence[int] | None, concurrent: bool
) -> tuple[tuple[int, ...], ...]:
    """The stages each thread-process holds, for :func:`run_in_threads` of ``num_cells`` cells (checked)."""
    v = config.stages_per_process
    if num_cells % v:
        raise ValueError(
            f"schedule={config.schedule!r} places {v} stages on each process; give a multiple of {v} cells, not "
            f"{num_cells}"
        )
    K = num_cells // v
    if seeds is not None and len(seeds) != K:
        raise ValueError(f"seeds has {len(seeds)} entries for {K} processes; give one seed per process")
    if concurrent and seeds is not None:
        raise ValueError(
            "concurrent=True shares torch's global random generators, so seeds cannot apply; drop seeds or "
            "concurrent=True"
        )
    return stage_table(config.schedule, K, v)


def _run_threads(work: Callable[[int], None], count: int, errors: list[tuple[int, BaseException]]) -> None:
    """Run ``work(r)`` for every process ``r`` in a thread of its own, and re-raise the first error they recorded."""
    threads = [threading.Thread(target=work, args=(r,), name=f"gpipe-process-{r}") for r in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        # The process that failed first aborted the others, whose errors only say so: report the original.
        original = [(r, error) for r, error in errors if "the pipeline was aborted" not in str(error)]
        raise (original or errors)[0][1]
