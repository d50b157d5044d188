"""One SGD step of the zoo's token-mean models on a padded batch, pipelined (K = 2, M = 4) or plain.

``python -m helpers.jobs tests_zoo.token_mean_job OUT TRANSLATOR_DIR SCHEDULE...`` runs, as one rank of a 2-process job,
one step of every model in :data:`MODELS` under each schedule, and rank 0 saves each trained state dict to
``OUT/NAME.SCHEDULE.pt``. The test imports :func:`fit` to take the same step in plain Lightning. The batch's rows hold
very different numbers of real target tokens, so each micro-batch's token mean has its own normalizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from helpers.whole import whole_module
from helpers.zoo_job import train_on_repeats
from helpers.zoo_tiny import tiny_batch, tiny_model

import lightning_gpipe
import zoo

MODELS = ("transformer", "transformer_lm", "hf_translation")
BATCH = 8
CHUNKS = 4
# Real target tokens per row: two long rows in the first micro-batch, one in the last, short ones in between.
LENGTHS = [5, 5, 1, 2, 1, 1, 2, 5]


def padded(tokens: torch.Tensor, pad_id: int, eos_id: int) -> torch.Tensor:
    """``tokens`` [B, 1 + T] (a start token, then T targets) right-padded so that row ``i`` keeps LENGTHS[i] targets."""
    out = tokens.clone()
    for row, length in enumerate(LENGTHS):
        out[row, length] = eos_id
        out[row, length + 1 :] = pad_id
    return out


def model_and_batch(name: str, translator: Path) -> tuple[zoo.ZooModule, Any]:
    """A tiny model (dropout off) and its padded batch; same weights on every call."""
    L.seed_everything(0, verbose=False)
    if name == "hf_translation":
        model = zoo.load_pretrained(translator, label_smoothing=0.1)
        generator = torch.Generator().manual_seed(0)
        source = torch.randint(4, 30, (BATCH, 6), generator=generator)
        target = torch.randint(4, 30, (BATCH, 7), generator=generator)
        target[:, 0] = model.decoder_start_id
        return model, (source, padded(target, model.pad_id, model.eos_id))
    model = tiny_model(name)
    if name == "transformer":
        source, target = tiny_batch(name, BATCH)
        return model, (source, padded(target, 0, 2))
    return model, padded(tiny_batch(name, BATCH), 0, 2)


def fit(name: str, translator: Path, strategy: Any, devices: int, root: Path) -> L.LightningModule:
    """One step of SGD at lr 1 (a parameter moves by its gradient) on the padded batch."""
    model, batch = model_and_batch(name, translator)
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=1.0)  # type: ignore[method-assign]
    train_on_repeats(model, batch, strategy, devices, root, steps=1)
    return model


def main(out: str, translator: str, *schedules: str) -> None:
    for schedule in schedules:
        for name in MODELS:
            strategy = lightning_gpipe.GPipeStrategy(pipe_size=2, chunks=CHUNKS, schedule=schedule)
            whole = whole_module(fit(name, Path(translator), strategy, 2, Path(out)))
            if whole is not None:
                torch.save(whole.state_dict(), Path(out) / f"{name}.{schedule}.pt")
