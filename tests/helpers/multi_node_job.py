"""A training job on two "nodes" of one host, run by ``tests/tests_gpipe/test_multi_node.py``.

``python -m helpers.jobs helpers.multi_node_job CONFIG.json`` runs every fit of the config with
``Trainer(devices=2, num_nodes=2)`` in processes started as torchrun starts them
(:func:`tools.launch.run_job` with ``nodes=2``). Each rank writes what Lightning made of its environment (cluster
environment, node, local and global rank) and, under ``GPipeStrategy``, its place in the layout; rank 0 writes the
whole model's state dict after each fit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from helpers.lightning_job import SequentialModule, dataset, trainer_for
from helpers.whole import whole_module
from lightning_gpipe import GPipeStrategy


def seen_by(trainer: L.Trainer) -> dict[str, Any]:
    """What Lightning and the strategy made of this process's place in the job."""
    strategy = trainer.strategy
    seen: dict[str, Any] = {
        "environment": type(strategy.cluster_environment).__name__,  # type: ignore[attr-defined]
        "num_nodes": trainer.num_nodes,
        "node_rank": trainer.node_rank,
        "local_rank": trainer.local_rank,
        "global_rank": trainer.global_rank,
        "world_size": trainer.world_size,
    }
    if isinstance(strategy, GPipeStrategy):
        seen |= {"stage": strategy.layout.stage, "replica": strategy.layout.replica}
    return seen


def main(config_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    root = Path(config_path).parent
    for index, run in enumerate(config["runs"]):
        L.seed_everything(0, verbose=False)
        module = SequentialModule()
        trainer = trainer_for(run, root, num_nodes=run["num_nodes"])
        trainer.fit(module, DataLoader(dataset(), batch_size=run["batch"]))
        (root / f"seen-{index}-rank{trainer.global_rank}.json").write_text(json.dumps(seen_by(trainer)))
        whole = whole_module(module)
        if whole is not None:
            torch.save(whole.state_dict(), root / f"result-{index}.pt")
