"""Train every zoo model's tiny configuration for a few steps, as one process per rank.

``python -m helpers.zoo_job OUT STEPS NAME:CHUNKS...``: for each model, seed, build, fit ``STEPS`` steps on one
repeated tiny batch with ``strategy="gpipe"`` (K = 2, M = CHUNKS), then rank 0 saves the whole trained state dict to
``OUT/NAME.pt`` and a full checkpoint to ``OUT/NAME.ckpt`` (for the fine-tuning tests).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_gpipe
from helpers.zoo_tiny import tiny_batch, tiny_model


class Repeated(Dataset):
    """The same batch every step, served one sample at a time."""

    def __init__(self, batch: Any, steps: int) -> None:
        self.batch, self.steps = batch, steps

    def __len__(self) -> int:
        size = len(self.batch[0]) if isinstance(self.batch, tuple) else len(self.batch)
        return size * self.steps

    def __getitem__(self, index: int) -> Any:
        size = len(self) // self.steps
        if isinstance(self.batch, tuple):
            return tuple(part[index % size] for part in self.batch)
        return self.batch[index % size]


def fit(name: str, steps: int, strategy: Any, devices: int, root: Path) -> L.LightningModule:
    L.seed_everything(0, verbose=False)
    model = tiny_model(name)
    batch = tiny_batch(name)
    size = len(batch[0]) if isinstance(batch, tuple) else len(batch)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        use_distributed_sampler=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(Repeated(batch, steps), batch_size=size))
    trainer.save_checkpoint(root / f"{name}.ckpt")  # a collective: every rank takes part, rank 0 writes
    return model


def main(out: str, steps: str, *runs: str) -> None:
    root = Path(out)
    for run in runs:
        name, chunks = run.split(":")
        strategy = lightning_gpipe.GPipeStrategy(pipe_size=2, chunks=int(chunks), deferred_batch_norm=True)
        model = fit(name, int(steps), strategy, 2, root)
        if model.global_rank == 0:
            torch.save(model.state_dict(), root / f"{name}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
