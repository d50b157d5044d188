"""Checkpoints on real files: a pipeline trained with Adam and a learning-rate schedule, saved, resumed, or refused.

``python -m helpers.jobs helpers.checkpoint_job CONFIG.json`` runs every run of the config in turn, each a new module
and Trainer, in the same processes. A run is a dict:

- ``pipe_size`` (``strategy: "auto"``: plain Lightning on one device instead), ``devices``, ``steps``, ``chunks``,
  ``schedule``, ``data_parallel``; ``model`` and ``groups``: see :class:`AdamModule`; ``samples``: the dataset's
  size (64; 32 makes an epoch of two steps, so that a checkpoint after two resumes where an uninterrupted run goes on);
- ``state_dict_type``: the strategy's checkpoint format; ``save``: a path ``trainer.save_checkpoint`` writes after fit;
- ``resume``: ``fit(ckpt_path=...)``; ``checkpoints``: a folder where ``ModelCheckpoint`` keeps the best checkpoint by
  ``train_loss`` and ``last.ckpt``, every step;
- ``expect_error``: the run must fail on every rank: ``error-N-rankR.txt`` gets the message, and the job goes on.

On global rank 0 a run that succeeds writes the whole trained module's state dict (``result-N.pt``, gathered with
``gather_module``) and the learning rate and step it ended at (``seen-N.json``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

import lightning_gpipe
from helpers.lightning_job import SAMPLES, dataset
from helpers.models import IN, OUT, build
from helpers.whole import whole_module

BATCH = 16


def wide() -> nn.Sequential:
    """The 8-layer MLP with wider hidden layers: the same names, other shapes."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16),
        nn.Linear(16, OUT),
    )  # fmt: skip


class AdamModule(L.LightningModule):
    """The 8-layer MLP of the strategy tests, trained by Adam with a learning rate halved every step.

    ``model``: ``"mlp"`` or another of :data:`helpers.models.MODELS`, or ``"wide"``; ``groups=2`` gives the optimizer
    two parameter groups (the last layer apart).
    """

    def __init__(self, model: str = "mlp", groups: int = 1) -> None:
        super().__init__()
        self.layers = wide() if model == "wide" else build(model)
        self.groups = groups

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.layers(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        last = list(self.layers[-1].parameters())
        rest = [p for p in self.parameters() if all(p is not q for q in last)]
        groups = [{"params": rest}, {"params": last}] if self.groups == 2 else [{"params": list(self.parameters())}]
        optimizer = torch.optim.Adam(groups, lr=0.01)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def trainer_for(run: dict[str, Any], root: Path, callbacks: list[Callback]) -> L.Trainer:
    strategy: Any = "auto"
    if run.get("strategy", "gpipe") == "gpipe":
        strategy = lightning_gpipe.GPipeStrategy(
            pipe_size=run["pipe_size"], chunks=run.get("chunks", 4), schedule=run.get("schedule", "gpipe"),
            state_dict_type=run.get("state_dict_type", "full"), data_parallel=run.get("data_parallel", "ddp"),
        )  # fmt: skip
    return L.Trainer(
        accelerator="cpu", devices=run.get("devices", 1), strategy=strategy, max_steps=run["steps"], logger=False,
        enable_checkpointing=bool(callbacks), callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(root), use_distributed_sampler=False,
    )  # fmt: skip


def fit(run: dict[str, Any], root: Path) -> tuple[AdamModule, L.Trainer]:
    L.seed_everything(0, verbose=False)
    module = AdamModule(run.get("model", "mlp"), run.get("groups", 1))
    callbacks: list[Callback] = []
    if run.get("checkpoints"):
        callbacks.append(
            ModelCheckpoint(dirpath=run["checkpoints"], monitor="train_loss", save_top_k=1, save_last=True,
                            every_n_train_steps=1)
        )  # fmt: skip
    trainer = trainer_for(run, root, callbacks)
    trainer.fit(module, DataLoader(dataset(run.get("samples", SAMPLES)), batch_size=BATCH), ckpt_path=run.get("resume"))
    if run.get("save"):
        trainer.save_checkpoint(run["save"])
    return module, trainer


def main(config_path: str) -> None:
    root = Path(config_path).parent
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    for index, run in enumerate(json.loads(Path(config_path).read_text())["runs"]):
        try:
            module, trainer = fit(run, root)
        except Exception as error:
            if not run.get("expect_error"):
                raise
            (root / f"error-{index}-rank{rank}.txt").write_text(f"{type(error).__name__}: {error}")
            continue
        whole = whole_module(module)
        if whole is not None:
            torch.save(whole.state_dict(), root / f"result-{index}.pt")
            seen = {"lr": trainer.optimizers[0].param_groups[0]["lr"], "step": trainer.global_step}
            (root / f"seen-{index}.json").write_text(json.dumps(seen))
