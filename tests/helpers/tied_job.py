"""Models with weights and buffers shared across pipeline stages, and a job that trains them one process per rank.

``python -m helpers.jobs helpers.tied_job CONFIG.json`` runs every fit of the config (GPipe, DDP or plain) and writes,
from rank 0, the whole model's state dict after each fit (``result-N.pt``) and whether its tied tensors are still one
tensor (``tied-N.json``).
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

VOCAB, WIDTH, LENGTH, SAMPLES, BATCH = 11, 8, 5, 64, 16


def tied_lm() -> nn.Sequential:
    """A tiny language model whose output projection is its input embedding (8 layers: 1, 2 and 4 stages)."""
    embedding = nn.Embedding(VOCAB, WIDTH)
    head = nn.Linear(WIDTH, VOCAB)
    head.weight = embedding.weight
    return nn.Sequential(
        embedding, nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH),
        nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), head,
    )  # fmt: skip


class Table(nn.Module):
    """Buffers only, read by every block, like a rotary-embedding table."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, WIDTH), persistent=False)


class Block(nn.Module):
    def __init__(self, table: Table) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.table = table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * self.table.scale


def shared_table() -> nn.Sequential:
    """Four blocks that read one buffer-only module."""
    table = Table()
    return nn.Sequential(*[Block(table) for _ in range(4)])


def tokens(samples: int = SAMPLES) -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    sequence = torch.randint(0, VOCAB, (samples, LENGTH + 1), generator=generator)
    return TensorDataset(sequence[:, :-1], sequence[:, 1:])


def vectors(samples: int = SAMPLES) -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    return TensorDataset(
        torch.randn(samples, WIDTH, generator=generator), torch.randn(samples, WIDTH, generator=generator)
    )


class TiedModule(L.LightningModule):
    """``model="lm"``: the tied language model, cross-entropy over next tokens; ``"table"``: the shared table, MSE."""

    def __init__(self, model: str = "lm", meta: bool = False) -> None:
        super().__init__()
        self.model_name = model
        self.layers: nn.Sequential | None = None
        if not meta:  # else built in configure_model, on meta under GPipeStrategy
            torch.manual_seed(0)
            self.configure_model()

    def configure_model(self) -> None:
        if self.layers is None:
            self.layers = tied_lm() if self.model_name == "lm" else shared_table()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        output = self.layers(x)  # type: ignore[misc]
        if self.model_name == "lm":
            loss = F.cross_entropy(output.reshape(-1, VOCAB), y.reshape(-1))
        else:
            loss = F.mse_loss(output, y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def fit(run: dict[str, Any], root: Path) -> TiedModule:
    L.seed_everything(0, verbose=False)
    model = run.get("model", "lm")
    module = TiedModule(model, run.get("meta", False))
    trainer = trainer_for(run, root)
    data = tokens() if model == "lm" else vectors()
    trainer.fit(
        module, DataLoader(data, batch_size=BATCH, shuffle=run.get("shuffle", False)), ckpt_path=run.get("resume")
    )
    if run.get("save"):
        trainer.save_checkpoint(run["save"])
    return module


def main(config_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    root = Path(config_path).parent
    for index, run in enumerate(config["runs"]):
        module = fit(run, root)
        whole = whole_module(module)
        if whole is not None:
            torch.save(whole.state_dict(), root / f"result-{index}.pt")
            layers = module.layers
            assert layers is not None
            tied = layers[0].weight is layers[-1].weight if run.get("model", "lm") == "lm" else None
            (root / f"tied-{index}.json").write_text(json.dumps({"tied": tied}))
