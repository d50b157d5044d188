"""Progress as plain lines, for output that is not a terminal (a log file, a pipe, a CI job)."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["LineProgress"]


class LineProgress(Callback):
    """A line per training epoch on global rank 0: the time it took and the epoch's logged scalars.

    Lightning's progress bars draw on a terminal; redirected to a file, the rich bar prints nothing and tqdm's carriage
    returns pile up, so a long run looks hung. By default the lines are written only when ``stream`` is not a
    terminal, so the callback can be added to every run::

        epoch 1/4 of AmoebaNetD: 61 s, 47 steps; train_loss 1.52, val_acc 0.41, val_loss 1.38

    Args:
        always: write the lines on a terminal too.
        stream: where to write; ``sys.stdout`` (as it is when a line is written) by default.
    """

    def __init__(self, always: bool = False, stream: TextIO | None = None) -> None:
        self.always = always
        self.stream = stream
        self._started = 0.0
        self._first_step = 0

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._started = time.perf_counter()
        self._first_step = trainer.global_step

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        stream = self.stream if self.stream is not None else sys.stdout
        if not trainer.is_global_zero or not (self.always or not stream.isatty()):
            return
        epochs = f"/{trainer.max_epochs}" if trainer.max_epochs is not None and trainer.max_epochs > 0 else ""
        steps = trainer.global_step - self._first_step
        took = f"{time.perf_counter() - self._started:.0f} s, {steps} step{'s' if steps != 1 else ''}"
        metrics = _scalars(trainer.callback_metrics)
        shown = "; " + ", ".join(f"{name} {value:.4g}" for name, value in metrics.items()) if metrics else ""
        # Flushed: redirected output is block-buffered, and a line that waits for the buffer to fill shows nothing.
        print(
            f"epoch {trainer.current_epoch + 1}{epochs} of {type(pl_module).__name__}: {took}{shown}",
            file=stream,
            flush=True,
        )


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The one-element values of ``metrics``, by name."""
    return {
        name: float(value)
        for name, value in sorted(metrics.items())
        if isinstance(value, int | float) or (isinstance(value, torch.Tensor) and value.numel() == 1)
    }
