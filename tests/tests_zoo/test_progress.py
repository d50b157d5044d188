"""Progress lines for output that is not a terminal: what `make demo` and the zoo's command line print to a log file."""

from __future__ import annotations

import io
import re
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zoo.cli import main
from zoo.progress import LineProgress

REPO = Path(__file__).resolve().parents[2]


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as sys.stdout does on one."""

    def isatty(self) -> bool:
        return True


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = F.mse_loss(self.layers(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", F.mse_loss(self.layers(batch[0]), batch[1]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(tmp_path: Path, *callbacks: L.Callback) -> None:
    generator = torch.Generator().manual_seed(0)
    data = DataLoader(
        TensorDataset(torch.randn(24, 4, generator=generator), torch.randn(24, 1, generator=generator)), batch_size=8
    )
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=list(callbacks),
    )  # fmt: skip
    trainer.fit(Regressor(), data, data)


def test_a_line_per_epoch_with_its_time_steps_and_metrics_when_not_a_terminal(tmp_path: Path) -> None:
    # C8 of issue 29: with output redirected, the progress bar printed nothing for minutes of `make demo`.
    redirected = io.StringIO()
    fit(tmp_path, LineProgress(stream=redirected))
    lines = redirected.getvalue().splitlines()
    assert len(lines) == 2, lines
    for epoch, line in enumerate(lines, start=1):
        assert re.fullmatch(
            rf"epoch {epoch}/2 of Regressor: \d+ s, 3 steps; train_loss [\d.e-]+, val_loss [\d.e-]+", line
        )


def test_nothing_on_a_terminal_unless_asked(tmp_path: Path) -> None:
    terminal, asked = Terminal(), Terminal()
    fit(tmp_path, LineProgress(stream=terminal), LineProgress(always=True, stream=asked))
    assert terminal.getvalue() == ""
    assert len(asked.getvalue().splitlines()) == 2


def test_the_zoo_command_line_adds_the_progress_lines() -> None:
    cli = main(["--config", str(REPO / "configs/amoebanet/pretrain_embedded.yaml")], run=False)
    assert any(isinstance(callback, LineProgress) for callback in cli.trainer.callbacks)
