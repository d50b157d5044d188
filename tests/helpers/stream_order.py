"""NCCL's ordering rule imposed on gloo, so that CPU tests catch what would deadlock on GPUs.

NCCL runs every operation of one process group, point-to-point or collective, on one stream per rank, in the order the
rank issued them: an operation starts only when all earlier operations of that group on that rank have finished. A
collective issued after a posted receive therefore waits for the receive, and a send waits behind the receives posted
before it. Gloo has no such rule (each operation progresses on its own), so a design that deadlocks on NCCL can pass
every CPU test.

:func:`impose_stream_order` patches ``torch.distributed`` in the calling process: each wrapped operation is queued on
a FIFO worker thread of its group (one per group, per process), which runs the real gloo operation to completion
before it starts the next. The caller gets a handle that completes when its operation has run, as NCCL's would. A
send completes only when the peer has posted the matching receive (gloo parks sends until then), the strictest of the
behaviours NCCL allows. Call it in each rank's process, after ``import torch.distributed`` and before the job runs;
it wraps the P2P and collective functions that Lightning, torchmetrics and this project call, including those that
``broadcast_object_list`` and the other object collectives use internally.
"""

from __future__ import annotations

import inspect
import os
import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

__all__ = ["impose_stream_order"]

_WRAPPED = (
    "isend",
    "irecv",
    "send",
    "recv",
    "barrier",
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "reduce",
    "reduce_scatter_tensor",
    "all_to_all_single",
)
_ALWAYS_ASYNC = ("isend", "irecv")

STALL_SECONDS = float(os.environ.get("STREAM_ORDER_STALL_SECONDS", "20"))
"""How long a wait may take before the emulation calls it a deadlock (a wait with a shorter timeout gives up sooner)."""


class _Work:
    """The handle of an operation queued on a stream: complete once the stream has run it."""

    def __init__(self, what: str, stream: _Stream) -> None:
        self.what = what
        self._stream = stream
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future[Any] | None = None
        self._lock = threading.Lock()

    def finish(self, error: BaseException | None) -> None:
        with self._lock:
            self._error = error
            self._done.set()
            future = self._future
        if future is not None:
            self._settle(future)

    def _settle(self, future: torch.futures.Future[Any]) -> None:
        if self._error is not None:
            future.set_exception(self._error)
        else:
            future.set_result(None)

    def wait(self, timeout: timedelta | None = None) -> bool:
        # NCCL gives up only after the group's timeout; here a stall ends after STALL_SECONDS, so a deadlock costs
        # seconds instead of the 30-minute default, and names the operation its stream is stuck in.
        seconds = STALL_SECONDS if timeout is None else min(timeout.total_seconds(), STALL_SECONDS)
        if not self._done.wait(seconds):
            raise RuntimeError(
                f"{self.what} did not finish in {seconds:g} s: it waits behind earlier operations of its group "
                f"(stream-ordered emulation of NCCL), which is running {self._stream.running}"
            )
        if self._error is not None:
            raise RuntimeError(f"{self.what} failed: {self._error}") from self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def get_future(self) -> torch.futures.Future[Any]:
        with self._lock:
            if self._future is None:
                self._future = torch.futures.Future()
                if self._done.is_set():
                    self._settle(self._future)
            return self._future


class _Stream:
    """One group's FIFO on this rank: a worker thread that runs the group's operations one at a time."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], _Work]] = queue.SimpleQueue()
        self.running = "nothing"  # what the worker runs now, for the stall's error
        threading.Thread(target=self._run, name=f"stream-{name}", daemon=True).start()

    def submit(self, operation: Callable[[], Any], what: str) -> _Work:
        work = _Work(what, self)
        self._queue.put((operation, work))
        return work

    def _run(self) -> None:
        while True:
            operation, work = self._queue.get()
            self.running = work.what
            try:
                result = operation()
                if result is not None and hasattr(result, "wait"):
                    result.wait()  # the gloo operation itself, bounded by the group's timeout
            except BaseException as error:  # reported to whoever waits on the handle
                work.finish(error)
            else:
                work.finish(None)
            self.running = "nothing"


_streams: dict[int, _Stream] = {}
_streams_lock = threading.Lock()


def _stream(group: dist.ProcessGroup) -> _Stream:
    with _streams_lock:
        if id(group) not in _streams:
            _streams[id(group)] = _Stream(distributed_c10d._get_process_group_name(group))
        return _streams[id(group)]


def _ordered(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(real)

    def ordered(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        group = bound.arguments.get("group")
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            return real(*args, **kwargs)  # torch's own no-op on ranks outside the group
        if group is None or group is dist.GroupMember.WORLD:
            group = distributed_c10d._get_default_group()
        asynchronous = name in _ALWAYS_ASYNC or bool(bound.arguments.get("async_op", False))
        if "async_op" in signature.parameters:
            bound.arguments["async_op"] = False  # the stream waits for it to finish

        def operation() -> Any:
            return real(*bound.args, **bound.kwargs)

        work = _stream(group).submit(operation, f"{name} on group {distributed_c10d._get_process_group_name(group)}")
        if asynchronous:
            return work
        work.wait()
        return None

    ordered._stream_ordered = True  # type: ignore[attr-defined]
    return ordered


def impose_stream_order() -> None:
    """Make every wrapped ``torch.distributed`` operation of this process run in issue order per group."""
    for name in _WRAPPED:
        real = getattr(distributed_c10d, name)
        if getattr(real, "_stream_ordered", False):
            continue  # already imposed in this process
        ordered = _ordered(name, real)
        setattr(distributed_c10d, name, ordered)
        setattr(dist, name, ordered)
