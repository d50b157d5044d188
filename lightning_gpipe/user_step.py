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
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_gpipe.build.sequence import PipelinedSequential
from lightning_gpipe.engine.driver import StepDriver, StepFn
from lightning_gpipe.engine.microbatch import Microbatch
from lightning_gpipe.log_mirror import LogRecorder
from lightning_gpipe.plan.auto import check_planned_batch

__all__ = ["BatchChecks", "routed", "user_step"]


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


class BatchChecks:
    """A step's batch checked: enough samples for the stages, the planned size, and (a warning, once) for ``chunks``."""

    def __init__(self) -> None:
        self.planned: int | None = None  # plan="auto"'s batch per pipeline, until the first training batch
        self._sized: set[str] | None = set()  # the step hooks whose first batch was checked against chunks

    def check(self, hook: str, samples: int, training: bool, chunks: int, pipe_size: int) -> None:
        """Refuse a batch that cannot fill the stages, or that the plan did not plan; warn once about a small one."""
        if hook == "training_step" and self.planned is not None:
            check_planned_batch(self.planned, samples)
            self.planned = None
        if self._sized is not None and hook not in self._sized:  # warned once at most: a later batch may be the last
            self._sized.add(hook)
            if samples < chunks:
                self._sized = None
                rank_zero_warn(
                    f"chunks={chunks}, but the first {hook.removesuffix('_step')} batch holds {samples} samples "
                    f"and a micro-batch holds at least one, so the step runs {samples} micro-batches of one sample, "
                    f"not {chunks}. Set chunks={samples} (or fewer) to say so, or use batches of at least "
                    f"{chunks} samples."
                )
        if samples < pipe_size and training:
            raise ValueError(
                f"a batch of {samples} samples cannot fill {pipe_size} pipeline stages; "
                "use a batch size of at least pipe_size (and drop_last=True if the last batch is smaller)"
            )
