"""``python -m lightning_gpipe.plan``: a user's own model, the strategy's batch, and the line to paste."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.runif import RunIf
from torch import nn

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.plan import plan
from lightning_gpipe.plan.__main__ import main

REPO = Path(__file__).resolve().parents[2]
USER_MODEL = '''
import lightning as L
import torch
from torch import nn


class Net(L.LightningModule):
    """Layers built in configure_model, as on the meta device under the strategy."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.width = width
        self.layers = None
        self.example_input_array = torch.randn(2, 8)

    def configure_model(self) -> None:
        if self.layers is None:
            w = self.width
            self.layers = nn.Sequential(nn.Linear(8, w), nn.Tanh(), nn.Linear(w, w), nn.Tanh(), nn.Linear(w, 2))


def make(width: int = 16) -> Net:
    return Net(width)


net = Net()
'''
ARGS = ["--devices", "2", "--memory", "1GB", "--batch-size", "8", "--flops-per-second", "1e9", "--schedules", "gpipe"]


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module of the user's own, importable as ``plan_cli_user_net`` (from ``tmp_path``)."""
    (tmp_path / "plan_cli_user_net.py").write_text(USER_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "plan_cli_user_net"
    sys.modules.pop("plan_cli_user_net", None)


@pytest.mark.parametrize(("attribute", "model_args"), [("Net", ["width=16"]), ("make", []), ("net", [])])
def test_the_command_line_plans_a_users_model_and_prints_the_strategy_line_of_plan_auto(
    user_module: str, attribute: str, model_args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # Regression (issue 29, C2): the command line planned zoo models only and printed no GPipeStrategy(...) line, and
    # its --batch-size was the whole step's while plan="auto" plans each pipeline's.
    extra = [arg for value in model_args for arg in ("--model-arg", value)]
    assert main([f"{user_module}:{attribute}", *extra, *ARGS]) == 0
    printed = capsys.readouterr().out
    layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    expected = plan(
        layers.to("meta"), torch.empty(2, 8, device="meta"), devices=2, memory_per_device="1GB", batch_size=8,
        flops_per_second=1e9, schedules=["gpipe"], per_pipeline_batch=True,
    )  # fmt: skip
    # The same line as plan="auto" logs (agreed_settings reports Plan.strategy_code()), ready to paste.
    assert printed.splitlines()[0] == f"GPipe plan for 2 device(s); to train with it: {expected.strategy_code()}"
    assert "batch 8 per pipeline" in printed
    code = re.search(r"GPipeStrategy\(.*\)", printed.splitlines()[0])
    assert code is not None
    strategy = eval(code.group(0), {"GPipeStrategy": GPipeStrategy})
    assert isinstance(strategy, GPipeStrategy)
    assert strategy.config.balance == expected.balance


def test_the_command_lines_batch_size_is_per_pipeline_and_its_help_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "samples each pipeline reads per step: the DataLoader's batch_size, as GPipeStrategy(plan='auto')" in text
    assert "module:attribute" in text


def test_the_command_line_says_what_is_wrong_with_a_model_it_cannot_load(
    user_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([f"{user_module}:Missing", *ARGS])
    assert "cannot load the model 'plan_cli_user_net:Missing'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([f"{user_module}:net", "--model-arg", "width=4", *ARGS])
    assert "is a built module, which takes no --model-arg" in capsys.readouterr().err


@RunIf(multiprocess=True)  # a fresh interpreter, so that nothing imported the zoo before
@pytest.mark.timeout(300)
def test_the_command_line_imports_the_zoo_only_for_a_zoo_model(user_module: str, tmp_path: Path) -> None:
    # Regression (issue 29, C2): plan/__main__ imported zoo for every model, a wrong-way import from the library into
    # the zoo; a user's model must plan without it.
    script = textwrap.dedent(f"""
        import sys
        from lightning_gpipe.plan.__main__ import main
        assert main({[f"{user_module}:Net", *ARGS]!r}) == 0
        assert "zoo" not in sys.modules, "zoo was imported"
    """)
    path = os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_zoo_model_is_still_planned_by_its_name(capsys: pytest.CaptureFixture[str]) -> None:
    model_args = ["num_layers=2", "d_model=32", "ff_dim=64", "num_heads=2", "vocab_size=100"]
    extra = [arg for value in model_args for arg in ("--model-arg", value)]
    assert main(["transformer_lm", *extra, "--sample-shape", "2,16", "--sample-dtype", "long", *ARGS]) == 0
    assert "to train with it: GPipeStrategy(pipe_size=" in capsys.readouterr().out


def test_the_command_line_plans_interleaved_stages_and_prints_their_virtual_stages(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Issue 31: the command line weighs the schedules of several stages per process; with interleaving alone and
    # two stages per process, its line carries virtual_stages and K·v stages of balance.
    model_args = ["num_layers=4", "d_model=32", "ff_dim=64", "num_heads=2", "vocab_size=100"]
    extra = [arg for value in model_args for arg in ("--model-arg", value)]
    asked = ["--devices", "2", "--memory", "1GB", "--batch-size", "8", "--flops-per-second", "1e9"]
    asked += ["--schedules", "interleaved", "--virtual-stages", "2"]
    assert main(["transformer_lm", *extra, "--sample-shape", "2,16", "--sample-dtype", "long", *asked]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    code = re.search(r"GPipeStrategy\(.*\)", line)
    assert code is not None, line
    assert code.group(0).endswith("schedule='interleaved', virtual_stages=2)"), line
    config = eval(code.group(0), {"GPipeStrategy": GPipeStrategy}).config
    assert (config.virtual_stages, len(config.balance)) == (2, 2 * config.pipe_size)


def test_the_command_line_plans_the_replicas_whole_sharded_or_either(
    user_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    options: dict[str, Any] = {"devices": 2, "batch_size": 8, "flops_per_second": 1e9, "schedules": ["gpipe"]}
    options["per_pipeline_batch"] = True
    sample = torch.empty(2, 8, device="meta")
    assert main([f"{user_module}:Net", *ARGS, "--data-parallel", "fsdp"]) == 0
    expected = plan(layers.to("meta"), sample, memory_per_device="1GB", data_parallel="fsdp", **options)
    line = capsys.readouterr().out.splitlines()[0]
    assert line == f"GPipe plan for 2 device(s); to train with it: {expected.strategy_code()}"
    assert line.endswith(", data_parallel='fsdp')")
    config = eval(line.split(": ", 1)[1], {"GPipeStrategy": GPipeStrategy}).config
    assert config.data_parallel == "fsdp"
    # Whole replicas only, with too little memory: the answer says what sharded ones would hold.
    tight = [arg if arg != "1GB" else "2KB" for arg in ARGS]
    assert main([f"{user_module}:Net", *tight, "--data-parallel", "ddp"]) == 2
    assert "sharded over them (data_parallel='fsdp') at best" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([f"{user_module}:Net", *ARGS, "--data-parallel", "zero3"])
    assert "invalid choice: 'zero3'" in capsys.readouterr().err
