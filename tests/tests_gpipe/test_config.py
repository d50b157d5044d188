"""PipelineConfig checks every setting once, without a Trainer; the strategy's arguments only build it."""

from __future__ import annotations

import dataclasses
import datetime

import pytest

from lightning_gpipe.config import PipelineConfig


def test_a_valid_configuration_is_frozen_and_keeps_its_values() -> None:
    config = PipelineConfig(pipe_size=2, chunks=8, balance=(3, 5), schedule="1f1b", timeout=datetime.timedelta(1))
    assert config.balance == [3, 5]  # a tuple of layers per stage becomes the list the partitioner takes
    assert config.schedule == "1f1b"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.chunks = 4  # type: ignore[misc]


def test_the_strategy_keeps_the_configuration_it_validated() -> None:
    from lightning_gpipe import GPipeStrategy

    strategy = GPipeStrategy(pipe_size=2, chunks=4, schedule="1f1b", checkpoint="never")
    assert strategy.config == PipelineConfig(pipe_size=2, chunks=4, schedule="1f1b", checkpoint="never")


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"chunks": 0}, ValueError, r"chunks=0 must be at least 1"),
        ({"balance": [1, 1, 1], "pipe_size": 2}, ValueError, r"balance=\[1, 1, 1\] has 3 stages but pipe_size=2"),
        ({"schedule": "zb"}, ValueError, r"Unknown pipeline schedule 'zb'\. HINT: use one of 'gpipe', '1f1b'"),
        ({"timeout": 5}, TypeError, r"timeout=5 must be a datetime.timedelta"),
        ({"start_method": "thread"}, ValueError, r"start_method='thread' is not a way to start the processes"),
    ],
)
def test_bad_values_are_refused_without_a_trainer(arguments: dict, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        PipelineConfig(**arguments)
