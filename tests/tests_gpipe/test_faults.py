"""Failures end cleanly: a failing stage never hangs its peers, and a failed checkpoint write loses nothing."""

from __future__ import annotations

import datetime
import functools
import re
import time
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from helpers.models import batch, cells, loss_fn, mlp
from helpers.runif import RunIf
from torch import nn

from lightning_gpipe import GPipeStrategy, PipelineError
from lightning_gpipe.engine.gradients import WorldGradScaler
from lightning_gpipe.engine.pipeline import run_in_threads
from lightning_gpipe.engine.transport import ProcessGroupTransport
from tools.launch import run_processes


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


def _escaped(operation: Callable[[], object]) -> tuple[str, str, str]:
    """What ``operation`` raised (the test reads it, whatever it is): its type's name, message and cause."""
    try:
        operation()
    except Exception as error:
        return type(error).__name__, str(error), repr(error.__cause__)
    return "nothing", "", ""


def _against_a_dead_peer(rank: int, world_size: int) -> list[tuple[str, str, str]] | None:
    """Rank 0's transport operations after rank 1's process has ended: what each raised, its message and its cause."""
    transport = ProcessGroupTransport([0, 1], timeout=datetime.timedelta(seconds=60))
    if rank == 0:
        transport.send(torch.ones(4), 1, "activations of micro-batch 0")  # parked: the peer never posts its receive
    dist.barrier()
    if rank == 1:
        return None  # the process ends and its connections close, as a killed worker's do
    return [
        _escaped(lambda: transport.recv(torch.empty(4), 1, "gradients of micro-batch 0")),  # fails: the peer is gone
        _escaped(transport.wait_sends),  # the parked send, waited for at the end of the step
        _escaped(lambda: transport.send(torch.ones(4), 1, "gradients of micro-batch 3")),  # posted after the peer died
    ]


@RunIf(multiprocess=True)
def test_every_operation_on_a_link_to_a_dead_peer_raises_a_pipeline_error_naming_both_ends() -> None:
    # gloo's isend raises at once when the peer's connection has closed, and that error escaped raw
    # ("Connection closed by peer ... GLHF!") from a gradient send in the backward; the send waited for at the end of
    # the step did not say what it carried. Real gloo, two processes: rank 1's process ends, as a killed worker's does.
    received, waited, sent = run_processes(_against_a_dead_peer, 2, timeout=120)[0]
    expected = [
        (received, r"receiving gradients of micro-batch 0 from stage 1 \(global rank 1\) failed: "),
        (waited, r"sending activations of micro-batch 0 to stage 1 \(global rank 1\) failed: "),
        (sent, r"sending gradients of micro-batch 3 to stage 1 \(global rank 1\) failed: "),
    ]
    for (kind, message, cause), pattern in expected:
        assert kind == "PipelineError", (kind, message)
        assert re.match(r"\[pipeline stage 0\] " + pattern + r".*Connection (closed|reset) by peer", message), message
        assert "The other stage probably failed first" in message
        assert cause.startswith("RuntimeError("), cause  # gloo's own error stays visible as the cause


def _scaler_against_a_dead_peer(rank: int, world_size: int) -> list[tuple[str, str, str]] | None:
    """Rank 0's loss-scaler agreements (16-mixed's found infs) after rank 1's process has ended: what each raised."""
    dist.barrier()
    if rank == 1:
        return None  # the process ends and its connections close, as a killed worker's do
    outcomes = []
    for fused in (False, True):  # unscale_'s all-reduce (ShardedGradScaler's), then the fused optimizer's (agree)
        parameter = nn.Parameter(torch.ones(4))
        optimizer = torch.optim.AdamW([parameter], lr=0.1, fused=fused)
        scaler = WorldGradScaler.like(torch.amp.GradScaler("cpu", init_scale=8.0), "cpu", stage=1)
        scaler.scale(torch.ones(()))  # the scale comes into being with the first scaled loss
        parameter.grad = torch.full((4,), 8.0)
        outcomes.append(_escaped(functools.partial(scaler.step, optimizer)))
    return outcomes


@RunIf(multiprocess=True)
def test_the_loss_scalers_agreement_with_a_dead_peer_raises_a_pipeline_error_naming_the_stage() -> None:
    # precision="16-mixed": WorldGradScaler all-reduces the found infs over the world (in unscale_, and in its agree
    # for fused optimizers), and gloo's raw error escaped both when another rank had died. 16-mixed does not run on
    # the CPU (Lightning falls back to bf16, which has no scaler), so the scaler runs alone on two gloo processes.
    for kind, message, cause in run_processes(_scaler_against_a_dead_peer, 2, timeout=120)[0]:
        assert kind == "PipelineError", (kind, message)
        pattern = r"\[pipeline stage 1\] agreeing with every rank on the loss scaler's found infs .* failed: "
        assert re.match(pattern, message), message
        assert "Another rank of the job probably failed first" in message
        assert cause.startswith("RuntimeError("), cause  # gloo's own error stays visible as the cause


def test_a_failed_checkpoint_write_leaves_the_previous_one_intact(tmp_path: Path) -> None:
    strategy = GPipeStrategy()
    path = tmp_path / "last.ckpt"
    strategy.save_checkpoint({"step": 1}, path)
    with pytest.raises(Exception, match="pickle"):
        strategy.save_checkpoint({"step": 2, "unpicklable": lambda: None}, path)
    assert torch.load(path, weights_only=True)["step"] == 1
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


@pytest.mark.usefixtures("loopback_process_group")
def test_manual_optimization_is_refused_before_training() -> None:
    trainer = L.Trainer(
        strategy=GPipeStrategy(pipe_size=1), accelerator="cpu", devices=1, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match="supports automatic optimization only"):
        trainer.fit(Manual(), torch.utils.data.DataLoader(torch.randn(4, 2), batch_size=2))
