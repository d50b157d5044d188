"""Point-to-point tensor links between the stages of one pipeline.

A transport moves plain tensors between neighbouring stages; what the tensors mean (which structure, which
micro-batch) is :mod:`lightning_gpipe.engine.boundary`'s business. Two implementations share one interface:

- :class:`ProcessGroupTransport`: ``torch.distributed`` P2P (gloo on CPU, NCCL on GPU). This is what lets a pipeline
  span processes and nodes. Each link between stages on two processes has two process groups of its own
  (:class:`LinkGroups`), one per direction. A process may hold several stages (:meth:`ProcessGroupTransport.for_stages`,
  one transport per stage); two adjacent stages on one process exchange copies through an in-process loopback.
- :class:`~lightning_gpipe.engine.thread_transport.ThreadTransport`: every stage in one process, one thread each,
  linked by in-memory queues; fast to start, for tests and notebooks.

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
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from lightning_gpipe.engine.errors import PipelineError
from lightning_gpipe.engine.torch_compat import abort_process_group

__all__ = ["DEFAULT_TIMEOUT", "LinkGroups", "PostedReceive", "ProcessGroupTransport", "Transport", "fill_receive"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
"""How long a stage waits for a neighbour's message before it raises `PipelineError` (torch's own default)."""


class LinkGroups(NamedTuple):
    """The two 2-rank process groups of the link between stages ``s`` and ``s + 1`` on two processes, one per direction.

    Every message from ``s`` to ``s + 1`` (activations, their headers) goes on ``down``, every message from ``s + 1`` to
    ``s`` (gradients, their headers, control messages) on ``up``. NCCL runs a group's operations in issue order on one
    stream per rank, and a large send completes only once its receive has started: on one group for both directions,
    under 1F1B stage ``s``'s send of the next activation would wait for a receive that stage ``s + 1`` posts only after
    its gradient's send, which waits for ``s``'s gradient receive, queued behind that activation's send.
    """

    down: dist.ProcessGroup
    up: dist.ProcessGroup


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

    This constructor makes the transport of a process's one stage; :meth:`for_stages` makes one per stage of a process
    that holds several.

    Args:
        ranks: the global rank of every stage, in stage order.
        device: where received tensors are allocated; a CUDA device means NCCL (see below).
        timeout: how long a CPU receive or send may take before it raises.
        links: the process groups of each link, ``links[j]`` those between stages ``j`` and ``j + 1``
            (:class:`LinkGroups`, as :func:`~lightning_gpipe.engine.layout.new_link_groups` creates them);
            ``links=None`` sends on the default group. On NCCL give them: the default group runs its collectives and
            P2P on one stream, in issue order.

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
        links: Sequence[LinkGroups | None] | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ProcessGroupTransport needs torch.distributed.init_process_group() first")
        rank = dist.get_rank()
        ranks = list(ranks)
        if ranks.count(rank) != 1:
            held = "is not one of" if rank not in ranks else "holds several stages of"
            raise ValueError(
                f"this process (global rank {rank}) {held} the pipeline's ranks {ranks}"
                + ("; make one transport per stage with ProcessGroupTransport.for_stages" if rank in ranks else "")
            )
        self._setup(ranks, ranks.index(rank), device, timeout, _link_groups(ranks, links))

    def _setup(
        self,
        ranks: list[int],
        stage: int,
        device: torch.device | str,
        timeout: datetime.timedelta,
        links: list[LinkGroups | None] | None,
    ) -> None:
        super().__init__(stage, len(ranks), timeout)
        self.ranks = ranks
        self._links = links
        self._routes: dict[tuple[int, bool], tuple[dist.ProcessGroup | None, int]] = {}  # by (peer, sending)
        self._loopbacks: dict[int, _Loopback] = {}  # the links to adjacent stages this process holds too
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

    @classmethod
    def for_stages(
        cls,
        ranks: Sequence[int],
        stages: Sequence[int],
        device: torch.device | str = "cpu",
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        links: Sequence[LinkGroups | None] | Mapping[int, LinkGroups | None] | None = None,
    ) -> dict[int, ProcessGroupTransport]:
        """One transport per stage this process holds, by stage, for a pipeline whose stage ``s`` runs on ``ranks[s]``.

        Args:
            ranks: the global rank of every stage, in stage order; a rank holding several stages repeats.
            stages: the stages this process holds (those ``ranks`` gives to its rank).
            device: where received tensors are allocated (see the class).
            timeout: how long a CPU receive or send may take before it raises.
            links: per stage ``s``, the :class:`LinkGroups` that carry only the messages between stages ``s`` and
                ``s + 1`` (a sequence of one per link, or a mapping), ``None`` or absent where one process holds both:
                those two exchange copies in the process. ``links=None`` sends on the default group, which works only
                while no two links join the same two processes (their messages would mix).

        Raises:
            ValueError: ``stages`` that are not this rank's in ``ranks``, or links missing where messages would mix.
        """
        if not dist.is_initialized():
            raise RuntimeError("ProcessGroupTransport needs torch.distributed.init_process_group() first")
        rank, ranks = dist.get_rank(), list(ranks)
        own = [stage for stage, holder in enumerate(ranks) if holder == rank]
        if sorted(stages) != own or len(set(stages)) != len(own):
            raise ValueError(
                f"stages={list(stages)}, but this process (global rank {rank}) holds stages {own} of ranks {ranks}; "
                "give those"
            )
        per_link = _link_groups(ranks, links)
        transports = {}
        for stage in own:
            transport = cls.__new__(cls)
            transport._setup(ranks, stage, device, timeout, per_link)
            transports[stage] = transport
        for stage in own:
            if stage + 1 in transports:  # both ends here: the messages stay in the process
                loopback = _Loopback()
                transports[stage]._loopbacks[stage + 1] = transports[stage + 1]._loopbacks[stage] = loopback
        return transports

    def _check_peer(self, peer: int) -> None:
        if abs(peer - self.stage) != 1:
            raise ValueError(f"stage {self.stage} has no link to stage {peer}: only adjacent stages exchange messages")
        if self._aborted:
            raise RuntimeError(f"stage {self.stage}'s links were aborted after a failure; the transport is closed")

    def _route(self, peer: int, *, sending: bool) -> tuple[dist.ProcessGroup | None, int]:
        """The group that carries this stage's messages to ``peer`` (``sending``) or from it, and the peer's rank in
        it: the link's ``down`` group for messages to the next stage, its ``up`` group for those to the previous."""
        self._check_peer(peer)
        if self._links is None:
            return None, self.ranks[peer]
        route = self._routes.get((peer, sending))
        if route is None:  # looked up once: get_group_rank walks the group's rank map on every call
            link = self._links[min(peer, self.stage)]
            if link is None:
                raise ValueError(
                    f"stage {self.stage} has no process group to stage {peer} (links[{min(peer, self.stage)}] is "
                    "None); make the transports with ProcessGroupTransport.for_stages"
                )
            group = link.down if (self.stage < peer) == sending else link.up
            route = self._routes[(peer, sending)] = (group, dist.get_group_rank(group, self.ranks[peer]))
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
        loopback = self._loopbacks.get(peer)
        if loopback is not None:
            self._check_peer(peer)
            loopback.send(peer, tensor)
            return
        tensor = tensor.detach().contiguous()
        group, group_peer = self._route(peer, sending=True)
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
        loopback = self._loopbacks.get(peer)
        if loopback is not None:
            self._check_peer(peer)
            return loopback.post_recv(self.stage, peer, buffer, what)
        group, group_peer = self._route(peer, sending=False)
        with self._link_errors(peer, what, sending=False):
            work = dist.irecv(buffer, group=group, group_src=group_peer)
        assert work is not None
        return lambda: self._wait(work, peer, what, sending=False)

    def wait_sends(self) -> None:
        pending, self._pending = self._pending, deque()
        for work, _tensor, peer, what in pending:
            self._wait(work, peer, what, sending=True)

    def abort(self, reason: str) -> None:
        for loopback in self._loopbacks.values():
            loopback.clear()  # a failed step's messages within the process must not reach the next step

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
        for loopback in self._loopbacks.values():
            loopback.clear()
        for link in links:
            for group in link or ():  # None: a link within this process
                try:
                    abort_process_group(group)
                except (RuntimeError, ValueError) as error:  # already destroyed, or a backend that cannot abort
                    log.debug(f"aborting a link group failed: {error}")


