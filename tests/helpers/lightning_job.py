"""A training job run as one process per rank (like Lightning's launcher or torchrun) by the strategy tests.

``python -m helpers.jobs helpers.lightning_job CONFIG.json`` runs every fit described in the config and writes what rank
0 sees (the whole model's state dict after each fit, logged metrics) next to the config.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gpipe
from helpers.models import IN, OUT, build
from helpers.stream_order import impose_stream_order
from helpers.whole import whole_module
from lightning_gpipe.engine.transport import ProcessGroupTransport
from lightning_gpipe.plan import AutoPlan

SAMPLES, BATCH = 64, 16


def dataset(samples: int = SAMPLES) -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(samples, IN, generator=generator), torch.randn(samples, OUT, generator=generator))


class SequentialModule(L.LightningModule):
    """A plain LightningModule: its layers in one nn.Sequential, an ordinary training_step."""

    def __init__(self, model: str = "mlp", batch_norm: bool = False, meta: bool = False) -> None:
        super().__init__()
        self.model_name = model
        self.local_parameters = 0
        if meta:  # built in configure_model, where GPipeStrategy allocates only this rank's stage
            self.layers: nn.Module | None = None
            return
        torch.manual_seed(0)
        # One BatchNorm only: a second one would see inputs already normalized per micro-batch.
        self.layers = build(model) if not batch_norm else nn.Sequential(
            nn.Linear(IN, 12), nn.Tanh(), nn.Linear(12, 12), nn.BatchNorm1d(12), nn.Tanh(), nn.Linear(12, OUT)
        )  # fmt: skip

    def configure_model(self) -> None:
        if self.layers is None:
            self.layers = build(self.model_name)

    def on_train_start(self) -> None:
        self.local_parameters = sum(p.numel() for p in self.parameters())

    fail_rank: int | None = None  # a rank whose training_step raises on step 2 (fault tests)
    sync_dist = False  # all-reduce the logged loss in training_step, between the forwards and the backwards

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == self.fail_rank and self.global_step == 2:
            raise RuntimeError(f"deliberate failure on rank {self.global_rank}")
        x, y = batch
        loss = F.mse_loss(self.layers(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=self.sync_dist)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self.layers(x), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layers(batch[0])

    trainable_only = False  # build the optimizer from trainable parameters only, as fine-tuning code does

    def configure_optimizers(self) -> torch.optim.Optimizer:
        parameters = [p for p in self.parameters() if p.requires_grad or not self.trainable_only]
        return torch.optim.SGD(parameters, lr=0.05, momentum=0.9)


class _LinksOnWorld(lightning_gpipe.GPipeStrategy):
    """The strategy with every point-to-point message on the world group: the wiring that NCCL's stream order
    deadlocks, kept for the regression test (``"links_on_world": true``)."""

    def _new_groups(self) -> None:
        super()._new_groups()
        # links=None: ProcessGroupTransport.for_stages then sends on the world group
        self._groups = self._stage_groups()._replace(links=None)  # type: ignore[arg-type]


def trainer_for(run: dict[str, Any], root: Path, **overrides: Any) -> L.Trainer:
    strategy: Any = "auto"
    if run.get("strategy", "gpipe") == "gpipe":
        gpipe = _LinksOnWorld if run.get("links_on_world", False) else lightning_gpipe.GPipeStrategy
        strategy = gpipe(
            pipe_size=run.get("pipe_size"),
            chunks=run.get("chunks"),
            checkpoint=run.get("checkpoint", "except_last"),
            deferred_batch_norm=run.get("deferred_batch_norm", False),
            balance=run.get("balance"),
            plan=AutoPlan(**run["plan"]) if "plan" in run else None,  # AutoPlan's arguments, e.g. a budget
            # further GPipeStrategy arguments, e.g. {"detect_anomalies": true}; a top-level "schedule" is a plan's
            **{
                "schedule": run.get("schedule", "gpipe"),
                "virtual_stages": run.get("virtual_stages", 1),
                **run.get("options", {}),
            },
        )
    elif run["strategy"] == "ddp":
        strategy = "ddp"
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": run.get("devices", 1),
        "strategy": strategy,
        "max_steps": run.get("steps", 3),
        "max_epochs": run.get("epochs"),
        "logger": run.get("logger", False),  # true: Lightning's default, TensorBoardLogger (tensorboard is locked)
        "log_every_n_steps": run.get("log_every_n_steps", 50),
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(root),
        "accumulate_grad_batches": run.get("accumulate", 1),
        "gradient_clip_val": run.get("clip"),
        "use_distributed_sampler": run.get("distributed_sampler", False),
        "num_sanity_val_steps": 0,
        "limit_val_batches": run.get("limit_val_batches", 0),
        "val_check_interval": run.get("val_check_interval"),
    }
    options.update(overrides)
    return L.Trainer(**options)


@contextlib.contextmanager
def _posting_as_on_devices() -> Iterator[None]:
    """Stages post their receives when needed, as over NCCL (``Transport.posts_ahead``), not ahead as on CPU: with
    stream_order, the order in which a GPU job issues its operations."""
    original = ProcessGroupTransport.posts_ahead
    ProcessGroupTransport.posts_ahead = property(lambda self: False)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        ProcessGroupTransport.posts_ahead = original  # type: ignore[method-assign]


def fit(run: dict[str, Any], root: Path) -> SequentialModule:
    L.seed_everything(0, verbose=False)
    module = SequentialModule(run.get("model", "mlp"), run.get("batch_norm", False), run.get("meta", False))
    module.fail_rank = run.get("fail_rank")
    module.sync_dist = run.get("sync_dist", False)
    if "plan" in run:  # plan="auto" profiles the sequence on one batch of its input
        rows = run.get("batch", BATCH)
        module.example_input_array = torch.randn(rows, IN, generator=torch.Generator().manual_seed(1))
    if run.get("stream_order"):  # every process group runs its operations in issue order, as on NCCL
        impose_stream_order()
    if run.get("freeze_first"):  # a frozen backbone: its first layers, with an optimizer over the rest
        assert module.layers is not None
        module.layers[: run["freeze_first"]].requires_grad_(False)
        module.trainable_only = True
    trainer = trainer_for(run, root)
    loader = DataLoader(dataset(), batch_size=run.get("batch", BATCH), shuffle=run.get("shuffle", False))
    validation = loader if run.get("limit_val_batches") else None  # validation between steps, on the training data
    with _posting_as_on_devices() if run.get("post_when_needed") else contextlib.nullcontext():
        trainer.fit(module, loader, validation, ckpt_path=run.get("resume"))
    if run.get("save"):
        trainer.save_checkpoint(run["save"])
    return module


def main(config_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    root = Path(config_path).parent
    chosen: list[dict[str, Any]] = []  # the settings each fit ran with (what plan="auto" chose)
    for index, run in enumerate(config["runs"]):
        if "settings_of" in run:  # the settings an earlier fit's plan chose, given explicitly
            run = {key: value for key, value in run.items() if key != "settings_of"} | chosen[run["settings_of"]]
        module = fit(run, root)
        settings = getattr(module.trainer.strategy, "settings", None)  # what GPipeStrategy resolved, plan included
        names = ("pipe_size", "chunks", "balance", "checkpoint", "schedule")
        chosen.append({name: getattr(settings, name) for name in names} if settings is not None else {})
        if settings is not None and settings.schedule == "interleaved":  # the one schedule that takes it
            chosen[-1]["virtual_stages"] = settings.pipeline.virtual_stages
        (root / f"local-parameters-{index}-rank{module.global_rank}.txt").write_text(str(module.local_parameters))
        whole = whole_module(module)
        if whole is not None:
            (root / f"settings-{index}.json").write_text(json.dumps(chosen[-1]))
            torch.save(whole.state_dict(), root / f"result-{index}.pt")
            logged = {key: value.detach().cpu() for key, value in module.trainer.callback_metrics.items()}
            torch.save(logged, root / f"metrics-{index}.pt")
