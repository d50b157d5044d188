"""Host synchronizations on CUDA (issue 13, R10/R16): a step may wait for the device, but never once per micro-batch.

``torch.cuda.set_sync_debug_mode("warn")`` makes every operation that blocks the host on the GPU raise a warning; the
tests count them. They need a CUDA device; on CPU the code paths are covered by counting host reads
(tests/tests_gpipe/test_log_mirror.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from helpers.runif import RunIf
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.log_mirror import LogRecorder

WIDTH = 16


@contextmanager
def _counting_host_syncs() -> Iterator[list[str]]:
    """Yield a list that collects one entry per synchronizing CUDA operation made inside the block."""
    syncs: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield syncs
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs.extend(str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message))


@RunIf(gpu=True)
def test_recording_logs_over_micro_batches_never_waits_for_the_device() -> None:
    module = L.LightningModule()
    recorder = LogRecorder(module)
    values = torch.arange(8.0, device="cuda")
    with _counting_host_syncs() as syncs:
        for position in range(8):
            with recorder.capture(position):
                module.log("loss", values[position])
        recorder.combine(torch.full((8,), 1 / 8, device="cuda"))
    assert syncs == []
    with _counting_host_syncs() as syncs:
        records, _ = recorder.portable()  # the one move to the host, once per step
    assert len(syncs) == 1
    assert records[0][1].item() == 3.5


class _Net(L.LightningModule):
    def __init__(self, sync_counts: list[int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 2))
        self.sync_counts = sync_counts
        self._counter: Any = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.layers(x), y)
        self.log("loss", loss)
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._counter = _counting_host_syncs()
        self._syncs = self._counter.__enter__()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._counter.__exit__(None, None, None)
        self.sync_counts.append(len(self._syncs))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _syncs_per_step(chunks: int) -> list[int]:
    counts: list[int] = []
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, WIDTH, generator=generator)
    trainer = L.Trainer(
        accelerator="cuda",
        devices=1,
        strategy=GPipeStrategy(pipe_size=1, chunks=chunks),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_Net(counts), DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16))
    return counts[1:]  # the first step also builds what later steps reuse


@RunIf(gpu=True)
def test_a_training_step_waits_for_the_device_as_often_with_8_micro_batches_as_with_2() -> None:
    two, eight = _syncs_per_step(2), _syncs_per_step(8)
    assert two == eight, f"host syncs per step: {two} with chunks=2, {eight} with chunks=8"
