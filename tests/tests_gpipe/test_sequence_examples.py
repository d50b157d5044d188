"""The getting-started page's GPT (blocks and a tied head in one sequence) and U-Net (skip connections in a tuple)
train under ``strategy="gpipe"`` on two processes exactly as they train on one device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.jobs import run_job
from helpers.runif import RunIf
from helpers.sequence_examples_job import build, fit

TOLERANCE = 1e-5
EXAMPLES = ["gpt", "unet"]


@RunIf(multiprocess=True)
@pytest.mark.timeout(300)
def test_the_gpt_and_unet_examples_train_as_two_stages_like_one_device(tmp_path: Path) -> None:
    run = {"pipe_size": 2, "devices": 2, "chunks": 4, "steps": 3}
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"examples": EXAMPLES, "run": run}))
    results = run_job("helpers.sequence_examples_job", [str(config)], 2, timeout=280)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank} failed:\n{result.stdout[-4000:]}"
    for name in EXAMPLES:
        reference = fit(name, {"strategy": "auto", "devices": 1, "steps": 3}, tmp_path).state_dict()
        pipelined = torch.load(tmp_path / f"result-{name}.pt", weights_only=True)
        assert pipelined.keys() == reference.keys()
        for key, value in reference.items():
            difference = (pipelined[key].double() - value.double()).abs().max().item()
            assert difference <= TOLERANCE, f"{name} {key}: max abs difference {difference:.2e}"
        initial = build(name).state_dict()
        assert any(not torch.equal(value, pipelined[key]) for key, value in initial.items()), f"{name} never trained"
    assert json.loads((tmp_path / "tied-gpt.json").read_text()) == {"tied": True}
