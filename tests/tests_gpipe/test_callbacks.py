"""Lightning callbacks for pipelines: PipelineTimeline, checked through the spiral example run as a real 2-rank job."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import lightning as L
import pytest
import torch
from helpers.runif import RunIf

from lightning_gpipe.callbacks import PipelineTimeline
from tools.launch import run_command

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def spiral_script() -> ModuleType:
    """examples/spiral.py as a module (it is a script, not part of a package); importing it trains nothing."""
    spec = importlib.util.spec_from_file_location("gpipe_spiral", REPO / "examples" / "spiral.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("step", [-1, 1.5, True])
def test_step_must_be_a_global_step(step):
    with pytest.raises(ValueError, match=r"PipelineTimeline\(step=.*\) must be a global step, an int >= 0"):
        PipelineTimeline("timeline.png", step=step)


def test_other_strategies_fail_at_setup_with_the_fix(tmp_path):
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, max_steps=1)
    with pytest.raises(TypeError, match=r"strategy='gpipe', not SingleDeviceStrategy"):
        PipelineTimeline(tmp_path / "timeline.png").setup(trainer, L.LightningModule(), "fit")


@RunIf(multiprocess=True)
def test_the_spiral_example_trains_checkpoints_and_charts_a_step(tmp_path):
    # Lightning's launcher starts the second rank itself by re-running the script, as for any script.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "examples/spiral.py", "--max-epochs", "1", "--out", str(tmp_path)]
    result = run_command(command, cwd=REPO, env=env, timeout=400)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]

    assert (tmp_path / "timeline.png").read_bytes()[: len(PNG_MAGIC)] == PNG_MAGIC
    assert "PipelineTimeline: measured bubble" in output
    assert "fill-drain ideal 11.1% for K=2, M=8" in output

    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    plain = spiral_script().SpiralClassifier()
    plain.load_state_dict(checkpoint["state_dict"], strict=True)  # raises on any missing or renamed key
    assert "loaded into the plain SpiralClassifier (strict=True)" in output
