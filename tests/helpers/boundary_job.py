"""A 2-rank fit of a model with real-model habits: non-persistent buffers in every layer (rotary tables, BERT's
``position_ids``), batches that are a ``UserDict`` (Hugging Face's ``BatchEncoding``), and the whole model kept next
to the sequence outside the module's submodules. Rank 0 writes what the module holds after fit to ``after.pt``."""

from __future__ import annotations

from collections import UserDict
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import lightning_gpipe
from helpers.whole import whole_module


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("table", torch.linspace(0.5, 1.5, 8), persistent=False)
        self.register_buffer("position_ids", torch.arange(8)[None], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x) * self.table) + 0.01 * self.position_ids


class Whole(nn.Module):
    """The model the sequence is built from, kept for later use (as one keeps a Hugging Face model to save it)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Rotary() for _ in range(4)])
        self.head = nn.Linear(8, 2)


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        whole = Whole()
        object.__setattr__(self, "whole", whole)  # not a submodule: each stage holds only its own layers
        self.layers = nn.Sequential(*whole.blocks, whole.head)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.layers(batch["inputs"]), batch["labels"])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> UserDict:
    return UserDict(inputs=torch.stack([x for x, _ in samples]), labels=torch.stack([y for _, y in samples]))


def samples() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=generator)
    return list(zip(x, (x[:, 0] > 0).long(), strict=True))


def main(out: str) -> None:
    L.seed_everything(0, verbose=False)
    module = Module()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=lightning_gpipe.GPipeStrategy(chunks=4),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(samples(), batch_size=16, collate_fn=collate))
    if whole_module(module) is not None:
        x = torch.stack([x for x, _ in samples()])
        after = {
            "buffers": dict(module.layers.named_buffers()),
            "state": module.state_dict(),
            "output": module.layers(x).detach(),
            "whole_head": module.whole.head.weight.detach().clone(),
        }
        torch.save(after, Path(out) / "after.pt")
