"""Point-to-point links between stages: per-link process groups, NCCL's stream order, waits and released sends."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.runif import RunIf
from helpers.stream_order import impose_stream_order
from torch import nn

from lightning_gpipe.engine.layout import ProcessLayout
from lightning_gpipe.engine.pipeline import Pipeline
from lightning_gpipe.engine.stage import Stage
from lightning_gpipe.engine.thread_transport import ThreadTransport
from lightning_gpipe.engine.transport import LinkGroups, ProcessGroupTransport
from tools.launch import run_processes

STALL = datetime.timedelta(seconds=6)


def _outcome(call: Any) -> str:
    try:
        call()
    except Exception as error:  # the test reads which rank failed, and why
        return f"failed: {error}"
    return "ok"


class _Gate(nn.Module):
    """Stage 0's cell: after micro-batch 0 it waits until the last stage has received micro-batch 0."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            distributed_store().wait(["last stage got micro-batch 0"], STALL)
        return self.linear(x)


class _Signal(nn.Module):
    """The last stage's cell: tells stage 0 that micro-batch 0 arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        distributed_store().set("last stage got micro-batch 0", "1")
        return self.linear(x)


def distributed_store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


class _CountingTransport(ProcessGroupTransport):
    """Records how many sends (and their tensors) are still held when the step waits for them."""

    held_at_end: list[int]

    def wait_sends(self) -> None:
        self.held_at_end = [*getattr(self, "held_at_end", []), len(self._pending)]
        super().wait_sends()


def _group_timeout(group: dist.ProcessGroup) -> float:
    return float(group._get_backend(torch.device("cpu")).options._timeout.total_seconds())


def _three_stages(rank: int, world_size: int, per_link: bool) -> dict[str, Any]:
    impose_stream_order()
    layout = ProcessLayout(world_size, world_size, rank)
    pipeline_group, replica_group, links = layout.new_groups(datetime.timedelta(seconds=42))
    transport = _CountingTransport(layout.pipeline_ranks(), links=links if per_link else None)
    cell = {0: _Gate(), 1: nn.Linear(4, 4), 2: _Signal()}[layout.stage]
    pipeline = Pipeline(cell, transport, chunks=CHUNKS, checkpoint="never")
    batch = (torch.randn(8, 4), torch.randn(8, 4))
    outcome = _outcome(lambda: pipeline.train_step(batch, lambda out, mb: nn.functional.mse_loss(out, mb[1])))
    # new_group hands ranks outside a group a placeholder; this rank's groups are the real ones.
    link_groups = [group for link in links for group in link or () if isinstance(group, dist.ProcessGroup)]
    groups = [group for group in [pipeline_group, replica_group, *link_groups] if isinstance(group, dist.ProcessGroup)]
    timeouts = [_group_timeout(group) for group in groups]
    held_at_end = getattr(transport, "held_at_end", [])
    # R15: after a failure the strategy aborts the links, and with them the receives left posted there (on NCCL
    # these would hold up the process group's destruction at exit). An aborted group is no longer registered.
    transport.abort_links()
    registered = dist.distributed_c10d._world.pg_map
    return {
        "outcome": outcome,
        "timeouts": timeouts,
        "held_at_end": held_at_end,
        "links_left": sum(group in registered for group in link_groups),
    }


CHUNKS = 4


@RunIf(multiprocess=True)
@pytest.mark.parametrize(
    "per_link",
    [True, pytest.param(False, marks=pytest.mark.slow)],  # shows the old wiring stall (slow: 3 processes)
    ids=["link-groups", "one-world-group"],
)
def test_a_middle_stage_forwards_micro_batch_0_before_it_receives_the_rest(per_link: bool) -> None:
    # R2: on one group per rank, the middle stage's send of micro-batch 0 queues behind the receives it posted for
    # micro-batches 1.. from stage 0, which here sends them only once the last stage has micro-batch 0.
    # The old wiring stalls until the group's timeout: short there, generous where nothing should wait.
    results = run_processes(_three_stages, 3, per_link, timeout=300, pg_timeout=120 if per_link else 15)
    outcomes = [result["outcome"] for result in results]
    stage0 = outcomes[2]  # stage j runs on rank K-1-j
    if not per_link:
        assert stage0 != "ok", outcomes
        assert "last stage got micro-batch 0" in stage0 or "imeout" in stage0 or "timed out" in stage0, outcomes
        return
    assert outcomes == ["ok", "ok", "ok"]
    # R14: every subgroup waits as long as the strategy's timeout says (not NCCL's 10-minute default).
    assert all(timeouts == [42.0] * len(timeouts) for timeouts in (result["timeouts"] for result in results))
    assert [len(result["timeouts"]) for result in results] == [4, 6, 4]  # pipeline, replica, 2 per stage's link
    assert [result["links_left"] for result in results] == [0, 0, 0]
    # R21: completed sends are released as the step goes. The middle stage (rank 1) sent a header and CHUNKS
    # activations forward, then CHUNKS gradients back; when it waits for its sends at the end of the step, the
    # activations' sends are long complete and no longer hold their tensors.
    held = results[1]["held_at_end"]
    assert held, "the middle stage never waited for its sends"
    assert held[0] <= CHUNKS, held


def _one_f_one_b(rank: int, world_size: int, per_direction: bool) -> str:
    impose_stream_order()
    layout = ProcessLayout(world_size, world_size, rank)
    link = layout.new_groups(datetime.timedelta(seconds=60))[2][0]
    assert link is not None
    if not per_direction:  # the old wiring: one group carries the link's messages both ways
        link = LinkGroups(link.down, link.down)
    transport = ProcessGroupTransport(layout.pipeline_ranks(), links=[link], timeout=STALL)
    message = torch.zeros(1024)

    def first_stage() -> None:  # warm-up F0, F1, then B0, F2, B1, F3, B2, B3: each gradient after the next forward
        for index in range(2):
            transport.send(message, 1, f"activation {index}")
        for index in range(4):
            transport.recv(torch.empty(1024), 1, f"gradient {index}")
            if index + 2 < 4:
                transport.send(message, 1, f"activation {index + 2}")
        transport.wait_sends()

    def last_stage() -> None:  # F0, B0, F1, B1, ...: each gradient sent before the next activation's receive
        for index in range(4):
            transport.recv(torch.empty(1024), 0, f"activation {index}")
            transport.send(message, 0, f"gradient {index}")
        transport.wait_sends()

    return _outcome(first_stage if layout.stage == 0 else last_stage)


@RunIf(multiprocess=True)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("per_direction", [True, False], ids=["group-per-direction", "one-group-per-link"])
def test_one_f_one_b_sends_pass_the_other_directions_receives_under_stream_order(per_direction: bool) -> None:
    # Under NCCL's rule (a group's operations in issue order; a send done only once its receive is posted), with one
    # group per link stage 0's send of activation 1 waits for the last stage's receive of it, queued behind that stage's
    # send of gradient 0, which waits for stage 0's gradient receive, queued behind the send of activation 1. One group
    # per direction keeps every send behind sends only.
    outcomes = run_processes(_one_f_one_b, 2, per_direction, timeout=100, pg_timeout=60)
    if per_direction:
        assert outcomes == ["ok", "ok"]
    else:
        assert all(outcome != "ok" for outcome in outcomes), outcomes
        assert any("activation 1" in outcome or "gradient 0" in outcome for outcome in outcomes), outcomes


class _Recorded:
    """A process-group work handle that records how it was waited for (no GPU here to run NCCL itself)."""

    def __init__(self) -> None:
        self.waits: list[tuple[Any, ...]] = []

    def wait(self, *args: Any) -> bool:
        self.waits.append(args)
        return True

    def is_completed(self) -> bool:
        return False


@pytest.fixture
def world_of_one(tmp_path: Any) -> Any:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("device", "expected"), [("cpu", [(datetime.timedelta(seconds=7),)]), ("cuda", [()])])
def test_device_receives_wait_on_the_stream_and_cpu_receives_on_the_host(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch, device: str, expected: list[tuple[Any, ...]]
) -> None:
    # R3: with a timeout, NCCL's wait blocks the host thread; without one it only makes the current stream wait.
    work = _Recorded()
    monkeypatch.setattr(dist, "irecv", lambda *args, **kwargs: work)
    monkeypatch.setattr(dist, "isend", lambda *args, **kwargs: work)
    transport = ProcessGroupTransport([0, 1], device=device, timeout=datetime.timedelta(seconds=7))
    transport.post_recv(torch.empty(1), 1, "a test message")()
    transport.send(torch.ones(1), 1, "a test message")
    transport.wait_sends()
    assert work.waits == expected * 2
    assert transport.posts_ahead is (device == "cpu")  # R16: a device transport posts receives when needed


def test_a_link_given_one_group_for_both_directions_is_refused_with_the_fix(world_of_one: None) -> None:
    # On NCCL one group per link deadlocks 1F1B (test_one_f_one_b_sends_pass_the_other_directions_receives_...).
    group = dist.group.WORLD
    assert group is not None
    with pytest.raises(ValueError, match=r"after stages \[0\] are \['ProcessGroup'\], not LinkGroups.*new_link_groups"):
        ProcessGroupTransport([0, 1], links=[group])  # type: ignore[list-item]
    links = {0: LinkGroups(group, group), 1: group}
    with pytest.raises(ValueError, match=r"after stages \[1\] .*not LinkGroups"):
        ProcessGroupTransport.for_stages([1, 0, 1], [1], links=links)  # type: ignore[arg-type]


class _StreamThreadTransport(ThreadTransport):
    """In-process links with a device transport's policy: receives are posted when needed."""

    @property
    def posts_ahead(self) -> bool:
        return False


