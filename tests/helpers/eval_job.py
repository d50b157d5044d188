"""Decoding and step outputs under GPipeStrategy (K = 2) in one 2-rank job; each rank writes what it saw.

``python -m helpers.jobs helpers.eval_job OUT``: a tiny zoo Transformer is fitted with ``val_bleu=True`` (greedy
decoding of every validation batch, through the stages), then asked for greedy and beam-search predictions; a small
classifier whose ``training_step`` returns extra keys is fitted with a callback that records what ``on_train_batch_end``
receives. Rank ``N`` writes ``OUT/rank-N.pt``; rank 0 also the Transformer's trained weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gpipe
from helpers.whole import whole_module
from helpers.zoo_job import Repeated
from helpers.zoo_tiny import tiny_batch, tiny_model

DECODING = {"val_bleu": True, "max_decode_len": 8, "length_penalty": 0.6, "lr": 1e-4}  # still decodes varied tokens


def translation_loaders() -> tuple[DataLoader, DataLoader]:
    train = DataLoader(Repeated(tiny_batch("transformer", seed=0), 2), batch_size=8)
    return train, DataLoader(TensorDataset(*tiny_batch("transformer", seed=1)), batch_size=8)


def fit_translator(trainer: L.Trainer) -> L.LightningModule:
    L.seed_everything(0, verbose=False)
    model = tiny_model("transformer", **DECODING)
    trainer.fit(model, *translation_loaders())
    return model


class Outputs(L.Callback):
    """What ``on_train_batch_end`` receives, step by step."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self.seen.append({k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in outputs.items()})


class Tagger(L.LightningModule):
    """Returns per-sample predictions and probabilities and a constant tag next to the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        logits = self.layers(x)
        return {"loss": F.cross_entropy(logits, y), "preds": logits.argmax(-1), "probs": logits.softmax(-1), "tag": "t"}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_tagger(trainer: L.Trainer) -> list[dict[str, Any]]:
    L.seed_everything(0, verbose=False)
    x = torch.randn(24, 6, generator=torch.Generator().manual_seed(5))
    outputs = Outputs()
    trainer.callbacks.append(outputs)
    trainer.fit(Tagger(), DataLoader(TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()), batch_size=8))
    return outputs.seen


def trainer(**kwargs: Any) -> L.Trainer:
    kwargs.setdefault("max_epochs", 1)
    return L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def main(out: str) -> None:
    root = Path(out)
    pipelined = trainer(devices=2, strategy=lightning_gpipe.GPipeStrategy(chunks=2), max_epochs=2)
    model = fit_translator(pipelined)
    seen: dict[str, Any] = {"fit_val_bleu": float(pipelined.callback_metrics["val_bleu"])}
    _, val = translation_loaders()
    # predict after fit runs on the stages fit kept
    seen["greedy"] = torch.cat(pipelined.predict(model, val))  # type: ignore[arg-type]
    model.hparams["beam_size"] = 3
    seen["beam"] = torch.cat(pipelined.predict(model, val))  # type: ignore[arg-type]
    whole = whole_module(model)
    if whole is not None:
        torch.save(whole.state_dict(), root / "translator.pt")
    # In the order of the dataset on every rank (one replica), as in the plain run.
    tagger = trainer(devices=2, strategy=lightning_gpipe.GPipeStrategy(chunks=3), use_distributed_sampler=False)
    seen["outputs"] = fit_tagger(tagger)
    torch.save(seen, root / f"rank-{pipelined.global_rank}.pt")
