"""Failures end cleanly: a failing stage never hangs its peers, and a failed checkpoint write loses nothing."""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from helpers.distributed import loopback_store
from helpers.models import batch, cells, loss_fn, mlp
from torch import nn

from lightning_gpipe import GPipeStrategy, PipelineError
from lightning_gpipe.pipeline import run_in_threads


class Explode(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("layer exploded")


@pytest.mark.parametrize("where", [0, 1, 3])
def test_a_failing_stage_stops_every_thread_stage_with_its_own_error(where: int) -> None:
    stages = cells(mlp(), [2, 2, 2, 2])
    stages[where] = nn.Sequential(Explode())
    start = time.monotonic()
    with pytest.raises(ValueError, match="layer exploded"):
        run_in_threads(stages, batch(), loss_fn, chunks=4, timeout=60)
    assert time.monotonic() - start < 10  # the others were told, not left to time out


def test_a_silent_peer_times_out_with_the_stage_named() -> None:
    class Stall(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(3)
            return x

    with pytest.raises(PipelineError, match=r"\[pipeline stage 1\] receiving .* from stage 0 failed: timed out"):
        run_in_threads([nn.Sequential(Stall()), nn.Sequential(nn.Linear(6, 3))], batch(), loss_fn, chunks=2, timeout=1)


def test_a_failed_checkpoint_write_leaves_the_previous_one_intact(tmp_path: Path) -> None:
    strategy = GPipeStrategy()
    path = tmp_path / "last.ckpt"
    strategy.save_checkpoint({"step": 1}, path)
    with pytest.raises(Exception, match="pickle"):
        strategy.save_checkpoint({"step": 2, "unpicklable": lambda: None}, path)
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left behind


class Manual(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(2, 2))
        self.automatic_optimization = False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.layers(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture
def single_process_group(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    # The Trainer's process group gets its store from this process, on 127.0.0.1 (see helpers.distributed).
    with loopback_store() as env:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        yield
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.usefixtures("single_process_group")
def test_manual_optimization_is_refused_before_training() -> None:
    trainer = L.Trainer(
        strategy=GPipeStrategy(pipe_size=1), accelerator="cpu", devices=1, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match="supports automatic optimization only"):
        trainer.fit(Manual(), torch.utils.data.DataLoader(torch.randn(4, 2), batch_size=2))
