"""After ``fit`` each rank keeps its stage: later calls of the Trainer reuse it, ``gather_module`` puts the whole back.

``python -m helpers.jobs helpers.kept_stages_job OUT [fsdp]`` (two ranks; with ``fsdp``, four: two replicas of each
stage sharding it, ``data_parallel="fsdp"``) fits the strategy tests' MLP at K = 2, then with the same Trainer
validates, predicts and fits on, gathers the module on global rank 0, validates again (the module cut
anew) and gathers again. Each rank writes ``rank-R.json``: what its module held after each call and the values
returned; global rank 0 also writes the gathered module's state dicts (``whole.pt``, ``whole-again.pt``).
:func:`calls` runs the same sequence under any strategy (the test runs it in plain Lightning).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from helpers.lightning_job import SequentialModule, dataset, trainer_for
from helpers.whole import whole_module

FIRST_STEPS, SECOND_STEPS = 3, 6


def held(module: L.LightningModule) -> dict[str, Any]:
    """What the module holds on this rank: the class of its sequence and how many of its parameters hold weights."""
    real = [p for p in module.parameters() if not p.is_meta]
    return {"sequence": type(module.layers).__name__, "parameters": sum(p.numel() for p in real)}


def calls(run: dict[str, Any], root: Path) -> dict[str, Any]:
    """The sequence of calls; returns what it saw, and the gathered state dicts on global rank 0 (else ``None``)."""
    L.seed_everything(0, verbose=False)
    module = SequentialModule()
    trainer = trainer_for({**run, "steps": FIRST_STEPS}, root)
    loader = DataLoader(dataset(), batch_size=16)
    trainer.fit(module, loader)
    seen: dict[str, Any] = {"after_fit": held(module)}
    seen["validate"] = trainer.validate(module, loader, verbose=False)[0]["val_loss"]
    seen["predict"] = float(torch.cat(trainer.predict(module, loader)).sum())  # type: ignore[arg-type]
    seen["after_predict"] = held(module)
    trainer.fit_loop.epoch_loop.max_steps = SECOND_STEPS  # a further fit of the same Trainer trains on
    trainer.fit(module, loader)
    seen["after_second_fit"] = held(module)
    whole = whole_module(module)
    seen["whole"] = None if whole is None else {k: v.clone() for k, v in whole.state_dict().items()}
    seen["after_gather"] = held(module)
    seen["validate_after_gather"] = trainer.validate(module, loader, verbose=False)[0]["val_loss"]
    seen["after_validate_after_gather"] = held(module)
    again = whole_module(module)
    seen["whole_again"] = None if again is None else again.state_dict()
    return seen


def main(out: str, data_parallel: str = "ddp") -> None:
    root = Path(out)
    devices = 4 if data_parallel == "fsdp" else 2
    run = {"pipe_size": 2, "devices": devices, "chunks": 4, "limit_val_batches": 2}
    seen = calls({**run, "options": {"data_parallel": data_parallel}}, root)
    for name in ("whole", "whole_again"):
        state = seen.pop(name)
        if state is not None:
            torch.save(state, root / f"{name.replace('_', '-')}.pt")
    (root / f"rank-{os.environ.get('LOCAL_RANK', '0')}.json").write_text(json.dumps(seen))