def _link_groups(
    ranks: list[int],
    links: Sequence[LinkGroups | None] | Mapping[int, LinkGroups | None] | None,
) -> list[LinkGroups | None] | None:
    """``links`` as one entry per link (``None`` within a process), checked to carry every link across processes in
    both directions; for ``links=None``, ``None`` if no two links join the same two processes (the default group then
    keeps them apart)."""
    across = [s for s in range(len(ranks) - 1) if ranks[s] != ranks[s + 1]]
    if links is None:
        pairs = [frozenset(ranks[s : s + 2]) for s in across]
        shared = [s for s in across if pairs.count(frozenset(ranks[s : s + 2])) > 1]
        if shared:
            raise ValueError(
                f"the links after stages {shared} join the same two processes (ranks {ranks}); pass links=, one "
                "LinkGroups per link (new_link_groups)"
            )
        return None
    if isinstance(links, Mapping):
        per_link = [links.get(s) for s in range(len(ranks) - 1)]
    else:
        per_link = list(links)
        if len(per_link) != len(ranks) - 1:
            raise ValueError(
                f"links has {len(per_link)} entries, not {len(ranks) - 1}: one per link (None within a process)"
            )
    missing = [s for s in across if per_link[s] is None]
    if missing:
        raise ValueError(
            f"links has no process group after stages {missing} (ranks {ranks}); give each its LinkGroups "
            "(new_link_groups)"
        )
    single = [s for s in across if not isinstance(per_link[s], LinkGroups)]
    if single:
        raise ValueError(
            f"the links after stages {single} are {[type(per_link[s]).__name__ for s in single]}, not LinkGroups; "
            "give each LinkGroups(down, up) of 2-rank groups (new_link_groups)"
        )
    return per_link


