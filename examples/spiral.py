"""A 10-class MLP trained as a 2-stage GPipe pipeline on CPU, checkpointed, with one step charted.

    python examples/spiral.py                        # about a minute on two CPU cores
    python examples/spiral.py --max-epochs 1 --out /tmp/spiral

Lightning's launcher runs this script once per stage (it re-runs it with LOCAL_RANK=1 for the second), so everything
that trains lives under ``if __name__ == "__main__":`` and the module level stays cheap to import.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, RichProgressBar
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

import lightning_gpipe
from lightning_gpipe.callbacks import PipelineTimeline

DIM, CLASSES = 32, 10
TRAIN_SAMPLES, VAL_SAMPLES, BATCH = 10240, 2048, 128
SEED = 0


def spirals(samples: int, seed: int) -> TensorDataset:
    """``CLASSES`` noisy spiral arms in a plane, embedded in ``DIM`` dimensions: learnable, but not linearly."""
    generator = torch.Generator().manual_seed(seed)
    label = torch.randint(CLASSES, (samples,), generator=generator)
    t = torch.rand(samples, generator=generator)
    radius = 0.5 + t  # starting away from the centre keeps neighbouring arms apart
    angle = 2 * math.pi * (label / CLASSES + t)
    plane = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    plane = plane + 0.02 * torch.randn(samples, 2, generator=generator)
    # A fixed random orthonormal embedding (seeded apart from the samples, so train and val share it).
    basis = torch.linalg.qr(torch.randn(DIM, DIM, generator=torch.Generator().manual_seed(SEED)))[0][:, :2]
    x = 3.0 * (plane @ basis.T + 0.02 * torch.randn(samples, DIM, generator=generator))
    return TensorDataset(x, label)


class SpiralClassifier(L.LightningModule):
    """An MLP classifier written as for one device: its layers are one ``nn.Sequential`` that GPipe splits."""

    def __init__(self, width: int = 128, depth: int = 5, lr: float = 5e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = [nn.Linear(DIM, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, CLASSES))
        self.layers = nn.Sequential(*layers)
        self.val_acc = MulticlassAccuracy(num_classes=CLASSES, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.layers(x), y)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.layers(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=1e-4)
        # One-cycle: a short warm-up then a decay to ~0 makes the curve smooth in a handful of epochs.
        total = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.hparams["lr"], pct_start=0.2, total_steps=total
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class EpochTable(Callback):
    """Keeps one row per epoch (losses, accuracy, seconds) to print when training ends."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, float, float, float, float]] = []
        self._start = 0.0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Validation has already run for this epoch, so its metrics are here too.
        metrics = trainer.callback_metrics
        train, loss, acc = (float(metrics.get(key, math.nan)) for key in ("train_loss_epoch", "val_loss", "val_acc"))
        self.rows.append((trainer.current_epoch, train, loss, acc, time.perf_counter() - self._start))

    def render(self) -> str:
        lines = [f"{'epoch':>5}  {'train_loss':>10}  {'val_loss':>8}  {'val_acc':>7}  {'seconds':>7}"]
        lines += [f"{e:>5}  {t:>10.4f}  {v:>8.4f}  {a:>7.2%}  {s:>7.1f}" for e, t, v, a, s in self.rows]
        return "\n".join(lines)


def accuracy_of(module: L.LightningModule, data: TensorDataset) -> float:
    x, y = data.tensors
    module.eval()
    with torch.no_grad():
        return float((module(x).argmax(dim=1) == y).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-epochs", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("out/spiral"), help="checkpoints and timeline.png go here")
    args = parser.parse_args()

    L.seed_everything(SEED, verbose=False)  # both stages build the same initial weights
    train, val = spirals(TRAIN_SAMPLES, seed=1), spirals(VAL_SAMPLES, seed=2)
    model = SpiralClassifier()
    checkpoints = ModelCheckpoint(dirpath=args.out, monitor="val_loss", save_last=True)
    table = EpochTable()
    trainer = L.Trainer(
        strategy=lightning_gpipe.GPipeStrategy(pipe_size=2, chunks=8),
        accelerator="cpu",
        devices=2,
        max_epochs=args.max_epochs,
        logger=False,  # the per-epoch table printed at the end is this demo's log
        callbacks=[RichProgressBar(), checkpoints, PipelineTimeline(args.out / "timeline.png"), table],
    )
    started = time.perf_counter()
    # Shuffled, yet both stages read the same batches: Lightning's sampler is seeded and the strategy makes it
    # data-parallel only (one replica here).
    trainer.fit(
        model,
        DataLoader(train, batch_size=BATCH, shuffle=True, drop_last=True),
        DataLoader(val, batch_size=4 * BATCH),
    )
    seconds = time.perf_counter() - started
    if not trainer.is_global_zero:
        return

    print(f"\n{table.render()}")
    print(f"\ntrained {args.max_epochs} epoch(s) in {seconds:.1f} s; final val_acc {table.rows[-1][3]:.2%}")
    print(f"checkpoint: {checkpoints.best_model_path} (best val_loss), last: {checkpoints.last_model_path}")
    print(f"timeline:   {args.out / 'timeline.png'}")
    # The checkpoint holds the whole model under its original names: the plain, unpartitioned module loads it.
    plain = SpiralClassifier()
    state = torch.load(checkpoints.best_model_path, weights_only=True)["state_dict"]
    plain.load_state_dict(state, strict=True)
    print(f"loaded into the plain SpiralClassifier (strict=True): val accuracy {accuracy_of(plain, val):.2%}")


if __name__ == "__main__":
    main()
