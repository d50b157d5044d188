"""A zoo language model given a batch it refuses, under GPipeStrategy (K = 2), as one process per rank.

``python -m helpers.jobs helpers.causal_lm_refusal_job OUT SOURCE CASE``: ``SOURCE`` is a tiny GPT-2 (128 learned
positions) saved by the test, ``CASE`` is ``too_long`` (200 tokens) or ``not_a_mapping`` (a list batch). Each rank
writes the error its ``fit`` raised, ``TYPE: message``, to ``OUT/CASE-rank-N.txt``, so the test reads what every rank
said.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

import lightning_gpipe
import zoo
from benchmarks.trainer import quiet_trainer


def batch(case: str) -> Any:
    ids = torch.randint(3, 90, (4, 200 if case == "too_long" else 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids} if case == "too_long" else [ids, torch.ones_like(ids)]


def main(out: str, source: str, case: str) -> None:
    root = Path(out)
    model = zoo.load_pretrained(source)
    trainer = quiet_trainer(
        accelerator="cpu", devices=2, strategy=lightning_gpipe.GPipeStrategy(pipe_size=2, chunks=2), max_steps=1,
        use_distributed_sampler=False, default_root_dir=str(root),
    )  # fmt: skip
    try:
        trainer.fit(model, DataLoader([batch(case)], batch_size=None))
    except Exception as error:  # noqa: BLE001 - what each rank raised is the result
        said = f"{type(error).__name__}: {error}"
    else:
        said = "no error"
    (root / f"{case}-rank-{trainer.global_rank}.txt").write_text(said, encoding="utf-8")
