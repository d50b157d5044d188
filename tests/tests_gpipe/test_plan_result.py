"""The planner's answer: bytes as the user writes them, and a plan as the code that carries it out."""

from __future__ import annotations

import pytest
from helpers.plan_profiles import FREE_LINKS, MiB, meta
from torch import nn

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.plan import parse_bytes, plan


def test_parse_bytes() -> None:
    assert parse_bytes("16GB") == 16 * 2**30
    assert parse_bytes("512 MiB") == 512 * MiB
    assert parse_bytes(1000) == 1000.0
    with pytest.raises(ValueError, match="unknown memory unit 'parsecs' in '3parsecs'"):
        parse_bytes("3parsecs")
    with pytest.raises(ValueError, match="must be positive"):
        parse_bytes(0)


def test_strategy_code_of_an_interleaved_plan_round_trips() -> None:
    layers = nn.Sequential(*[nn.Identity()] * 16)
    result = plan(
        layers, None, devices=4, memory_per_device="1GB", batch_size=16, profile=meta(), pipe_sizes=[4], chunks=[4],
        checkpoints=["never"], schedules=["1f1b", "interleaved"], virtual_stages=[2], **FREE_LINKS,
    )  # fmt: skip
    code = result.strategy_code()
    assert code.endswith("schedule='interleaved', virtual_stages=2)")
    assert eval(code, {"GPipeStrategy": dict}) == result.strategy_kwargs()
    assert result.strategy_kwargs()["balance"] == [2] * 8
    # The strategy takes the line as printed: K·v stages of balance, two per process.
    config = eval(code, {"GPipeStrategy": GPipeStrategy}).config
    assert (config.schedule, config.virtual_stages, config.balance) == ("interleaved", 2, [2] * 8)
