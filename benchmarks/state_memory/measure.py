"""One rank of the benchmark: its resident memory's rises and its times through load and setup, the first step, a save
and a resume, under ``GPipeStrategy(pipe_size=K, state_dict_type=...)``.

``python -m benchmarks.state_memory.measure SOURCE SIZE KIND K OUT`` on each of K ranks (``tools.launch.run_job``):
``zoo.load_pretrained(SOURCE)``, one training step with the model's AdamW, ``trainer.save_checkpoint`` after it, then a
new model and Trainer resuming the checkpoint. Each rise is the growth of the peak resident memory (``VmHWM``, reset
through ``/proc/self/clear_refs`` at the phase's start) over the resident memory at that start. Writes
``OUT/K{K}-{KIND}-rank{R}.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch

import zoo
import zoo.tasks.causal_lm  # noqa: F401  (imported before the first measure: transformers and peft are not the model)
from benchmarks.state_memory.model import SIZES, loader
from benchmarks.strategy_memory.measure import reset_peak, resident
from lightning_gpipe import GPipeStrategy

__all__ = ["main"]


class Phases(L.Callback):
    """Rises and times of the phases of one fit: from ``start`` to the end of setup, the first step, a save after it
    (with ``save``), or the resume before the first step (without)."""

    def __init__(self, start: int, save: Path | None) -> None:
        self.save = save
        self.rises: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.stage_parameters = 0
        self._start, self._clock = start, 0.0

    def _phase(self, name: str) -> None:
        self.rises[name] = resident()[1] - self._start
        self.seconds[name] = time.perf_counter() - self._clock
        self._start, self._clock = reset_peak(), time.perf_counter()

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        # After setup: the module is this rank's stage. Unique parameters, as the optimizer holds them.
        self.stage_parameters = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
        self._phase("load_setup")

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.save is None and "resume" not in self.rises:
            self._phase("resume")

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.save is not None and "save" not in self.rises:
            self._phase("first_step")
            trainer.save_checkpoint(self.save)
            self._phase("save")


def _fit(source: str, size: str, kind: str, pipe_size: int, phases: Phases, steps: int, resume: Path | None) -> int:
    """Load and fit; returns the whole model's parameter count."""
    model = zoo.load_pretrained(source)
    whole = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    trainer = L.Trainer(
        strategy=GPipeStrategy(pipe_size=pipe_size, chunks=2 * pipe_size, state_dict_type=kind), accelerator="cpu",
        devices=pipe_size, max_steps=steps, logger=False, callbacks=[phases], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
        limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(model, loader(SIZES[size], steps), ckpt_path=resume)
    return whole


def main(argv: Sequence[str]) -> None:
    source, size, kind, pipe_size, out = argv[0], argv[1], argv[2], int(argv[3]), Path(argv[4])
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    path = out / f"K{pipe_size}-{kind}.ckpt"
    training = Phases(reset_peak(), save=path)
    training._clock = time.perf_counter()
    whole = _fit(source, size, kind, pipe_size, training, 1, None)
    resuming = Phases(reset_peak(), save=None)
    _fit(source, size, kind, pipe_size, resuming, 2, path)
    result = {
        "rank": rank,
        "whole_parameters": whole,
        "stage_parameters": training.stage_parameters,
        "rises": {**training.rises, "resume": resuming.rises["resume"]},
        "seconds": {**training.seconds, "resume": resuming.seconds["resume"]},
    }
    (out / f"K{pipe_size}-{kind}-rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
