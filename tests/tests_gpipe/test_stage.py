"""The stage's message order: gradient receives posted ahead of backward, in the order the next stage sends them.

Posting early must change nothing but timing: gradients are bit-identical to the stage's unchanged path, where each
backward posts its own receive when it starts. gloo matches messages by posting order, so the multi-process test is
the one that can catch an order mismatch; thread transports must honour the same order.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import torch
from helpers.models import batch, build, cells, full_batch_grads, loss_fn
from helpers.runif import RunIf
from torch import nn

from lightning_gpipe.engine.errors import PipelineError
from lightning_gpipe.engine.microbatch import scatter
from lightning_gpipe.engine.pipeline import Pipeline, first_element, run_in_threads
from lightning_gpipe.engine.schedule import MULTI_STAGE, SCHEDULES, Phase, stage_actions
from lightning_gpipe.engine.stage import GRADIENT_BYTES_AHEAD, GRADIENTS_AHEAD, Stage
from lightning_gpipe.engine.thread_transport import ThreadTransport
from lightning_gpipe.engine.transport import ProcessGroupTransport, Transport
from tools.launch import run_processes

NESTED_BALANCE = [2, 1, 2]  # three stages; every boundary is a tuple with a bool mask and a None leaf
CHUNKS = 4
BATCH_SIZE = 10  # micro-batches of 3, 3, 2, 2 samples: gradient buffers must follow each one's shape
ONE_STAGE = [s for s in SCHEDULES if s not in MULTI_STAGE]  # the schedules of one stage per process


class RecordingTransport(ThreadTransport):
    """A thread transport that notes when each receive is posted (and its buffer's size) and when it is waited for."""

    events: list[tuple[str, str]]
    sizes: dict[str, int]

    def post_recv(self, buffer: torch.Tensor, peer: int, what: str) -> Callable[[], None]:
        self.events.append(("post", what))
        self.sizes[what] = self.sizes.get(what, 0) + buffer.nbytes
        wait = super().post_recv(buffer, peer, what)

        def recorded_wait() -> None:
            self.events.append(("wait", what))
            wait()

        return recorded_wait


def _threads(work: Callable[[int], None], num_stages: int) -> None:
    errors: list[BaseException] = []

    def guarded(stage: int) -> None:
        try:
            work(stage)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(stage,)) for stage in range(num_stages)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _recording(num_stages: int, kind: type[RecordingTransport] = RecordingTransport) -> list[RecordingTransport]:
    transports = cast(list[RecordingTransport], kind.create(num_stages, timeout=datetime.timedelta(seconds=60)))
    for transport in transports:
        transport.events, transport.sizes = [], {}
    return transports


def _posted_ahead(transport: RecordingTransport) -> list[tuple[int, int]]:
    """(receives, bytes) of the gradient receives posted and not yet waited for, after each posting."""
    posted: dict[int, int] = {}
    counts = []
    for kind, i in _gradient_events(transport):
        if kind == "post":
            posted[i] = transport.sizes[f"gradients of micro-batch {i}"]
            counts.append((len(posted), sum(posted.values())))
        else:
            del posted[i]
    return counts


def _gradient_events(transport: RecordingTransport) -> Iterator[tuple[str, int]]:
    for kind, what in transport.events:
        if what.startswith("gradients of micro-batch "):
            yield kind, int(what.rsplit(" ", 1)[1])


@pytest.mark.parametrize("schedule", ONE_STAGE)
def test_gradient_receives_are_posted_ahead_in_the_next_stages_backward_order(schedule: str) -> None:
    transports = _recording(2)
    model = build("mlp")
    stages = cells(model, [4, 4])

    def work(j: int) -> None:
        Pipeline(stages[j], transports[j], chunks=CHUNKS, schedule=schedule).train_step(batch(), loss_fn)

    _threads(work, 2)

    events = list(_gradient_events(transports[0]))
    sends = (Phase.BACKWARD, Phase.INPUT)  # a split backward sends its gradient after its input pass
    backward_order = [a.microbatch for a in stage_actions(schedule, 1, 2, CHUNKS) if a.phase in sends]
    assert [i for kind, i in events if kind == "post"] == backward_order
    assert [i for kind, i in events if kind == "wait"] == backward_order
    posted: set[int] = set()
    for kind, i in events:
        if kind == "post":
            posted.add(i)
        else:
            # The next micro-batch's receive is up before this one is waited for (except for the step's last).
            later = backward_order[backward_order.index(i) + 1 :]
            assert later[:1] == [] or later[0] in posted, f"{schedule}: {events}"
            posted.discard(i)