@pytest.mark.parametrize("ahead", [True, False])
def test_receives_are_posted_ahead_only_where_the_transport_wants_it(ahead: bool) -> None:
    # R16: on NCCL a posted receive is a kernel waiting on the GPU; none may sit there between the forward phase and
    # the backward phase (where the strategy mirrors logs and users run collectives).
    kind = ThreadTransport if ahead else _StreamThreadTransport
    first, last = kind.create(2)
    cells = [nn.Linear(4, 4), nn.Linear(4, 4)]
    sender, receiver = Stage(cells[0], first), Stage(cells[1], last)
    sizes = [2, 2, 2, 2]
    sender.begin_step(sizes, gradient_order=[3, 2, 1, 0])
    receiver.begin_step(sizes)
    for index in range(len(sizes)):
        sender.forward(index, torch.randn(2, 4))
    outputs = [receiver.forward(index) for index in range(2)]
    assert sender._grad_inbox is not None
    assert receiver._inbox is not None
    if ahead:
        assert sender._grad_inbox.posted == [3, 2, 1, 0]  # gloo: small gradients' receives wait during the forwards
        assert receiver._inbox.posted == [2, 3]  # and the whole step's activations once the header is in
    else:
        assert sender._grad_inbox.posted == []
        assert receiver._inbox.posted == []
    outputs += [receiver.forward(index) for index in range(2, 4)]
    for index in reversed(range(4)):
        receiver.backward(index, outputs[index].sum())
        sender.backward(index)
    sender.end_step()
    receiver.end_step()
    assert all(p.grad is not None for cell in cells for p in cell.parameters())
