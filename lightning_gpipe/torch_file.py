"""A ``torch.save`` file written and read one tensor at a time, in place.

``torch.save`` serializes every tensor of its value at once, so whoever writes a whole model's checkpoint holds the
whole model; ``torch.load`` reads every tensor, and even memory-mapped it keeps each page it touched resident for as
long as any tensor of the file lives. Here the file's layout is written first, under
``torch.serialization.skip_data`` (every tensor's space reserved, no tensor read: placeholders without memory stand for
the ones not here yet), and each tensor's bytes are written into their place later, as they arrive (``os.pwrite``).
Reading, only the tensors asked for are read, each into fresh memory (``os.preadv``); the others stay memory-mapped and
untouched. Page-cache pages that a plain read or write goes through are the kernel's, not the process's resident
memory.

Where each tensor lies is torch's own answer: the file loaded memory-mapped (``torch.load(mmap=True)`` maps the whole
file once and places each storage at its record's offset) gives every tensor's address, and the address minus the
mapping's start is its offset in the file.
"""

from __future__ import annotations

import os
import struct
import zipfile
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import Tensor

from lightning_gpipe.engine.collectives import TensorSpec
from lightning_gpipe.engine.torch_compat import memoryless_tensor
from lightning_gpipe.engine.tree import flatten

__all__ = ["TensorFile", "placeholder", "tensor_leaves", "write_layout"]


def placeholder(spec: TensorSpec) -> Tensor:
    """A tensor of ``spec`` without memory: :func:`write_layout` reserves its space, a CPU tensor's."""
    return memoryless_tensor(spec.shape, spec.dtype)


def write_layout(value: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(value, path)`` with every tensor's bytes left out: its space is reserved, its memory not read.

    Placeholders (:func:`placeholder`) and real tensors alike; :meth:`TensorFile.write` fills them in afterwards.
    """
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(value, path)


def tensor_leaves(value: Any) -> list[Tensor]:
    """The tensors of a nested value, depth first in container order (as :mod:`lightning_gpipe.engine.tree` walks)."""
    return [leaf for leaf in flatten(value)[0] if isinstance(leaf, Tensor)]


class TensorFile:
    """A ``torch.save`` file memory-mapped and left untouched: :attr:`value` is what it holds, each tensor mapping its
    bytes in the file; :meth:`read` copies one tensor into fresh memory, :meth:`write` writes one in place.

    Args:
        path: the file, loaded with ``weights_only=True``.
        writable: open it for :meth:`write`: a layout this process just wrote (:func:`write_layout`), which is read
            back as it was written, whatever objects it holds (a checkpoint may hold any, as ``torch.save`` takes them).
    """

    def __init__(self, path: str | os.PathLike[str], writable: bool = False) -> None:
        self.path = Path(path)
        self.value = torch.load(self.path, mmap=True, weights_only=not writable, map_location="cpu")
        self._base = _mapping_start(self.path, tensor_leaves(self.value))
        self._fd = os.open(self.path, os.O_RDWR if writable else os.O_RDONLY)

    def offset(self, tensor: Tensor) -> int:
        """Where the bytes of ``tensor`` (one of :attr:`value`'s, contiguous) start in the file."""
        return tensor.data_ptr() - self._base

    def read(self, tensor: Tensor, into: Tensor | None = None) -> Tensor:
        """A copy of ``tensor`` (one of :attr:`value`'s), read from the file without mapping a page: into ``into``
        where it is a contiguous CPU tensor of the same shape and dtype (then returned), else into fresh memory."""
        if not tensor.is_contiguous() or tensor.numel() == 0:
            return tensor.clone()
        fits = into is not None and into.device.type == "cpu" and into.is_contiguous()
        if into is not None and fits and (into.shape, into.dtype) == (tensor.shape, tensor.dtype):
            copy = into.detach()
        else:
            copy = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        read = os.preadv(self._fd, [_buffer(copy)], self.offset(tensor))
        if read != copy.nbytes:
            raise OSError(f"{self.path} ends {copy.nbytes - read} bytes early: the file is truncated")
        return copy

    def write(self, tensor: Tensor, data: Tensor) -> None:
        """Write ``data`` (a tensor of ``tensor``'s shape and dtype, on any device) where ``tensor``, one of
        :attr:`value`'s, lies."""
        if tensor.numel() == 0:
            return
        if not tensor.is_contiguous() or tensor.shape != data.shape or tensor.dtype != data.dtype:
            into = f"{tensor.dtype} {tuple(tensor.shape)}"
            raise ValueError(f"cannot write a {data.dtype} {tuple(data.shape)} into {into} (or a strided one)")
        raw = _buffer(data.detach().cpu().contiguous())
        written = os.pwrite(self._fd, raw, self.offset(tensor))
        if written != raw.nbytes:
            raise OSError(f"wrote {written} of {raw.nbytes} bytes into {self.path}")

    def close(self, sync: bool = False) -> None:
        """Close the file (``sync``: first make what was written durable) and drop the mapping."""
        if sync:
            os.fsync(self._fd)
        os.close(self._fd)
        self.value = None

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self.value is not None:
            self.close()


def _buffer(tensor: Tensor) -> Any:
    """The memory of a contiguous CPU tensor as a buffer of bytes, which ``os`` reads into and writes from."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _record_offsets(path: Path) -> list[int]:
    """Where the bytes of each non-empty storage record start in a ``torch.save`` zip file, in file order."""
    offsets = []
    with open(path, "rb") as handle, zipfile.ZipFile(handle) as archive:
        for info in archive.infolist():
            parts = info.filename.split("/")
            if len(parts) != 3 or parts[1] != "data" or info.file_size == 0:
                continue
            handle.seek(info.header_offset)
            header = handle.read(30)  # a zip local file header; its last two fields: name and extra field lengths
            name_length, extra_length = struct.unpack("<HH", header[26:30])
            offsets.append(info.header_offset + 30 + name_length + extra_length)
    return sorted(offsets)


def _mapping_start(path: Path, tensors: list[Tensor]) -> int:
    """The address at which ``torch.load(mmap=True)`` mapped ``path``, from the tensors it returned.

    Each storage is mapped at its record's offset from the start of one mapping of the whole file: the lowest storage
    address belongs to the first record, and every storage must then sit on a record's start.
    """
    addresses = sorted({t.untyped_storage().data_ptr() for t in tensors if t.untyped_storage().nbytes() > 0})
    offsets = _record_offsets(path)
    if not addresses:
        return 0
    start = addresses[0] - offsets[0]
    if not {address - start for address in addresses} <= set(offsets):
        raise RuntimeError(f"{path}: the memory-mapped tensors do not sit on the file's records")
    return start