@pytest.mark.parametrize(("width", "everything"), [(16, True), (2**16, False)])
def test_gradient_receives_are_posted_ahead_up_to_a_byte_budget(width: int, everything: bool) -> None:
    # gloo parks a send until its receive is posted, which costs a small message a rendezvous (~0.1 ms) each: with
    # only GRADIENTS_AHEAD receives posted, most of a small stage's gradients paid it during its backward passes.
    # Small outputs: the whole step's receives are up before the first backward. Large: at most the byte budget
    # beyond GRADIENTS_AHEAD, as each posted receive holds a buffer the size of its micro-batch's outputs.
    chunks, rows = 8, 8
    transports = _recording(2)
    stages = [nn.Linear(4, width), nn.Sequential(nn.Linear(width, 1), nn.Flatten(0))]
    data = (torch.randn(chunks * rows, 4), torch.randn(chunks * rows))
    assert 3 * rows * width * 4 > GRADIENT_BYTES_AHEAD or everything  # large: a third receive would not fit

    def work(j: int) -> None:
        Pipeline(stages[j], transports[j], chunks=chunks, schedule="gpipe").train_step(data, loss_fn)

    _threads(work, 2)

    events = list(_gradient_events(transports[0]))
    first_wait = next(n for n, (kind, _i) in enumerate(events) if kind == "wait")
    posted = _posted_ahead(transports[0])
    if everything:
        assert first_wait == chunks, events  # every receive of the step, then the first wait
    else:
        assert first_wait == GRADIENTS_AHEAD, events
        assert all(n <= GRADIENTS_AHEAD or size <= GRADIENT_BYTES_AHEAD for n, size in posted), posted
    assert max(n for n, _size in posted) == (chunks if everything else GRADIENTS_AHEAD)


def test_a_transport_that_posts_when_needed_keeps_gradients_ahead_by_count_only() -> None:
    # NCCL (posts_ahead False) posts no receive before the backward passes and then only GRADIENTS_AHEAD at a time:
    # a posted NCCL receive is a kernel waiting on the GPU, whatever its size.
    transports = _recording(2, _WhenNeeded)
    model = build("mlp")
    stages = cells(model, [4, 4])

    def work(j: int) -> None:
        Pipeline(stages[j], transports[j], chunks=CHUNKS, schedule="gpipe").train_step(batch(), loss_fn)

    _threads(work, 2)

    assert max(n for n, _size in _posted_ahead(transports[0])) == GRADIENTS_AHEAD


class _WhenNeeded(RecordingTransport):
    @property
    def posts_ahead(self) -> bool:
        return False


def test_thread_receives_complete_in_posting_order_whatever_order_they_are_waited_for_in() -> None:
    sender, receiver = ThreadTransport.create(2, timeout=datetime.timedelta(seconds=10))
    sent = [torch.full((2,), float(k)) for k in range(3)]
    for k, tensor in enumerate(sent):
        sender.send(tensor, 1, f"message {k}")
    buffers = [torch.empty(2) for _ in sent]
    waits = [receiver.post_recv(buffer, 0, f"message {k}") for k, buffer in enumerate(buffers)]
    for k in (2, 0, 1):
        waits[k]()
    assert all(torch.equal(buffer, tensor) for buffer, tensor in zip(buffers, sent, strict=True))


def test_a_gradient_order_that_is_not_a_permutation_of_the_microbatches_is_refused() -> None:
    stage = Stage(build("mlp")[:4], ThreadTransport.create(2)[0])
    with pytest.raises(ValueError, match=r"gradient_order=\[0, 0, 1\] must list each of the step's 3 micro-batches"):
        stage.begin_step([2, 2, 2], gradient_order=[0, 0, 1])


def test_a_backward_before_a_forward_whose_gradient_comes_first_fails_instead_of_waiting_forever() -> None:
    stage = Stage(build("mlp")[:4], ThreadTransport.create(2)[0])
    x = batch(4)[0]
    stage.begin_step([2, 2], gradient_order=[0, 1])
    stage.forward(1, x[2:])
    with pytest.raises(
        PipelineError,
        match=r"backward of micro-batch 1 ran before the forward of micro-batch 0.*; run that forward first",
    ):
        stage.backward(1)


def test_a_step_that_failed_with_receives_posted_refuses_the_next_one() -> None:
    x = batch(4)[0]
    stage = Stage(build("mlp")[:4], ThreadTransport.create(2)[0])
    stage.begin_step([2, 2], gradient_order=[1, 0])
    stage.forward(0, x[:2])
    stage.forward(1, x[2:])  # both gradient receives are now posted
    stage.abort("boom")
    with pytest.raises(
        PipelineError, match=r"a new step began after a failed one \(boom\) left receives posted; restart the job"
    ):
        stage.begin_step([2, 2], gradient_order=[1, 0])

    clean = Stage(build("mlp")[:4], ThreadTransport.create(2)[0])
    clean.begin_step([2, 2])  # without a gradient order nothing is posted before backward
    clean.forward(0, x[:2])
    clean.abort("boom")
    clean.begin_step([2, 2])


