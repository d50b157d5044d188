"""`make demo` end to end, on its quick settings: pretrain, fine-tune with new heads and from scratch, report, plot."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch
from helpers.runif import RunIf

from tools.launch import run_command

REPO = Path(__file__).resolve().parents[2]


# Slow (two 2-rank fits, about 2 minutes here): the default run covers the same pretrain -> fine-tune path with two
# stages through the command line (test_cli.py). `pytest -m slow` runs it.
@pytest.mark.slow
@RunIf(multiprocess=True)
@pytest.mark.timeout(900)
def test_the_demo_pretrains_fine_tunes_and_reports_accuracy_before_and_after(tmp_path: Path) -> None:
    command = [sys.executable, "examples/demo.py", "--quick", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = run_command(command, cwd=REPO, env=env, timeout=850)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # The summary table: accuracy before fine-tuning, then one row per run (epochs, accuracy, chance, wall time), the
    # from-scratch baseline beside fine-tuning; then both processes' CPU time.
    assert re.search(r"new heads, untrained +0 +[\d.]+% +16\.7%", result.stdout), result.stdout[-3000:]
    for row in ("pretraining on 'shapes'", "fine-tuned from the pretrained backbone", "the same network from scratch"):
        assert re.search(re.escape(row) + r".* 1 +[\d.]+% +[\d.]+% +\d+ s", result.stdout), result.stdout[-3000:]
    assert re.search(r"CPU time \d+ s \(\d+ \+ \d+ s over the 2 processes\)", result.stdout), result.stdout[-3000:]
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    assert (tmp_path / "accuracy.png").stat().st_size > 10_000
    pretrained = torch.load(tmp_path / "pretrain" / "last.ckpt", weights_only=True)
    assert pretrained["zoo_model"] == "amoebanet_d"
    assert "new heads: layers." in result.stdout
    # Progress with the output redirected, as here: a line per epoch of each of the three fits (it printed none).
    assert len(re.findall(r"^epoch 1/1 of AmoebaNetD: \d+ s, \d+ steps; .*val_acc", result.stdout, re.M)) == 3
