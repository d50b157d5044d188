"""The configurations check every setting once, without a Trainer, and resolve once against the run; the strategy
and the engine take them as they are."""

from __future__ import annotations

import dataclasses
import datetime
import sys
import typing
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_gpipe.config import StrategyConfig
from lightning_gpipe.engine import schedule
from lightning_gpipe.engine.config import PipelineConfig
from lightning_gpipe.engine.pipeline import Pipeline, run_in_threads
from lightning_gpipe.engine.rematerialization import CHECKPOINT_MODES, CheckpointMode
from lightning_gpipe.engine.stage import Stage
from lightning_gpipe.engine.thread_transport import ThreadTransport
from lightning_gpipe.partition.config import Balance, BuildConfig, ResolvedPipeline
from lightning_gpipe.profile.cost import COST_SOURCES


def test_a_valid_configuration_is_frozen_and_keeps_its_values() -> None:
    config = StrategyConfig(pipe_size=2, chunks=8, balance=(3, 5), schedule="1f1b", timeout=datetime.timedelta(1))
    assert config.balance == [3, 5]  # a tuple of layers per stage becomes the list the partitioner takes
    assert config.schedule == "1f1b"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.chunks = 4  # type: ignore[misc]


def test_the_strategy_keeps_the_configuration_it_validated() -> None:
    from lightning_gpipe import GPipeStrategy

    strategy = GPipeStrategy(pipe_size=2, chunks=4, schedule="1f1b", checkpoint="never")
    assert strategy.config == StrategyConfig(pipe_size=2, chunks=4, schedule="1f1b", checkpoint="never")


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"chunks": 0}, ValueError, r"chunks=0 must be at least 1"),
        ({"balance": [1, 1, 1], "pipe_size": 2}, ValueError, r"balance=\[1, 1, 1\] has 3 stages but pipe_size=2"),
        ({"schedule": "zb"}, ValueError, r"Unknown pipeline schedule 'zb'; use one of 'gpipe', '1f1b'"),
        ({"timeout": 5}, TypeError, r"timeout=5 must be a datetime.timedelta"),
        ({"start_method": "thread"}, ValueError, r"start_method='thread' is not a way to start the processes"),
    ],
)
def test_bad_values_are_refused_without_a_trainer(arguments: dict, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        StrategyConfig(**arguments)


# ---------------------------------------------------------------------------------------------- the engine takes it


def _cell() -> torch.nn.Module:
    return torch.nn.Linear(2, 2)


def test_the_engine_takes_a_validated_configuration_or_builds_one_from_keywords() -> None:
    config = PipelineConfig(chunks=3, checkpoint="never", schedule="1f1b", detect_anomalies=True)
    pipeline = Pipeline(_cell(), ThreadTransport.create(1)[0], config)
    assert pipeline.config is config
    assert pipeline.stage.config is config  # handed down, not copied and checked again
    stage = pipeline.stage
    assert (pipeline.chunks, pipeline.schedule, stage.checkpoint, stage.detect_anomalies) == (3, "1f1b", "never", True)
    keywords = Pipeline(
        _cell(), ThreadTransport.create(1)[0], chunks=3, checkpoint="never", schedule="1f1b", detect_anomalies=True
    )
    assert keywords.config == config


def _pipeline(*args: Any, **kwargs: Any) -> None:
    Pipeline(_cell(), ThreadTransport.create(1)[0], *args, **kwargs)


def _stage(*args: Any, **kwargs: Any) -> None:
    Stage(_cell(), ThreadTransport.create(1)[0], *args, **kwargs)


ENGINE_MISTAKES = [
    (_pipeline, (PipelineConfig(chunks=4),), {"chunks": 8}, ValueError, r"Pipeline got a config and also chunks=8"),
    (
        _pipeline,
        (4,),
        {},
        TypeError,
        r"Pipeline got config=4; give a PipelineConfig or None, or the settings as keywords",
    ),
    (_pipeline, (), {}, TypeError, r"Pipeline needs chunks \(micro-batches per mini-batch\), e.g. chunks=8"),
    (_pipeline, (), {"chunks": 0}, ValueError, r"chunks=0 must be at least 1"),
    (_pipeline, (), {"chunks": 2, "schedule": "zb"}, ValueError, r"Unknown pipeline schedule 'zb'"),
    (_stage, (), {"checkpoint": "sometimes"}, ValueError, r"checkpoint='sometimes' is not a re-materialization mode"),
    (_stage, (PipelineConfig(),), {"checkpoint": "never"}, ValueError, r"Stage got a config and also checkpoint="),
]


@pytest.mark.parametrize(("build", "args", "kwargs", "error", "message"), ENGINE_MISTAKES)
def test_the_engine_refuses_a_setting_given_twice_missing_or_bad(
    build: Callable[..., None], args: tuple, kwargs: dict, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        build(*args, **kwargs)


@pytest.mark.parametrize(
    ("setting", "message"),
    [({"chunks": 0}, r"chunks=0 must be at least 1"), ({"schedule": "zb"}, r"Unknown pipeline schedule 'zb'")],
)
def test_run_in_threads_refuses_a_bad_setting_in_the_callers_thread(setting: dict, message: str) -> None:
    # Each stage's thread validated the settings when it built its Pipeline, outside the part of the thread that
    # reports errors: every thread died, and run_in_threads raised KeyError for the missing result instead.
    settings = {"chunks": 2, **setting}
    with pytest.raises(ValueError, match=message):
        run_in_threads([_cell(), _cell()], (torch.randn(4, 2),), lambda output, mb: output.sum(), **settings)


# ------------------------------------------------------------------------------------- resolved once, against the run


def test_resolve_turns_the_settings_and_the_world_into_what_everything_reads() -> None:
    config = StrategyConfig(balance=[2, 2], checkpoint="never", module_name="layers")
    settings = config.resolve(world_size=4, rank=1, chosen={"pipe_size": 2})
    assert isinstance(settings, ResolvedPipeline)
    assert (settings.pipe_size, settings.chunks, settings.checkpoint, settings.schedule) == (2, 8, "never", "gpipe")
    assert (settings.layout.stage, settings.layout.replica) == (0, 0)  # rank 1: stage 0 of the first pipeline
    assert (settings.balance, settings.module_name) == ([2, 2], "layers")
    assert settings.pipeline == PipelineConfig(chunks=8, checkpoint="never")  # what the engine runs by
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.balance = [3, 1]  # type: ignore[misc]
    # The plan's choice takes the config's place in the settings; the config stays as the user gave it.
    planned = BuildConfig().resolve(2, 0, chosen={"pipe_size": 1, "chunks": 3, "schedule": "1f1b"})
    assert (planned.pipe_size, planned.layout.num_replicas, planned.chunks, planned.schedule) == (1, 2, 3, "1f1b")


@pytest.mark.parametrize(
    ("config", "chosen", "message"),
    [
        (
            BuildConfig(pipe_size=3),
            None,
            r"world_size=4 is not divisible by pipe_size=3; use one of its divisors: 1, 2, 4",
        ),
        (BuildConfig(balance=[1, 1]), None, r"balance=\[1, 1\] has 2 stages but the pipelines have 4 \(world_size=4"),
        (BuildConfig(), {"pipe_size": 2, "balance": [1]}, r"balance=\[1\] has 1 stages but the pipelines have 2"),
    ],
)
def test_resolve_refuses_a_world_the_settings_do_not_fit(
    config: BuildConfig, chosen: dict | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        config.resolve(4, 0, chosen)


def test_resolve_warns_when_fewer_micro_batches_than_stages() -> None:
    with pytest.warns(UserWarning, match=r"chunks=1 is smaller than pipe_size=2: at most 1 of 2 stages can work"):
        BuildConfig(chunks=1).resolve(2, 0)


def test_the_strategy_resolves_its_settings_and_keeps_the_configuration_as_given() -> None:
    from lightning_gpipe import GPipeStrategy

    strategy = GPipeStrategy(pipe_size=1, chunks=3, schedule="1f1b")
    config = strategy.config
    strategy.set_world_ranks()
    assert strategy.config is config  # not replaced by resolved values
    assert strategy.layout is strategy.settings.layout
    assert (strategy.pipe_size, strategy.chunks, strategy.settings.schedule) == (1, 3, "1f1b")


def test_one_list_of_names_per_setting() -> None:
    # The Literal types spell the names for type checkers; the tuples the checks and messages use are the same names.
    balance_names = next(arg for arg in typing.get_args(Balance) if typing.get_origin(arg) is typing.Literal)
    assert typing.get_args(balance_names) == COST_SOURCES
    assert typing.get_args(CheckpointMode) == CHECKPOINT_MODES
    with pytest.raises(ValueError, match=r"one of 'params', 'flops', 'time', 'memory', a list or a callable$"):
        BuildConfig(balance="bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        # The schedule does not take it: the message names the value and what to do instead.
        (
            {"schedule": "1f1b", "virtual_stages": 2},
            r"virtual_stages=2 applies to schedule='interleaved' only; leave it at 1",
        ),
        ({"schedule": "zbv", "virtual_stages": 3}, r"schedule='zbv' always places 2"),
        ({"schedule": "interleaved"}, r"schedule='interleaved' needs virtual_stages >= 2 .* got 1"),
        # Balance counts K * v stages.
        (
            {"schedule": "interleaved", "virtual_stages": 2, "pipe_size": 2, "balance": [4, 4]},
            r"balance=\[4, 4\] has 2 stages but the pipeline has 4: pipe_size=2 x 2 stages each; give one per stage",
        ),
        # Interleaved runs chunks in rounds of about K micro-batches.
        (
            {"schedule": "interleaved", "virtual_stages": 2, "pipe_size": 2, "chunks": 5},
            r"cannot split chunks=5 into rounds of about pipe_size=2",
        ),
    ],
)
def test_virtual_stages_are_refused_with_the_fix_where_the_schedule_cannot_take_them(
    arguments: dict, message: str
) -> None:
    from lightning_gpipe import GPipeStrategy

    with pytest.raises(ValueError, match=message):
        GPipeStrategy(**arguments)


def test_the_strategy_resolves_several_stages_per_process() -> None:
    from lightning_gpipe import GPipeStrategy

    strategy = GPipeStrategy(pipe_size=2, chunks=4, schedule="interleaved", virtual_stages=2)
    settings = strategy.config.resolve(world_size=4, rank=2)
    assert (settings.layout.replica, settings.layout.stages, settings.num_stages) == (1, (1, 3), 4)
    assert settings.pipeline.virtual_stages == 2
    zbv = GPipeStrategy(schedule="zbv").config.resolve(world_size=2, rank=0)
    assert (zbv.layout.stages, zbv.pipeline.stages_per_process, zbv.chunks) == ((0, 3), 2, 8)
    with pytest.raises(ValueError, match=r"plan chooses .* but schedule='interleaved', virtual_stages=2 were given"):
        GPipeStrategy(schedule="interleaved", virtual_stages=2, plan="auto")


def test_eager_selective_on_a_gpu_is_advised_to_compile() -> None:
    # Found on an H100: eager selective re-materialization ran slower than except_last (the policy runs per op).
    from lightning_gpipe import GPipeStrategy
    from lightning_gpipe.config import eager_selective_advice as _eager_selective_advice

    def advice(device: str, **arguments: Any) -> str | None:
        settings = GPipeStrategy(pipe_size=1, chunks=4, **arguments).config.resolve(world_size=1, rank=0)
        return _eager_selective_advice(settings, torch.device(device))

    assert advice("cuda", checkpoint="selective") is not None
    assert "Pass compile=True" in (advice("cuda", checkpoint="selective") or "")
    assert advice("cuda", checkpoint="selective", compile=True) is None
    assert advice("cpu", checkpoint="selective") is None
    assert advice("cuda", checkpoint="except_last") is None


def test_a_short_training_batch_that_interleaved_cannot_order_is_refused_with_the_fix() -> None:
    # A last batch of 5 samples under chunks=6 runs 5 micro-batches, which interleaved cannot split into rounds over
    # 2 processes: the engine's own error named chunks=5, a value the user never gave.
    from lightning_gpipe.user_step import check_rounds

    config = PipelineConfig(chunks=6, schedule="interleaved", virtual_stages=2)
    with pytest.raises(ValueError, match=r"a training batch of 5 samples, fewer than chunks=6, .*drop_last=True"):
        check_rounds(config, 5, processes=2)
    check_rounds(config, 4, processes=2)  # two rounds of two
    check_rounds(PipelineConfig(chunks=6, schedule="zbv"), 5, processes=2)  # ZB-V takes any number


@pytest.mark.parametrize(("name", "v"), [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1), ("interleaved", 2), ("zbv", 1)])
def test_the_schedule_is_checked_at_two_places_of_a_setup_and_never_per_step(
    monkeypatch: pytest.MonkeyPatch, name: str, v: int
) -> None:
    # The schedule was checked at about eight places of a setup (every configuration, layout, pipeline and first
    # step order) and again by every read of the layout and every step of a process of several stages.
    sites: Counter[tuple[str, str]] = Counter()
    real = schedule.validate_schedule

    def counted(value: object) -> str:
        frame = sys._getframe(1)
        while frame.f_code.co_filename == schedule.__file__:  # the schedule's own functions: who asked them
            frame = frame.f_back  # type: ignore[assignment]
        sites[frame.f_globals["__name__"], frame.f_code.co_name] += 1
        return real(value)

    for module in list(sys.modules.values()):
        if getattr(module, "validate_schedule", None) is real:
            monkeypatch.setattr(module, "validate_schedule", counted)
    schedule.stage_table.cache_clear()
    schedule.step_order.cache_clear()
    settings = [StrategyConfig(chunks=4, schedule=name, virtual_stages=v).resolve(2, rank) for rank in range(2)]
    cells = [torch.nn.Linear(2, 2) for _ in range(settings[0].num_stages)]
    batch = torch.randn(4, 2)
    loss = lambda output, _: output.sum()  # noqa: E731

    def step() -> None:
        run_in_threads(cells, batch, loss, chunks=4, schedule=name, virtual_stages=v)

    step()
    assert set(sites) <= {
        ("lightning_gpipe.engine.config", "__post_init__"),
        ("lightning_gpipe.engine.layout", "__post_init__"),
    }, sites
    sites.clear()
    for layout in (s.layout for s in settings):
        assert layout.stages
        assert layout.last_stage_rank == 0
    step()
    assert sites == {("lightning_gpipe.engine.config", "__post_init__"): 1}  # run_in_threads' own configuration
