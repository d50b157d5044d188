"""Point-to-point tensor links between the stages of one pipeline.

A transport moves plain tensors between neighbouring stages; what the tensors mean (which structure, which
micro-batch) is :mod:`lightning_gpipe.engine.boundary`'s business. Two implementations share one interface:

- :class:`ProcessGroupTransport`: one process per stage, ``torch.distributed`` P2P (gloo on CPU, NCCL on GPU). This is
  what lets a pipeline span processes and nodes.
- :class:`ThreadTransport`: every stage in one process, one thread each, linked by in-memory queues; fast to start,
  for tests and notebooks.

Sends are asynchronous (the sender never waits for its neighbour to be ready), receives are posted ahead and waited
for with a deadline. Every failure of either, in posting it or in waiting for it (a send is waited for at the end of
the step), becomes a :class:`~lightning_gpipe.engine.errors.PipelineError` naming both stages and the message, with the
backend's error as its cause: a dead or stuck peer never hangs the job, nor surfaces as a bare gloo or NCCL error.
Messages carry no tag: the receives posted for one peer take that peer's messages in posting order, so a receiver must
post in the order its peer sends.
"""

from __future__ import annotations

import abc
import contextlib
import datetime
import logging
import queue
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_gpipe.engine.errors import PipelineError
from lightning_gpipe.engine.torch_compat import abort_process_group

