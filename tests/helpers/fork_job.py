"""The fork launcher: the launching process's own module holds the whole trained model after ``fit``.

``python -m helpers.jobs helpers.fork_job OUT [fsdp]``, run as one process: its Trainer forks two ranks (K = 2,
``start_method="fork"``, what ``strategy="gpipe_notebook"`` means; with ``fsdp``, four: two replicas of each stage
sharding it), and when ``fit`` returns the launching process saves its module's state dict to ``OUT/launched.pt``.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from helpers.lightning_job import SequentialModule, dataset, trainer_for

STEPS = 3


def main(out: str, data_parallel: str = "ddp") -> None:
    L.seed_everything(0, verbose=False)
    module = SequentialModule()
    options = {"start_method": "fork", "data_parallel": data_parallel}
    devices = 4 if data_parallel == "fsdp" else 2
    run = {"pipe_size": 2, "devices": devices, "chunks": 4, "steps": STEPS, "options": options}
    trainer_for(run, Path(out)).fit(module, DataLoader(dataset(), batch_size=16))
    torch.save(module.state_dict(), Path(out) / "launched.pt")
