"""16-bit mixed precision with loss scaling across stages: an inf on one stage must skip the step on every stage.

Runs on CPU with an explicit ``MixedPrecision("16-mixed", "cpu", GradScaler)`` plugin (Lightning would turn
``precision="16-mixed"`` into bf16 on CPU), which exercises the same GradScaler path as on GPU. Each rank writes the
loss scale and a checksum of its parameters after every step to ``rank-N.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gpipe

INF_STEP = 2


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
        self.trace: list[dict[str, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.layers(x), y)

    def on_after_backward(self) -> None:
        if self.global_step == INF_STEP and self.trainer.strategy.layout.stage == 0:
            first = next(p for p in self.parameters() if p.grad is not None)
            first.grad[0, 0] = float("inf")  # an overflow on stage 0 only

    def on_train_batch_end(self, *args: Any) -> None:
        scaler = self.trainer.precision_plugin.scaler  # type: ignore[attr-defined]
        checksum = sum(p.double().sum().item() for p in self.parameters())
        self.trace.append({"scale": scaler.get_scale(), "checksum": checksum})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(out: str) -> None:
    L.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=generator)
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)
    module = Net()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=lightning_gpipe.GPipeStrategy(chunks=4),
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))],
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data)
    (Path(out) / f"rank-{trainer.global_rank}.json").write_text(json.dumps(module.trace))
