"""Tensors and objects the strategy sends between ranks besides the pipeline's own messages.

Two rules keep these collectives right on GPUs. Objects travel on the CPU: a CUDA tensor pickled by
``broadcast_object_list`` or ``gather_object`` is restored on the *sender's* device index, so a receiver would allocate
on another rank's GPU; :func:`portable` detaches and moves every tensor to the CPU before sending, and :func:`to_device`
puts what arrives on the receiver's own device. Tensors travel in flattened buckets, one collective per bucket
(:func:`buckets`), not one per tensor; a stage's whole state goes to one rank as raw bytes, one bucket at a time
(:func:`send_tensors`, :func:`receive_tensors`), so neither side holds more than its own tensors and one bucket.

An object sent every step (the step's loss and logs) goes by :func:`broadcast_object`: one collective of a fixed
``OBJECT_BYTES`` buffer when it fits, where ``broadcast_object_list`` always runs two (the size, then the bytes).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from lightning_gpipe.engine.framing import pack, unpack
from lightning_gpipe.engine.torch_compat import flatten_dense_tensors, unflatten_dense_tensors
from lightning_gpipe.engine.tree import map_tensors

__all__ = [
    "BUCKET_BYTES",
    "OBJECT_BYTES",
    "TRANSFER_BYTES",
    "TensorSpec",
    "broadcast_object",
    "broadcast_tensors",
    "buckets",
    "byte_buckets",
    "portable",
    "receive_tensors",
    "send_tensors",
    "to_device",
]

BUCKET_BYTES = 25 * 2**20
"""The most bytes one bucketed collective carries (DDP's default bucket size)."""
TRANSFER_BYTES = 4 * 2**20
"""The most bytes one message of :func:`send_tensors` carries: what either side holds beside its own tensors, small
beside a model worth a pipeline, large enough that a message's fixed cost (about 0.2 ms over gloo) does not count."""
OBJECT_BYTES = 16 * 2**10
"""The head :func:`broadcast_object` sends first (:func:`~lightning_gpipe.engine.framing.pack`): a step's logs fit."""


def portable(value: Any) -> Any:
    """``value`` with every tensor leaf detached and on the CPU, ready for an object collective."""
    return to_device(value, torch.device("cpu"))


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor leaf detached and moved to ``device`` (containers as in :mod:`.structure`)."""
    return map_tensors(lambda tensor: tensor.detach().to(device), value)


def buckets(tensors: list[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """``tensors`` in order, split by dtype and device into runs of at most ``bucket_bytes`` (a larger tensor alone).

    The split depends only on the tensors' order, dtypes, devices and sizes, so ranks holding alike tensors agree on it.
    """
    open_buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    used: dict[tuple[torch.dtype, torch.device], int] = {}
    done: list[list[torch.Tensor]] = []
    for tensor in tensors:
        key = (tensor.dtype, tensor.device)
        size = tensor.numel() * tensor.element_size()
        if open_buckets.get(key) and used[key] + size > bucket_bytes:
            done.append(open_buckets[key])
            open_buckets[key], used[key] = [], 0  # the key keeps its place: open buckets end in first-seen order
        open_buckets.setdefault(key, []).append(tensor)
        used.setdefault(key, 0)
        used[key] += size
    done.extend(open_buckets.values())
    return done


def broadcast_tensors(
    tensors: list[torch.Tensor], src: int, group: dist.ProcessGroup, bucket_bytes: int = BUCKET_BYTES
) -> None:
    """Overwrite ``tensors`` in place with global rank ``src``'s, in flattened buckets all in flight at once.

    Every rank of ``group`` passes alike tensors in the same order. With NCCL they must be on the rank's GPU.
    """
    pending = []
    for bucket in buckets(tensors, bucket_bytes):
        flat = flatten_dense_tensors(bucket)
        pending.append((bucket, flat, dist.broadcast(flat, src=src, group=group, async_op=True)))
    for bucket, flat, work in pending:
        work.wait()
        for tensor, value in zip(bucket, unflatten_dense_tensors(flat, bucket), strict=True):
            tensor.copy_(value)


def broadcast_object(value: Any, src: int, group: dist.ProcessGroup | None) -> Any:
    """Global rank ``src``'s ``value`` on every rank of ``group`` (a gloo group: the bytes stay on the CPU).

    One broadcast of ``OBJECT_BYTES`` when the pickled value fits, a second one with the rest otherwise
    (:mod:`~lightning_gpipe.engine.framing`). Give it :func:`portable` values: pickled CUDA tensors would be restored
    on the sender's device.
    """
    if dist.get_rank() == src:
        head, tail = pack(value, OBJECT_BYTES)
        dist.broadcast(head, src=src, group=group)
        if tail is not None:
            dist.broadcast(tail, src=src, group=group)
        return value

    def receive(size: int) -> torch.Tensor:
        buffer = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(buffer, src=src, group=group)
        return buffer

    return unpack(receive(OBJECT_BYTES), receive)


class TensorSpec(NamedTuple):
    """What a receiver needs to know of a tensor before its bytes arrive: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        """The spec of ``tensor``."""
        return cls(tuple(tensor.shape), tensor.dtype)

    @property
    def nbytes(self) -> int:
        """The tensor's size in bytes."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


_ALIGNMENT = 16  # every tensor starts at a multiple of this in a bucket, so its bytes can be viewed as its dtype


def byte_buckets(sizes: Sequence[int], bucket_bytes: int = TRANSFER_BYTES) -> list[list[tuple[int, int, int]]]:
    """Tensors of ``sizes`` bytes packed in order into buckets of at most ``bucket_bytes`` (a larger tensor alone).

    Each bucket lists ``(index, start, length)`` per tensor, starts aligned; empty tensors are left out. Sender and
    receiver compute the same packing from the same sizes.
    """
    done: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    used = 0
    for index, size in enumerate(sizes):
        if size == 0:
            continue
        start = -(-used // _ALIGNMENT) * _ALIGNMENT
        if current and start + size > bucket_bytes:
            done.append(current)
            current, start = [], 0
        current.append((index, start, size))
        used = start + size
    if current:
        done.append(current)
    return done


def send_tensors(
    tensors: Sequence[torch.Tensor], dst: int, group: dist.ProcessGroup | None, bucket_bytes: int = TRANSFER_BYTES
) -> None:
    """Send ``tensors`` to global rank ``dst`` as raw bytes, one CPU bucket at a time (:func:`receive_tensors` there).

    The sender holds one bucket beside its tensors, whatever their number; ``group`` is a gloo group (CPU buckets).
    """
    sizes = [tensor.numel() * tensor.element_size() for tensor in tensors]
    for bucket in byte_buckets(sizes, bucket_bytes):
        flat = torch.empty(_end(bucket), dtype=torch.uint8)
        for index, start, length in bucket:
            flat[start : start + length].copy_(_as_bytes(tensors[index]))
        _wait(dist.isend(flat, dst, group=group))


def receive_tensors(
    specs: Sequence[TensorSpec], src: int, group: dist.ProcessGroup | None, bucket_bytes: int = TRANSFER_BYTES
) -> Iterator[tuple[int, torch.Tensor]]:
    """The tensors of ``specs`` that global rank ``src`` sends with :func:`send_tensors`, as ``(index, tensor)``.

    Each tensor is a CPU view into the bucket just received, valid until the next one arrives: copy what you keep. The
    receiver holds one bucket at a time.
    """
    for bucket in byte_buckets([spec.nbytes for spec in specs], bucket_bytes):
        flat = torch.empty(_end(bucket), dtype=torch.uint8)
        _wait(dist.irecv(flat, src, group=group))
        for index, start, length in bucket:
            yield index, flat[start : start + length].view(specs[index].dtype).view(specs[index].shape)


def _wait(work: Any) -> None:
    # isend and irecv, waited for: torch's blocking send and recv post them too, and wrapping them twice (as the
    # tests' emulation of NCCL's stream order wraps every operation) would queue the inner one behind the outer.
    work.wait()


def _end(bucket: list[tuple[int, int, int]]) -> int:
    _, start, length = bucket[-1]
    return start + length


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)
