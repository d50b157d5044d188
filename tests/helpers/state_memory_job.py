"""Each rank's resident memory at the end of fit, gathering the module, saving and resuming: it holds its own stage.

``python -m helpers.jobs helpers.state_memory_job OUT [fsdp]`` (two ranks; with ``fsdp``, four: two replicas of each
stage, each holding half of it, ``data_parallel="fsdp"``) trains a 64 MiB MLP with Adam at K = 2 (each rank half of
it) and measures, per rank, how much its peak resident memory (``VmHWM``, reset through
``/proc/self/clear_refs``) rises: at teardown, in ``gather_module``, saving a full file and a sharded directory after
the first step, and resuming each; global rank 0 also saves the same model with plain Lightning in one process. Each
rank writes ``memory-rankR.json``: ``{"whole": bytes of the weights, "file": bytes of the full checkpoint, ...rises}``.
The user-trial repros ``teardown_gathers_whole_model.py`` and ``checkpoint_host_memory.py``, scaled down.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.strategy_memory.measure import pin_mmap_threshold, reset_peak, resident
from lightning_gpipe import GPipeStrategy

WIDTH, DEPTH = 1024, 16  # 16 x 4 MiB of float32 weights; Adam adds two moments


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class Rises(L.Callback):
    """Peaks at teardown (after ``on_train_end``), while saving after the first step, and while resuming."""

    def __init__(self, save: Path | None = None) -> None:
        self.save = save
        self.rises: dict[str, int] = {}
        self._start = 0

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._start = reset_peak()

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        self.rises.setdefault("resume", resident()[1] - self._start)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if self.save is not None and "save" not in self.rises:
            start = reset_peak()
            trainer.save_checkpoint(self.save)
            self.rises["save"] = resident()[1] - start

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._start = reset_peak()

    def teardown_rise(self) -> int:
        return resident()[1] - self._start


def fit(strategy: Any, devices: int, steps: int, rises: Rises, resume: Path | None = None) -> L.LightningModule:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, WIDTH, generator=generator), torch.randn(8, WIDTH, generator=generator))
    torch.manual_seed(0)
    module = Net()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps, logger=False, callbacks=[rises],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=4), ckpt_path=resume)
    return module


def main(out: str, data_parallel: str = "ddp") -> None:
    torch.set_num_threads(1)
    root, rank = Path(out), int(os.environ.get("LOCAL_RANK", "0"))
    seen: dict[str, Any] = {"whole": DEPTH * (WIDTH + 1) * WIDTH * 4}
    devices = 4 if data_parallel == "fsdp" else 2
    if data_parallel == "fsdp":
        pin_mmap_threshold()  # freed tensors leave the RSS: an allocation cannot hide in memory a fit before freed

    def strategy(kind: str) -> GPipeStrategy:
        return GPipeStrategy(pipe_size=2, chunks=2, state_dict_type=kind, data_parallel=data_parallel)  # type: ignore[arg-type]

    for kind in ("full", "sharded"):
        path = root / f"{kind}.ckpt"
        saving = Rises(save=path)
        module = fit(strategy(kind), devices, 1, saving)
        seen[f"{kind}_save"] = saving.rises["save"]
        if kind == "full":
            seen["teardown"] = saving.teardown_rise()
            start = reset_peak()
            module.trainer.strategy.gather_module()  # type: ignore[attr-defined]
            seen["gather"] = resident()[1] - start
        resuming = Rises()
        fit(strategy(kind), devices, 2, resuming, resume=path)
        seen[f"{kind}_resume"] = resuming.rises["resume"]
    seen["file"] = (root / "full.ckpt").stat().st_size
    if rank == 0 and data_parallel == "ddp":
        plain = Rises(save=root / "plain.ckpt")
        fit("auto", 1, 1, plain)
        seen["plain_save"] = plain.rises["save"]
    (root / f"memory-rank{rank}.json").write_text(json.dumps(seen))
