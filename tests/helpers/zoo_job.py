"""Train every zoo model's tiny configuration for a few steps, as one process per rank.

``python -m helpers.jobs helpers.zoo_job OUT STEPS NAME:CHUNKS...``: for each model, seed, build, fit ``STEPS`` steps on
one repeated tiny batch with ``strategy="gpipe"`` (K = 2, M = CHUNKS), then rank 0 saves the whole trained state dict to
``OUT/NAME.pt`` and a full checkpoint to ``OUT/NAME.ckpt`` (for the fine-tuning tests). ``NAME:CHUNKS:SCHEDULE`` runs
that schedule and saves ``OUT/NAME-SCHEDULE.pt``. ``NAME`` is a registered zoo model, or ``hf_causal_lm``
(``hf_causal_lm_lora``: with LoRA adapters; ``hf_causal_lm_packed``: on packed sequences, :func:`packed_batch`): the
Hugging Face language model saved in ``OUT/hf_causal_lm-source`` with a padded collator batch (:func:`causal_lm`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_gpipe
from benchmarks.trainer import quiet_trainer
from helpers.whole import whole_module
from helpers.zoo_tiny import tiny_batch, tiny_model


class Repeated(Dataset):
    """The same batch every step, served one sample at a time."""

    def __init__(self, batch: Any, steps: int) -> None:
        self.batch, self.steps = batch, steps

    def __len__(self) -> int:
        return _size(self.batch) * self.steps

    def __getitem__(self, index: int) -> Any:
        size = len(self) // self.steps
        if isinstance(self.batch, tuple):
            return tuple(part[index % size] for part in self.batch)
        if isinstance(self.batch, dict):
            return {key: part[index % size] for key, part in self.batch.items()}
        return self.batch[index % size]


def _size(batch: Any) -> int:
    if isinstance(batch, tuple):
        return len(batch[0])
    if isinstance(batch, dict):
        return len(next(iter(batch.values())))
    return len(batch)


CAUSAL_LM = "hf_causal_lm"
CAUSAL_LM_LORA = "hf_causal_lm_lora"  # the same model with LoRA adapters of rank 4 on every linear layer
CAUSAL_LM_PACKED = "hf_causal_lm_packed"  # the same model on a batch of packed sequences (packed_batch)


def causal_lm(
    root: Path, lora: bool = False, name: str = CAUSAL_LM
) -> tuple[L.LightningModule, dict[str, torch.Tensor]]:
    """The tiny language model saved in ``root/NAME-source`` (``hf_causal_lm-source``) and a batch as Hugging Face's
    collators make it: rows of 4 to 10 tokens right-padded to 10, labels -100 at the padding and at each row's first two
    (prompt) tokens, so that the micro-batches learn different numbers of tokens."""
    import zoo

    adapters = {"lora": {"r": 4, "lora_alpha": 8}} if lora else {}
    model = zoo.load_pretrained(root / f"{name}-source", lr=1e-2, **adapters)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 96, (8, 10), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate([10, 4, 7, 10, 5, 9, 6, 8]):
        mask[row, :length] = 1
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :2] = -100
    return model, {"input_ids": ids, "attention_mask": mask, "labels": labels}


def packed_batch() -> dict[str, torch.Tensor]:
    """Two rows of packed sequences as ``DataCollatorWithFlattening`` makes each (``input_ids``, ``labels`` -100 at
    each sequence's first token, ``position_ids`` restarting at 0; no ``attention_mask``), sequences of 3, 5 and 2
    tokens in one row and 4 and 6 in the other, so that each micro-batch of a K = 2, M = 2 step is one row."""
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening()
    generator = torch.Generator().manual_seed(2)
    rows = [
        collator([{"input_ids": torch.randint(3, 96, (length,), generator=generator).tolist()} for length in lengths])
        for lengths in ([3, 5, 2], [4, 6])
    ]
    return {key: torch.cat([row[key] for row in rows]) for key in rows[0]}


def train_on_repeats(
    model: L.LightningModule, batch: Any, strategy: Any, devices: int, root: Path, steps: int
) -> L.Trainer:
    """``steps`` steps of ``model`` on ``batch``, served again each step, on CPU with no validation, logger or bar."""
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        default_root_dir=str(root),
        use_distributed_sampler=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(Repeated(batch, steps), batch_size=_size(batch)))
    return trainer


def fit(name: str, steps: int, strategy: Any, devices: int, root: Path) -> L.LightningModule:
    L.seed_everything(0, verbose=False)
    if name in (CAUSAL_LM, CAUSAL_LM_LORA, CAUSAL_LM_PACKED):
        model, batch = causal_lm(root, lora=name == CAUSAL_LM_LORA)
        batch = packed_batch() if name == CAUSAL_LM_PACKED else batch
    else:
        model, batch = tiny_model(name), tiny_batch(name)
    trainer = train_on_repeats(model, batch, strategy, devices, root, steps)
    trainer.save_checkpoint(root / f"{name}.ckpt")  # a collective: every rank takes part, rank 0 writes
    return model


PROMPT_LENGTHS = [6, 3, 5, 6]  # four prompts, left-padded to 6 tokens


def prompts() -> dict[str, torch.Tensor]:
    """Left-padded prompts for the language model's predictions."""
    ids = torch.randint(3, 96, (4, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros_like(ids)
    for row, length in enumerate(PROMPT_LENGTHS):
        mask[row, 6 - length :] = 1
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


GENERATION = {
    "greedy": {"max_new_tokens": 6},
    "sampled": {"max_new_tokens": 6, "do_sample": True, "top_k": 8, "seed": 1},
}


def predict_causal_lm(model: L.LightningModule, root: Path) -> dict[str, Any]:
    """The trained language model's greedy and sampled continuations of :func:`prompts`, generated in predict steps
    under GPipeStrategy (K = 2, M = 2: the stages decode two micro-batches in flight, each keeping its caches), and,
    under ``"validation"``, the sampled ones a ``validation_step`` generated (on the last stage, the only one that
    runs past the decoding call; an empty list elsewhere)."""
    out: dict[str, Any] = {}
    batch = prompts()
    loader = DataLoader(Repeated(batch, 1), batch_size=len(batch["input_ids"]))

    def trainer() -> L.Trainer:
        return L.Trainer(
            accelerator="cpu", devices=2, strategy=lightning_gpipe.GPipeStrategy(pipe_size=2, chunks=2), logger=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root),
        )  # fmt: skip

    for kind, settings in GENERATION.items():
        model.hparams["generation"] = settings
        (out[kind],) = trainer().predict(model, loader)
    generated: list[torch.Tensor] = []

    def validation_step(batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        generated.append(model.generate(batch["input_ids"], batch["attention_mask"], **GENERATION["sampled"]))

    model.validation_step = validation_step  # type: ignore[method-assign]
    trainer().validate(model, loader, verbose=False)
    out["validation"] = generated
    return out


def main(out: str, steps: str, *runs: str) -> None:
    root = Path(out)
    for run in runs:
        name, chunks, *schedule = run.split(":")
        options = {"schedule": schedule[0]} if schedule else {}
        strategy = lightning_gpipe.GPipeStrategy(pipe_size=2, chunks=int(chunks), deferred_batch_norm=True, **options)
        model = fit(name, int(steps), strategy, 2, root)
        if whole_module(model) is not None:  # later Trainers cut the module again
            torch.save(model.state_dict(), root / f"{'-'.join([name, *schedule])}.pt")
        if name == CAUSAL_LM and not schedule:
            predictions = predict_causal_lm(model, root)
            validation = predictions.pop("validation")
            if model.global_rank == 0:
                torch.save(predictions, root / f"{name}-predictions.pt")
            if validation:  # the last stage's
                torch.save(validation, root / f"{name}-validation.pt")