# ---------------------------------------------------------------------------------------------- over gloo processes


def _stage_on_demand_step(stage: Stage, microbatches: list[Any], schedule: str) -> None:
    """The stage's unchanged path: no gradient order, so each backward posts its receive when it starts."""
    split = schedule == "zero_bubble"
    stage.begin_step([mb.size for mb in microbatches], split_backward=split)
    losses: dict[int, torch.Tensor] = {}
    for action in stage_actions(schedule, stage.index, stage.num_stages, len(microbatches)):
        mb = microbatches[action.microbatch]
        if action.phase is Phase.FORWARD:
            output = stage.forward(mb.index, first_element(mb.value) if stage.is_first else None)
            if stage.is_last:
                losses[mb.index] = loss_fn(output, mb.value) * mb.weight
        elif action.phase is Phase.INPUT:
            stage.input_backward(mb.index, losses.get(mb.index))
        elif action.phase is Phase.WEIGHT:
            stage.weight_backward(mb.index)
        else:
            stage.backward(mb.index, losses.get(mb.index))
    stage.end_step()


def _gloo_worker(rank: int, world_size: int) -> dict[str, Any]:
    data = batch(BATCH_SIZE)
    transport: Transport = ProcessGroupTransport(range(world_size))
    grads = {}
    for schedule in ONE_STAGE:
        for posted_ahead in (True, False):
            model = build("nested")
            cell = cells(model, NESTED_BALANCE)[rank]
            if posted_ahead:
                Pipeline(cell, transport, chunks=CHUNKS, schedule=schedule).train_step(data, loss_fn)
            else:
                _stage_on_demand_step(Stage(cell, transport), scatter(data, CHUNKS), schedule)
            grads[(schedule, posted_ahead)] = {k: p.grad.clone() for k, p in cell.named_parameters()}

    # A step that fails on the last stage: the others time out waiting for gradients they had posted receives for.
    impatient = ProcessGroupTransport(range(world_size), timeout=datetime.timedelta(seconds=3))
    pipeline = Pipeline(cells(build("nested"), NESTED_BALANCE)[rank], impatient, chunks=CHUNKS)

    def failing_loss(output: torch.Tensor, microbatch: Any) -> torch.Tensor:
        raise RuntimeError("the loss failed")

    errors = []
    for _ in range(2):
        try:
            pipeline.train_step(data, failing_loss if rank == world_size - 1 else loss_fn)
        except (PipelineError, RuntimeError) as error:
            errors.append(str(error))
    return {"grads": grads, "errors": errors}  # the worker then destroys the process group: it must not hang


@pytest.fixture(scope="module")
def gloo_runs() -> list[dict[str, Any]]:
    return run_processes(_gloo_worker, len(NESTED_BALANCE), timeout=240)


@RunIf(multiprocess=True)
@pytest.mark.parametrize("schedule", ONE_STAGE)
def test_gradients_posted_ahead_over_gloo_are_bit_identical_to_the_unchanged_path(
    gloo_runs: list[dict[str, Any]], schedule: str
) -> None:
    for rank, run in enumerate(gloo_runs):
        ahead, on_demand = run["grads"][(schedule, True)], run["grads"][(schedule, False)]
        assert ahead
        assert ahead.keys() == on_demand.keys()
        for name in ahead:
            assert (ahead[name] == on_demand[name]).all(), f"stage {rank}, {name}: posting ahead changed the gradient"


@RunIf(multiprocess=True)
def test_a_failed_step_over_gloo_stops_the_next_one_at_once_and_the_job_shuts_down(
    gloo_runs: list[dict[str, Any]],
) -> None:
    for rank, run in enumerate(gloo_runs):
        first, second = run["errors"]
        if rank == len(gloo_runs) - 1:
            assert first == "the loss failed"
        else:
            assert f"[pipeline stage {rank}] receiving gradients of micro-batch 3 from stage {rank + 1}" in first
        assert f"[pipeline stage {rank}] a new step began after a failed one" in second


@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
def test_a_stage_starting_with_an_in_place_layer_trains(mode: str) -> None:
    # A received value's tensors are leaves that require grad, so ReLU(inplace=True) first in a stage raised
    # "a leaf Variable that requires grad is being used in an in-place operation" in every checkpoint mode.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(inplace=True), torch.nn.Linear(12, 3))
    reference = full_batch_grads(model, batch())
    model.zero_grad()
    run_in_threads([model[:1], model[1:]], batch(), loss_fn, chunks=CHUNKS, checkpoint=mode)
    for name, expected in reference.items():
        torch.testing.assert_close(model.get_parameter(name).grad, expected)
