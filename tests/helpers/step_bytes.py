"""The bytes a rank holds through one training step: what it held as the step began, and the peak of its allocations
above that, counted from the CPU allocator's own events (``torch.profiler`` with ``profile_memory``).

Exact on the CPU whatever the allocator caches, and it sees what :class:`~lightning_gpipe.profile.tensor_bytes.
LiveTensorBytes` cannot: FSDP2 allocates a unit's gathered parameters by resizing their storage
(``untyped_storage().resize_``), which no operator returns.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any, NoReturn

import lightning as L
import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from lightning_gpipe.engine.sharding import local_shard
from lightning_gpipe.engine.tree import flatten

__all__ = ["StepBytes", "allocation_peak", "end_after_profiling", "storage_bytes"]


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors`` (a shard's local storage), each counted once."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = local_shard(tensor).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def allocation_peak(profiler: profile) -> int:
    """The most bytes the profiled code had allocated at once above what it started with, from the allocator's events
    in the order they happened (frees are negative)."""
    events: list[tuple[int, int]] = []
    nodes = list(profiler.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while nodes:
        node = nodes.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        nodes.extend(node.children)
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


class StepBytes(L.Callback):
    """Training steps ``steps`` measured on this rank: ``state`` (its parameters, gradients, optimizer state and
    buffers as the first of them began, local shards only), ``batch`` (the batch's tensors) and ``growth`` (per step,
    the allocations' peak above them, the optimizer step included)."""

    def __init__(self, steps: Iterable[int]) -> None:
        self.steps = set(steps)
        self.state = self.batch = 0
        self.growth: list[int] = []
        self._profiler: profile | None = None

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, index: int) -> None:
        if trainer.global_step not in self.steps:
            return
        if not self.growth:
            parameters = list(module.parameters())
            optimizer = [t for s in trainer.optimizers[0].state.values() for t in s.values() if torch.is_tensor(t)]
            gradients = [p.grad for p in parameters if p.grad is not None]
            self.state = storage_bytes([*parameters, *gradients, *optimizer, *module.buffers()])
            self.batch = storage_bytes(t for t in flatten(batch)[0] if torch.is_tensor(t))
        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profiler.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if self._profiler is None:
            return
        self._profiler.__exit__(None, None, None)
        self.growth.append(allocation_peak(self._profiler))
        self._profiler = None

    def record(self) -> dict[str, Any]:
        """What was measured, for the job's results."""
        return {"state": self.state, "batch": self.batch, "growth": self.growth}


def end_after_profiling() -> NoReturn:
    """End the process now, successfully, without its exit handlers: the profiler leaves a thread of libkineto's
    (``ConfigLoader::updateConfigThread``) that can abort a process while it exits (seen once in ten 4-rank jobs:
    "terminate called without an active exception")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
