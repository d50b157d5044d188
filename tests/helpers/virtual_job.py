"""A fit whose stage boundaries carry shapes that vary per micro-batch and a value marked ``Unbatched``, run one process
per rank by the tests of several stages per process (``schedule="interleaved"``, ``"zbv"``).

``python -m helpers.jobs helpers.virtual_job CONFIG.json`` runs every fit of the config, then predicts the training
data, and writes from rank 0 the whole model's state dict after each fit (``result-N.pt``) and the predictions
(``predictions-N.pt``); ``fit(run, root)`` with ``"strategy": "auto"`` is the plain reference in the test's process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers.lightning_job import trainer_for
from helpers.whole import whole_module
from lightning_gpipe import Unbatched

SAMPLES, BATCH, LENGTH = 32, 16, 7  # batches of 16 sequences of 1 to 7 tokens, zero-padded to 7


class Trim(nn.Module):
    """Cuts the zero padding after the longest sequence of its input: per micro-batch under the pipeline, per batch in
    the plain model, so the boundaries' dim 1 varies between the micro-batches of a step."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x: (B, T, 6), zero after each length
        real = x.abs().sum(-1) > 0  # (B, T)
        width = int(real.sum(1).max())
        return x[:, :width], real[:, :width].to(x.dtype)


class Embed(nn.Module):
    """Embeds the tokens and passes on a shared (4, 8) table marked ``Unbatched``: its dim 0 is not the batch's."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 8)
        self.table = nn.Parameter(torch.randn(4, 8) / 4)

    def forward(self, value: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, Unbatched]:
        x, mask = value
        return torch.tanh(self.linear(x)), mask, Unbatched(self.table * 2)  # (B, W, 8), (B, W), (4, 8)


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, value: tuple[torch.Tensor, torch.Tensor, Unbatched]) -> tuple[torch.Tensor, torch.Tensor, Any]:
        h, mask, table = value
        assert isinstance(table, Unbatched)
        assert table.value.shape == (4, 8)
        return torch.tanh(self.linear(h + table.value.mean(0))), mask, table


class MaskedMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 3)

    def forward(self, value: tuple[torch.Tensor, torch.Tensor, Unbatched]) -> torch.Tensor:
        h, mask, _ = value
        return self.linear((h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True))


def ragged() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, LENGTH + 1, (SAMPLES,), generator=generator)
    x = torch.randn(SAMPLES, LENGTH, 6, generator=generator) * (
        torch.arange(LENGTH)[None, :, None] < lengths[:, None, None]
    )
    return TensorDataset(x, torch.randn(SAMPLES, 3, generator=generator))


class RaggedModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # 8 layers: one per stage for 4 processes of 2 stages, each process holding a trainable one.
        self.layers = nn.Sequential(Trim(), Embed(), *[Mix() for _ in range(5)], MaskedMean())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.layers(x), y)
        self.log("train_loss", loss)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layers(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def fit(run: dict[str, Any], root: Path) -> tuple[RaggedModule, torch.Tensor]:
    """The fitted module, and its predictions for the training data after the fit (on every rank)."""
    L.seed_everything(0, verbose=False)
    module = RaggedModule()
    trainer = trainer_for(run, root)
    trainer.fit(module, DataLoader(ragged(), batch_size=BATCH))
    predictions = trainer.predict(module, DataLoader(ragged(), batch_size=BATCH))
    assert predictions is not None
    return module, torch.cat(predictions)  # type: ignore[arg-type]


def main(config_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    root = Path(config_path).parent
    for index, run in enumerate(config["runs"]):
        module, predictions = fit(run, root)
        whole = whole_module(module)
        if whole is not None:
            torch.save(whole.state_dict(), root / f"result-{index}.pt")
            torch.save(predictions, root / f"predictions-{index}.pt")
