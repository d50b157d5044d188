"""The getting-started page's GPT and U-Net (``examples/gpt_sequence.py``, ``examples/unet_sequence.py``) trained a few
steps, one process per rank.

``python -m helpers.jobs helpers.sequence_examples_job CONFIG.json`` fits each example named in the config under the
run's strategy and writes, from rank 0, the whole model's state dict after each fit (``result-NAME.pt``) and whether the
GPT's head is still tied to its embedding (``tied-NAME.json``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from helpers.lightning_job import trainer_for
from helpers.whole import whole_module

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import gpt_sequence  # noqa: E402
import unet_sequence  # noqa: E402

BATCH = 16


def build(name: str) -> L.LightningModule:
    """Example ``name`` ("gpt" or "unet") with its initial weights, the same in every process, trained with SGD.

    Not the examples' Adam: a gradient that is zero in exact arithmetic (the attention keys' bias, which softmax
    ignores) is rounding noise, different for every split of the batch, and Adam scales it up to a step of ``lr``.
    """
    example: type[L.LightningModule] = gpt_sequence.GPT if name == "gpt" else unet_sequence.Segmenter

    class WithSGD(example):  # type: ignore[valid-type,misc]
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    L.seed_everything(0, verbose=False)
    return WithSGD()


def fit(name: str, run: dict[str, Any], root: Path) -> L.LightningModule:
    """Fit example ``name`` with the example's own model and data."""
    module = build(name)
    example = gpt_sequence if name == "gpt" else unet_sequence
    loader = DataLoader(example.dataset(samples=4 * BATCH), batch_size=BATCH)
    trainer_for(run, root).fit(module, loader)
    return module


def main(config_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    root = Path(config_path).parent
    for name in config["examples"]:
        module = fit(name, config["run"], root)
        whole = whole_module(module)
        if whole is not None:
            torch.save(whole.state_dict(), root / f"result-{name}.pt")
            layers: Any = module.layers
            tied = layers[0].tokens.weight is layers[-1].projection.weight if name == "gpt" else None
            (root / f"tied-{name}.json").write_text(json.dumps({"tied": tied}))
