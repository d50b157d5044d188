"""Every Lightning flow under GPipeStrategy in one 2-rank job: fit with validation, callbacks, loggers and
torchmetrics; validate; test; predict; bf16-mixed. Each rank writes what it saw to ``rank-N.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gpipe


def data(samples: int = 96, seed: int = 3) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 8, generator=generator)
    return TensorDataset(x, (x[:, 0] > 0).long())


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.layers(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.layers(x)
        self.accuracy(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True, prog_bar=True)
        self.log("val_acc", self.accuracy, on_epoch=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.cross_entropy(self.layers(x), y))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layers(batch[0]).argmax(-1)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.02)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.9)}


def plain(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) else value


def main(out: str) -> None:
    root = Path(out)
    L.seed_everything(0, verbose=False)
    module = Classifier()
    checkpoints = ModelCheckpoint(dirpath=root / "ckpt", monitor="val_loss", save_last=True, save_top_k=2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=lightning_gpipe.GPipeStrategy(chunks=4),
        max_epochs=3,
        logger=CSVLogger(root / "logs"),
        callbacks=[checkpoints, EarlyStopping("val_loss", patience=5), LearningRateMonitor()],
        enable_progress_bar=True,
        log_every_n_steps=1,
    )
    train, val = DataLoader(data(), batch_size=16), DataLoader(data(32, seed=4), batch_size=16)
    trainer.fit(module, train, val)
    seen: dict[str, Any] = {"fit": {k: plain(v) for k, v in trainer.callback_metrics.items()}}
    seen["best"] = str(checkpoints.best_model_path)
    seen["validate"] = [{k: plain(v) for k, v in r.items()} for r in trainer.validate(module, val)]
    seen["test"] = [{k: plain(v) for k, v in r.items()} for r in trainer.test(module, val)]
    predictions = trainer.predict(module, val)
    seen["predict"] = torch.cat(predictions).tolist()  # type: ignore[arg-type]
    trainer.strategy.gather_module()  # type: ignore[attr-defined]  # each rank kept its stage: a new Trainer cuts anew
    bf16 = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=lightning_gpipe.GPipeStrategy(chunks=4),
        precision="bf16-mixed",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
    )
    bf16.fit(module, train)
    seen["bf16_loss"] = plain(bf16.callback_metrics["train_loss"])
    (root / f"rank-{trainer.global_rank}.json").write_text(json.dumps(seen))