class _Loopback:
    """The link between two adjacent stages that one process holds: each send queues a copy, as a process group would
    deliver one, and the receives posted for a stage take the copies sent to it in posting order.

    The process runs its stages' actions one at a time in an order that respects their dependencies, so a message is
    always sent before its receive is waited for; a wait that finds nothing is that order broken, not a slow peer.
    """

    def __init__(self) -> None:
        self._sent: defaultdict[int, deque[torch.Tensor]] = defaultdict(deque)  # by receiving stage
        self._posted: defaultdict[int, deque[PostedReceive]] = defaultdict(deque)  # by receiving stage

    def send(self, receiver: int, tensor: torch.Tensor) -> None:
        # A copy, as across processes: the receiver may modify its input in place while the sender still holds it.
        self._sent[receiver].append(tensor.detach().clone())

    def post_recv(self, receiver: int, sender: int, buffer: torch.Tensor, what: str) -> Callable[[], None]:
        receive = PostedReceive(buffer, what)
        posted, sent = self._posted[receiver], self._sent[receiver]
        posted.append(receive)

        def wait() -> None:
            while not receive.done:
                oldest = posted[0]
                if not sent:
                    raise PipelineError(
                        receiver,
                        f"waited for {oldest.what} from stage {sender}, which this process holds and has not sent it; "
                        "run the stages' actions in the schedule's order",
                    )
                fill_receive(receiver, sender, oldest.buffer, sent.popleft(), oldest.what)
                oldest.done = True
                posted.popleft()

        return wait

    def clear(self) -> None:
        """Forget every message and posted receive (after a failed step)."""
        self._sent.clear()
        self._posted.clear()


def fill_receive(stage: int, peer: int, buffer: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    """Copy a message from stage ``peer`` into the receive ``buffer`` of ``stage``, refusing another shape or dtype."""
    if tensor.shape != buffer.shape or tensor.dtype != buffer.dtype:
        raise PipelineError(
            stage,
            f"received {what} from stage {peer} as {tuple(tensor.shape)} {tensor.dtype}, "
            f"expected {tuple(buffer.shape)} {buffer.dtype}",
        )
    buffer.copy_(tensor)


@dataclass
class PostedReceive:
    """A receive posted on an in-process link and not yet filled."""

    buffer: torch.Tensor
    what: str
    done: bool = False
