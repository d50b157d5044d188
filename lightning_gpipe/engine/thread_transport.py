"""In-process links: every stage of a pipeline a thread of one process, messages passed through in-memory queues.

:class:`ThreadTransport` is the :class:`~lightning_gpipe.engine.transport.Transport` of
:func:`~lightning_gpipe.engine.pipeline.run_in_threads`: fast to start, for tests and notebooks.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence

import torch

from lightning_gpipe.engine.transport import DEFAULT_TIMEOUT, PostedReceive, Transport, fill_receive

__all__ = ["ThreadTransport"]


class _Mailboxes:
    """Queues between every ordered pair of stages, and the flag that stops them all when one stage fails."""

    def __init__(self, num_stages: int) -> None:
        self.queues: dict[tuple[int, int], queue.SimpleQueue[torch.Tensor]] = {
            (src, dst): queue.SimpleQueue() for src in range(num_stages) for dst in range(num_stages)
        }
        self.failed = threading.Event()
        self.reason = ""


class ThreadTransport(Transport):
    """In-process links for stages that run as threads of one process; create them with :meth:`create`."""

    _POLL_SECONDS = 0.02

    def __init__(self, stage: int, mailboxes: _Mailboxes, device: torch.device, timeout: datetime.timedelta) -> None:
        super().__init__(stage, num_stages=len({src for src, _ in mailboxes.queues}), timeout=timeout)
        self._mailboxes = mailboxes
        self._device = device
        # Per peer, the posted receives not yet filled, oldest first; only this stage's thread touches them.
        self._posted: defaultdict[int, deque[PostedReceive]] = defaultdict(deque)

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
        receive = PostedReceive(buffer, what)
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
        fill_receive(self.stage, peer, buffer, tensor, what)

    def wait_sends(self) -> None:
        pass  # puts complete immediately

    def abort(self, reason: str) -> None:
        self._posted.clear()
        self._mailboxes.reason = f"stage {self.stage} failed: {reason}"
        self._mailboxes.failed.set()
