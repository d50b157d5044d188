"""The zoo's command line: Lightning's CLI over every zoo model and data module, with ``strategy: gpipe`` available.

Run ``python -m zoo fit --config configs/amoebanet/pretrain_embedded.yaml``; every argument of the Trainer, the model
(``model.class_path: zoo.AmoebaNetD`` and its ``init_args``) and the data module can be set in YAML or on the command
line (``--model.init_args.num_filters 32``). ``python -m zoo fit --help`` lists them.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.cli import LightningCLI

import lightning_gpipe  # noqa: F401  (registers strategy="gpipe")
import zoo  # noqa: F401  (registers the models)
import zoo.data  # noqa: F401  (makes the data modules importable by class path)
from zoo.progress import LineProgress
from zoo.tasks.base import ZooModule

__all__ = ["main"]


def main(args: list[str] | None = None, *, run: bool = True) -> LightningCLI:
    """Parse ``args`` (default: ``sys.argv``) and run the subcommand, as ``python -m zoo`` does."""
    options: dict[str, Any] = {"overwrite": True}
    # A line per epoch when the output is a file or a pipe, where the progress bar prints nothing useful.
    persistent: dict[str, Any] = {"callbacks": [LineProgress()]}
    return LightningCLI(
        ZooModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs=options,
        trainer_defaults=persistent,
        args=args,
        run=run,
    )
