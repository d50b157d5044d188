"""What a user's own LightningModule does under GPipeStrategy, in one 2-rank job: stopping from ``training_step``,
a token-mean loss over padding, a Metric logged per step, predictions that are not per-sample, indexing the
sequence in ``configure_optimizers``, two optimizers, a checkpoint saved on global rank 0 alone, and a token-mean loss
on sequences trimmed per micro-batch.

``python -m helpers.jobs helpers.user_model_job OUT [SECTION ...]`` (all sections by default) writes what each rank saw
to ``OUT/rank-N.json``; a section that fails records its error instead, so that one broken behaviour does not hide the
others. The modules and data are importable, so the test computes the plain-Lightning reference in its own process.
"""

from __future__ import annotations

import datetime
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gpipe
from helpers.whole import whole_module

VOCAB, LENGTH = 12, 6


def token_data() -> TensorDataset:
    """Token ids and next-token targets, each row padded (target -100) after its own random length."""
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (32, LENGTH), generator=generator)
    lengths = torch.randint(1, LENGTH + 1, (32,), generator=generator)
    target = ids.roll(-1, 1).masked_fill(torch.arange(LENGTH)[None] >= lengths[:, None], -100)
    return TensorDataset(ids, target)


def class_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(32, 4, generator=generator)
    return TensorDataset(x, torch.randint(0, 3, (32,), generator=generator))


class TokenMean(L.LightningModule):
    """An LM-style loss: the mean over the batch's real tokens, reported with its normalizer (``loss_weight``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, VOCAB))

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        ids, target = batch
        logits = self.layers(ids)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100)
        self.log("token_loss", loss)
        return {"loss": loss, "loss_weight": (target != -100).sum()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class TrimmedTokenMean(TokenMean):
    """The same loss on sequences cut after the batch's longest one: under GPipe each micro-batch is cut after its
    own longest, so the activations between the stages differ in length from one micro-batch to the next."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        ids, target = batch
        width = int((target != -100).sum(1).max())  # targets are real up to each row's length
        return super().training_step((ids[:, :width], target[:, :width]), batch_idx)


class Classifier(L.LightningModule):
    """A classifier whose accuracy is logged per step, and whose head gets its own learning rate by index."""

    def __init__(self, optimizers: str = "groups") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="macro")
        self.optimizers_kind = optimizers
        self.step_accuracy: list[float] = []
        self.stop_at: int | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.layers(x)
        self.accuracy(logits, y)
        self.log("acc", self.accuracy, on_step=True, on_epoch=False)
        if batch_idx == self.stop_at:
            self.trainer.should_stop = True
        return F.cross_entropy(logits, y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.step_accuracy.append(float(self.trainer.callback_metrics["acc"]))

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x = batch[0]
        return {"batch_idx": batch_idx, "scale": torch.tensor(2.0), "tag": "v1", "out": self.layers(x)}

    def configure_optimizers(self) -> Any:
        if self.optimizers_kind == "two":
            return [torch.optim.SGD(list(self.parameters())[:2], lr=0.1), torch.optim.SGD(self.parameters(), lr=0.1)]
        if self.optimizers_kind == "plain":  # no indexing: the other sections do not depend on it
            return torch.optim.SGD(self.parameters(), lr=0.1)
        head = list(self.layers[-1].parameters())  # indexing the sequence: per-layer learning rates
        body = [p for p in self.parameters() if all(p is not h for h in head)]
        return torch.optim.SGD([{"params": body, "lr": 0.05}, {"params": head, "lr": 0.2}])


def trainer(devices: int, steps: int = 3, **options: Any) -> L.Trainer:
    strategy: Any = "auto"
    if devices > 1:
        strategy = lightning_gpipe.GPipeStrategy(chunks=4, timeout=datetime.timedelta(seconds=20))
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        **options,
    )


def fit_token_mean(devices: int, trimmed: bool = False) -> dict[str, torch.Tensor] | None:
    """The trained module's state dict on global rank 0, ``None`` elsewhere."""
    L.seed_everything(0, verbose=False)
    module = TrimmedTokenMean() if trimmed else TokenMean()
    trainer(devices).fit(module, DataLoader(token_data(), batch_size=16))
    whole = whole_module(module)
    return None if whole is None else {key: value.detach().clone() for key, value in whole.state_dict().items()}


def fit_classifier(devices: int, optimizers: str = "groups", **options: Any) -> tuple[Classifier, L.Trainer]:
    L.seed_everything(0, verbose=False)
    module = Classifier(optimizers)
    run = trainer(devices, **options)
    run.fit(module, DataLoader(class_data(), batch_size=16))
    return module, run


def section(seen: dict[str, Any], name: str, work: Callable[[], Any]) -> None:
    started = time.monotonic()
    try:
        seen[name] = work()
    except Exception as error:  # recorded: the test names the failing behaviour
        seen[name] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()[-3000:]}
    print(f"section {name}: {time.monotonic() - started:.1f} s", flush=True)


def main(out: str, *chosen: str) -> None:
    root = Path(out)
    seen: dict[str, Any] = {}
    rank = int(__import__("os").environ.get("LOCAL_RANK", "0"))

    def token_mean() -> list[float] | None:
        state = fit_token_mean(2)
        if state is not None:
            torch.save(state, root / "token-mean.pt")
        return None if state is None else [float(value.sum()) for value in state.values()]

    def trimmed_token_mean() -> list[float] | None:
        state = fit_token_mean(2, trimmed=True)
        if state is not None:
            torch.save(state, root / "trimmed-token-mean.pt")
        return None if state is None else [float(value.sum()) for value in state.values()]

    def metric_and_groups() -> dict[str, Any]:
        module, _run = fit_classifier(2)
        step_accuracy = module.step_accuracy
        whole = whole_module(module)
        if whole is not None:
            torch.save(whole.state_dict(), root / "groups.pt")
        return {"step_accuracy": step_accuracy}

    def predict() -> Any:
        module, run = fit_classifier(2, "plain", steps=1)
        predictions = run.predict(module, DataLoader(class_data(), batch_size=16))
        first = predictions[0]  # type: ignore[index]
        return {
            "batch_idx": first["batch_idx"],
            "scale": first["scale"].tolist(),
            "tag": first["tag"],
            "out": list(first["out"].shape),
        }

    def two_optimizers() -> None:
        L.seed_everything(0, verbose=False)
        trainer(2).fit(Classifier("two"), DataLoader(class_data(), batch_size=16))

    def should_stop() -> int:
        L.seed_everything(0, verbose=False)
        module = Classifier("plain")
        module.stop_at = 1
        run = trainer(2, steps=10)
        run.fit(module, DataLoader(class_data(), batch_size=8))
        return run.global_step

    def save_on_rank_zero() -> float:
        module, run = fit_classifier(2, "plain", steps=1)
        started = time.monotonic()
        if run.is_global_zero:
            run.save_checkpoint(root / "rank0.ckpt")
        return time.monotonic() - started

    sections = {
        "token_mean": token_mean,
        "trimmed_token_mean": trimmed_token_mean,
        "metric_and_groups": metric_and_groups,
        "predict": predict,
        "two_optimizers": two_optimizers,
        "should_stop": should_stop,
        "save_on_rank_zero": save_on_rank_zero,
    }
    for name in chosen or list(sections):
        section(seen, name, sections[name])
    (root / f"rank-{rank}.json").write_text(json.dumps(seen))
