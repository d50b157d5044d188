"""Bad decoding calls under GPipeStrategy (K = 2): each must fail on every rank, with the same message, before any
stage starts.

``python -m helpers.jobs helpers.generation_job OUT``: tiny GPT-2 and Llama models are asked to predict with a prompt
longer than GPT-2's positions, ``max_new_tokens=0``, a sampling setting out of range, and more new tokens than the
caches could hold; after each failure the same ranks decode once more, correctly. Rank ``N`` writes ``OUT/rank-N.pt``:
each case's error type and message, and the last tokens.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

import lightning_gpipe
import zoo
from helpers.zoo_job import Repeated
from zoo.hf.causal_lm_tiny import save_tiny_causal_lm

FAMILIES = ("gpt2", "llama")
CASES: dict[str, tuple[str, dict[str, Any], int]] = {  # family, generation settings, prompt length
    "prompt_too_long": ("gpt2", {"max_new_tokens": 4}, 126),  # the prompt fits; with its new tokens it does not
    "no_new_tokens": ("llama", {"max_new_tokens": 0}, 6),
    "top_p_out_of_range": ("llama", {"max_new_tokens": 4, "do_sample": True, "top_p": 1.5}, 6),
    "caches_too_large": ("llama", {"max_new_tokens": 10**9}, 6),
}


def loader(length: int) -> DataLoader:
    ids = torch.randint(3, 96, (4, length), generator=torch.Generator().manual_seed(0))
    return DataLoader(Repeated({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 1), batch_size=4)


def predict(model: L.LightningModule, length: int, root: Path) -> torch.Tensor:
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=lightning_gpipe.GPipeStrategy(pipe_size=2, chunks=2), logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root),
    )  # fmt: skip
    (tokens,) = trainer.predict(model, loader(length))
    return tokens


def main(out: str) -> None:
    root = Path(out)
    rank = int(os.environ["RANK"])
    seen: dict[str, Any] = {}
    # Each rank writes its own copy (the same seed, the same weights): no rank waits for another's files.
    sources = {family: save_tiny_causal_lm(root / f"{family}-{rank}", family) for family in FAMILIES}
    for case, (family, settings, length) in CASES.items():
        model = zoo.load_pretrained(sources[family])  # a failed call leaves the model cut into its stages
        model.hparams["generation"] = settings
        try:
            predict(model, length, root)
            seen[case] = None
        except Exception as error:
            seen[case] = (type(error).__name__, str(error))
    model = zoo.load_pretrained(sources["llama"])
    model.hparams["generation"] = {"max_new_tokens": 4}
    seen["after"] = predict(model, 6, root)
    torch.save(seen, root / f"rank-{rank}.pt")