__all__ = ["DEFAULT_TIMEOUT", "ProcessGroupTransport", "ThreadTransport", "Transport"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
"""How long a stage waits for a neighbour's message before it raises `PipelineError` (torch's own default)."""


class Transport(abc.ABC):
    """Asynchronous sends and deadline-bounded receives of tensors between the stages of one pipeline."""

    def __init__(self, stage: int, num_stages: int, timeout: datetime.timedelta) -> None:
        self.stage = stage
        self.num_stages = num_stages
        self.timeout = timeout

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Where received tensors are allocated."""

    @property
    def posts_ahead(self) -> bool:
        """Whether stages should post receives ahead of need (where a late receive costs a rendezvous, as on gloo)."""
        return True

    @abc.abstractmethod
    def send(self, tensor: torch.Tensor, peer: int, what: str) -> None:
        """Start sending ``tensor`` to stage ``peer``; ``what`` names it in errors.

        ``tensor`` must not be modified until :meth:`wait_sends` returns.
        """

    def recv(self, buffer: torch.Tensor, peer: int, what: str) -> None:
        """Fill ``buffer`` with the next tensor from stage ``peer``; ``what`` names it in errors."""
        self.post_recv(buffer, peer, what)()

    @abc.abstractmethod
    def post_recv(self, buffer: torch.Tensor, peer: int, what: str) -> Callable[[], None]:
        """Start receiving the next tensor from ``peer`` into ``buffer``; call the returned function to wait for it.

        The receives posted for one peer take its messages in posting order, whatever order they are waited for in.
        Posting ahead matters on gloo, whose TCP transport parks a send until the matching receive is posted: a late
        receive costs a rendezvous per message. A posted receive cannot be taken back: one left over from a failed
        step would take the first message of the next.
        """

    @abc.abstractmethod
    def wait_sends(self) -> None:
        """Block until every started send has completed."""

    def abort(self, reason: str) -> None:  # noqa: B027 - optional hook, nothing to do for process groups
        """Tell the other stages that this one failed (where the transport can; processes see the socket close)."""

    def peer_name(self, peer: int) -> str:
        """How errors name stage ``peer``."""
        return f"stage {peer}"

    def _failure(self, peer: int, what: str, cause: object, *, sending: bool = False) -> PipelineError:
        link = f"sending {what} to" if sending else f"receiving {what} from"
        return PipelineError(
            self.stage,
            f"{link} {self.peer_name(peer)} failed: {cause}. The other stage probably failed first (an error, or a "
            "process that was killed): look for its error above; a stuck stage is given up on after the transport "
            f"timeout ({self.timeout.total_seconds():g} s).",
        )


class ProcessGroupTransport(Transport):
    """P2P over ``torch.distributed``: ``ranks[j]`` is the global rank of stage ``j`` of this pipeline.

    Args:
        ranks: the global rank of every stage, in stage order.
        device: where received tensors are allocated; a CUDA device means NCCL (see below).
        timeout: how long a CPU receive or send may take before it raises.
        links: one process group per link, ``links[j]`` holding stages ``j`` and ``j + 1`` (as
            :meth:`~lightning_gpipe.engine.layout.ProcessLayout.new_groups` creates them); ``None`` sends on the default
            group. On NCCL give them: the default group runs its collectives and P2P on one stream, in issue order.

    On CPU (gloo) a wait blocks the host, for at most ``timeout``. On a device (NCCL) a wait only makes the current
    stream wait for the message, so the host keeps launching work; a stuck peer is then caught by the process
    group's own timeout. Gloo parks a send until its receive is posted, so on CPU the stages post receives ahead;
    on a device a posted receive is a kernel waiting on the GPU, so they post them when needed (:attr:`posts_ahead`).
    """

    def __init__(
        self,
        ranks: Sequence[int],
        device: torch.device | str = "cpu",
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        links: Sequence[dist.ProcessGroup] | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ProcessGroupTransport needs torch.distributed.init_process_group() to have run first")
        rank = dist.get_rank()
        if rank not in ranks:
            raise ValueError(f"this process (global rank {rank}) is not one of the pipeline's ranks {list(ranks)}")
        super().__init__(list(ranks).index(rank), len(ranks), timeout)
        self.ranks = list(ranks)
        if links is not None and len(links) != len(self.ranks) - 1:
            raise ValueError(
                f"links has {len(links)} process groups for a pipeline of {len(self.ranks)} stages; give one per pair "
                "of adjacent stages (ProcessLayout.new_groups creates them)"
            )
        self._links = list(links) if links is not None else None
        self._routes: dict[int, tuple[dist.ProcessGroup, int]] = {}
        self._aborted = False
        self._device = torch.device(device)
        # Device waits are stream waits; CPU waits block the host with a deadline.
        self._on_stream = self._device.type != "cpu"
        self._pending: deque[tuple[dist.Work, torch.Tensor, int, str]] = deque()

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def posts_ahead(self) -> bool:
        return not self._on_stream

    def peer_name(self, peer: int) -> str:
        return f"stage {peer} (global rank {self.ranks[peer]})"

    def _route(self, peer: int) -> tuple[dist.ProcessGroup | None, int]:
        """The group that carries messages between this stage and ``peer``, and the peer's rank in it."""
        if abs(peer - self.stage) != 1:
            raise ValueError(f"stage {self.stage} has no link to stage {peer}: only adjacent stages exchange messages")
        if self._aborted:
            raise RuntimeError(f"stage {self.stage}'s links were aborted after a failure; the transport is closed")
        if self._links is None:
            return None, self.ranks[peer]
        route = self._routes.get(peer)
        if route is None:  # looked up once: get_group_rank walks the group's rank map on every call
            group = self._links[min(peer, self.stage)]
            route = self._routes[peer] = (group, dist.get_group_rank(group, self.ranks[peer]))
        return route

    @contextlib.contextmanager
    def _link_errors(self, peer: int, what: str, *, sending: bool) -> Iterator[None]:
        """Turn the backend's error in posting or waiting for a message into a :class:`PipelineError`.

        Gloo raises as soon as the peer's connection has closed, in the post itself (``isend``) as in a wait; the
        backend's error stays visible as the cause.
        """
        try:
            yield
        except PipelineError:
            raise
        except RuntimeError as error:  # gloo's and NCCL's errors (DistBackendError among them) are RuntimeErrors
            raise self._failure(peer, what, error, sending=sending) from error

    def _wait(self, work: dist.Work, peer: int, what: str, *, sending: bool) -> None:
        with self._link_errors(peer, what, sending=sending):
            if self._on_stream:
                work.wait()  # the current stream waits; the process group's timeout aborts a stuck peer
            else:
                work.wait(self.timeout)

    def send(self, tensor: torch.Tensor, peer: int, what: str) -> None:
        tensor = tensor.detach().contiguous()
        group, group_peer = self._route(peer)
        with self._link_errors(peer, what, sending=True):
            work = dist.isend(tensor, group=group, group_dst=group_peer)
        assert work is not None  # isend returns a handle on every rank of the group
        self._release_completed()
        self._pending.append((work, tensor, peer, what))  # the tensor must outlive the send

    def _release_completed(self) -> None:
        """Drop the oldest sends that have completed, and their tensors (a gradient would live until the step ends)."""
        while self._pending and self._pending[0][0].is_completed():
            self._pending.popleft()

    def post_recv(self, buffer: torch.Tensor, peer: int, what: str) -> Callable[[], None]:
        group, group_peer = self._route(peer)
        with self._link_errors(peer, what, sending=False):
            work = dist.irecv(buffer, group=group, group_src=group_peer)
        assert work is not None
        return lambda: self._wait(work, peer, what, sending=False)

    def wait_sends(self) -> None:
        pending, self._pending = self._pending, deque()
        for work, _tensor, peer, what in pending:
            self._wait(work, peer, what, sending=True)

    def abort_links(self) -> None:
        """Abort the link groups after a failure, so that receives left posted cannot hold up the process's exit.

        On NCCL a posted receive is a kernel that waits for its peer; the communicator must be aborted before the
        process group can be destroyed. On gloo it only unregisters the groups; peers see the connections close at exit.
        The transport cannot be used afterwards.
        """
        if self._links is None or self._aborted:
            return
        self._aborted = True
        links = self._links
        self._pending.clear()
        for group in links:
            try:
                abort_process_group(group)
            except (RuntimeError, ValueError) as error:  # already destroyed, or a backend that cannot abort
                log.debug(f"aborting a link group failed: {error}")


class _Mailboxes:
    """Queues between every ordered pair of stages, and the flag that stops them all when one stage fails."""

    def __init__(self, num_stages: int) -> None:
        self.queues: dict[tuple[int, int], queue.SimpleQueue[torch.Tensor]] = {
            (src, dst): queue.SimpleQueue() for src in range(num_stages) for dst in range(num_stages)
        }
        self.failed = threading.Event()
        self.reason = ""


@dataclass
class _PostedReceive:
    """A receive that a thread-stage has posted and not yet filled."""

    buffer: torch.Tensor
    what: str
    done: bool = False


class ThreadTransport(Transport):
    """In-process links for stages that run as threads of one process; create them with :meth:`create`."""

    _POLL_SECONDS = 0.02

    def __init__(self, stage: int, mailboxes: _Mailboxes, device: torch.device, timeout: datetime.timedelta) -> None:
        super().__init__(stage, num_stages=len({src for src, _ in mailboxes.queues}), timeout=timeout)
        self._mailboxes = mailboxes
        self._device = device
        # Per peer, the posted receives not yet filled, oldest first; only this stage's thread touches them.
        self._posted: defaultdict[int, deque[_PostedReceive]] = defaultdict(deque)

    @classmethod
    def create(
        cls,
        num_stages: int,
        device: torch.device | str | Sequence[torch.device | str] = "cpu",
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> list[ThreadTransport]:
        """One linked transport per stage; ``device`` is every stage's, or a list with one per stage."""
        devices = [device] * num_stages if isinstance(device, (torch.device, str)) else list(device)
        if len(devices) != num_stages:
            raise ValueError(f"{len(devices)} devices given for {num_stages} stages; give one device per stage")
        mailboxes = _Mailboxes(num_stages)
        return [cls(stage, mailboxes, torch.device(devices[stage]), timeout) for stage in range(num_stages)]

    @property
    def device(self) -> torch.device:
        return self._device

    def send(self, tensor: torch.Tensor, peer: int, what: str) -> None:
        # A copy, as across processes: the receiver may modify its input in place while we still hold ours.
        self._mailboxes.queues[(self.stage, peer)].put(tensor.detach().clone())

    def post_recv(self, buffer: torch.Tensor, peer: int, what: str) -> Callable[[], None]:
        # Nothing is copied before the wait, but the queue keeps the peer's order: waiting for a later receive first
        # fills the earlier ones, as a process group would.
        receive = _PostedReceive(buffer, what)
        posted = self._posted[peer]
        posted.append(receive)

        def wait() -> None:
            while not receive.done:
                oldest = posted[0]
                self._take(oldest.buffer, peer, oldest.what)
                oldest.done = True
                posted.popleft()

        return wait

    def _take(self, buffer: torch.Tensor, peer: int, what: str) -> None:
        mailbox = self._mailboxes.queues[(peer, self.stage)]
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            if self._mailboxes.failed.is_set():
                raise self._failure(peer, what, f"the pipeline was aborted ({self._mailboxes.reason})")
            try:
                tensor = mailbox.get(timeout=self._POLL_SECONDS)
                break
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise self._failure(peer, what, "timed out") from None
        if tensor.shape != buffer.shape or tensor.dtype != buffer.dtype:
            raise PipelineError(
                self.stage,
                f"received {what} from stage {peer} as {tuple(tensor.shape)} {tensor.dtype}, "
                f"expected {tuple(buffer.shape)} {buffer.dtype}",
            )
        buffer.copy_(tensor)

    def wait_sends(self) -> None:
        pass  # puts complete immediately

    def abort(self, reason: str) -> None:
        self._posted.clear()
        self._mailboxes.reason = f"stage {self.stage} failed: {reason}"
        self._mailboxes.failed.set()
