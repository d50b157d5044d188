"""Each rank's resident memory through ``zoo.load_pretrained`` and a pipeline's setup, launched as users launch.

``python -m helpers.jobs helpers.load_job SOURCE OUT PIPE_SIZE``, started once (:func:`helpers.jobs.launch`): the
Trainer's launcher starts the other ranks, which run this script again. Each rank measures (VmRSS and VmHWM, as
``/proc/self/status`` reports them) its growth through ``zoo.load_pretrained(SOURCE)`` and from the Trainer's
``setup`` hook (process groups are up by then) to the start of training, then writes ``OUT/rank-N.json``:
``{"load": bytes, "setup": bytes, "growth": bytes, "read_at_load": [keys], "read": [keys], "held": [keys]}``,
``growth`` being the larger of the load's own peak and what the load kept plus the setup's peak, ``read`` the
state-dict keys this process read from the checkpoint (``read_at_load``: by the end of ``zoo.load_pretrained``) and
``held`` those of its stage. The module then trains one step, so that a broken stage cannot pass.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from benchmarks.strategy_memory.measure import reset_peak, resident
from benchmarks.trainer import quiet_trainer

__all__ = ["main"]


class SetupMemory(L.Callback):
    """The peak from the Trainer's ``setup`` hook (after the process groups) to the start of training, and the keys
    of the stage held then."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.before = resident()[0]
        reset_peak()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.peak = resident()[1]
        self.held = list(pl_module.state_dict())


def _recording_reads() -> list[str]:
    """The keys every :class:`~zoo.weights.CheckpointReader` of this process reads from now on."""
    from zoo.weights import CheckpointReader

    read: list[str] = []
    original = CheckpointReader.read_into

    def read_into(self: CheckpointReader, tensors: Any) -> None:
        read.extend(tensors)
        original(self, tensors)

    CheckpointReader.read_into = read_into  # type: ignore[method-assign]
    return read


def _batches(vocab: int) -> DataLoader:
    ids = torch.randint(3, vocab, (4, 16), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": row, "attention_mask": torch.ones_like(row)} for row in ids]
    return DataLoader(rows, batch_size=4)


def _import_model_code(source: str) -> None:
    """Import what loading ``source`` imports (tens of MiB of modules), so that only the model's memory is measured."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    import zoo.tasks.causal_lm  # noqa: F401

    MODEL_FOR_CAUSAL_LM_MAPPING[type(transformers.AutoConfig.from_pretrained(source))]


def main(source: str, out: str, pipe_size: str) -> None:
    import zoo
    from lightning_gpipe import GPipeStrategy

    torch.set_num_threads(1)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    _import_model_code(source)
    read = _recording_reads()
    before = resident()[0]
    reset_peak()
    model = zoo.load_pretrained(source)
    loaded, load_peak = resident()
    read_at_load = list(read)
    memory = SetupMemory()
    trainer = quiet_trainer(
        accelerator="cpu", devices=int(pipe_size), strategy=GPipeStrategy(pipe_size=int(pipe_size), chunks=1),
        max_steps=1, callbacks=[memory], use_distributed_sampler=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    vocab: Any = model.hparams["config"]["vocab_size"]
    trainer.fit(model, _batches(int(vocab)))
    setup = memory.peak - memory.before
    growth = max(load_peak - before, loaded - before + setup)
    record = {
        "load": load_peak - before, "setup": setup, "growth": growth, "read_at_load": read_at_load, "read": read,
        "held": memory.held,
    }  # fmt: skip
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank-{rank}.json").write_text(json.dumps(record))
