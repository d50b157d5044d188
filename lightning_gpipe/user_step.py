"""The user's step hook run once per micro-batch, the pipelined sequence standing in for its layers.

Every stage runs the user's ``training_step`` (or validation, test, predict step) for each micro-batch up to its call of
the sequence, which the step driver turns into this stage's forward. On a stage that is not the last the user's step
ends there; on the last stage it goes on with the output, as in a plain step (a decoder may call the sequence again).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from lightning.pytorch import LightningModule

from lightning_gpipe.build.sequence import PipelinedSequential
from lightning_gpipe.engine.driver import StepDriver, StepFn
from lightning_gpipe.engine.microbatch import Microbatch
from lightning_gpipe.log_mirror import LogRecorder

__all__ = ["routed", "user_step"]


class _StageDone(BaseException):
    """Ends the user's step on a stage that is not the last once its cell's output is sent.

    A ``BaseException`` so that a user's ``except Exception`` around the call does not swallow it.
    """


@contextlib.contextmanager
def routed(stand_in: PipelinedSequential, driver: StepDriver) -> Iterator[None]:
    """Within, calling the pipelined sequence is ``driver``'s call; on a stage that is not the last it ends the step."""
    last = driver.stage.is_last

    def run(value: Any) -> Any:
        output = driver.call(value)
        if not last:
            raise _StageDone
        return output

    stand_in.runner = run
    try:
        yield
    finally:
        stand_in.runner = None


def user_step(
    module: LightningModule,
    hook: str,
    args: tuple,
    kwargs: dict,
    context: Callable[[], contextlib.AbstractContextManager[Any]],
    recorder: LogRecorder,
) -> StepFn:
    """The step function running ``module``'s ``hook`` on a micro-batch, its logs recorded; ``None`` where cut short."""

    def step(mb: Microbatch) -> Any:
        with context(), recorder.capture(mb.index):
            try:
                return getattr(module, hook)(mb.value, *args, **kwargs)
            except _StageDone:
                return None

    return step
