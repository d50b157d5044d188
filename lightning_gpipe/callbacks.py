"""Lightning callbacks for pipelines."""

from __future__ import annotations

import os
import pathlib
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_gpipe.engine.microbatch import batch_size, microbatch_sizes
from lightning_gpipe.engine.schedule import bubble_fraction
from lightning_gpipe.engine.timeline import Timeline
from lightning_gpipe.strategy import GPipeStrategy

__all__ = ["PipelineTimeline"]


class PipelineTimeline(Callback):
    """Record one training step of a :class:`~lightning_gpipe.GPipeStrategy` pipeline and draw it as a Gantt chart.

    On the training batch that starts at global step ``step`` every stage records when it runs each micro-batch's
    forward and backward; after that batch the spans of the first pipeline are gathered on global rank 0, which writes
    the chart to ``path`` and reports the measured bubble next to the fill-drain ideal ``(K - 1) / (M + K - 1)``.
    The bubble is also sent to the trainer's loggers as ``pipeline/bubble_measured`` and ``pipeline/bubble_expected``.

    Args:
        path: where to write the PNG; parent folders are created.
        step: the global step to record. Later than the first steps by default: the first ones pay for warm-up
            (allocator growth, the first messages between stages) and would overstate the bubble.

    After the step, on global rank 0 only, :attr:`timeline`, :attr:`measured_bubble` and :attr:`expected_bubble`
    hold what was drawn; elsewhere they stay ``None``.
    """

    def __init__(self, path: str | os.PathLike[str], step: int = 2) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"PipelineTimeline(step={step!r}) must be a global step, an int >= 0")
        self.path = pathlib.Path(path)
        self.step = step
        self.timeline: Timeline | None = None
        self.measured_bubble: float | None = None
        self.expected_bubble: float | None = None
        self._recording = False
        self._recorded = False
        self._num_microbatches = 0

    @staticmethod
    def _strategy(trainer: Trainer) -> GPipeStrategy:
        strategy = trainer.strategy
        if not isinstance(strategy, GPipeStrategy):
            raise TypeError(f"PipelineTimeline needs strategy='gpipe', not {type(strategy).__name__}")
        return strategy

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._strategy(trainer)  # fail before training, not at the recorded step

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # With gradient accumulation several batches share a global step: the first of them is recorded.
        if self._recorded or trainer.global_step != self.step:
            return
        strategy = self._strategy(trainer)
        # The strategy's stages hold this very Timeline object, so it is cleared and switched on, never replaced.
        strategy.timeline.clear()
        strategy.timeline.enabled = True
        self._num_microbatches = len(microbatch_sizes(batch_size(batch), strategy.chunks))
        self._recording = True

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._recording:
            return
        strategy = self._strategy(trainer)
        self._stop(strategy)
        self._recorded = True
        merged = strategy.gather_timeline()  # a collective: every rank takes part, only global rank 0 gets the spans
        strategy.timeline.clear()
        if merged is None:
            return
        K, M = strategy.pipe_size, self._num_microbatches
        self.timeline = merged
        self.measured_bubble = merged.bubble_fraction()
        self.expected_bubble = bubble_fraction(K, M)
        title = f"GPipe timeline at global step {self.step}: K={K} stages, M={M} micro-batches"
        merged.plot(self.path, title=title, expected_bubble=self.expected_bubble)
        rank_zero_info(
            f"PipelineTimeline: measured bubble {self.measured_bubble:.1%} at global step {self.step} "
            f"(fill-drain ideal {self.expected_bubble:.1%} for K={K}, M={M}); chart written to {self.path}"
        )
        metrics = {"pipeline/bubble_measured": self.measured_bubble, "pipeline/bubble_expected": self.expected_bubble}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # A failed step must not leave every later step paying for recording.
        if self._recording and isinstance(trainer.strategy, GPipeStrategy):
            self._stop(trainer.strategy)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._recorded:
            rank_zero_warn(
                f"PipelineTimeline(step={self.step}) wrote no chart: training ended at global step "
                f"{trainer.global_step}; choose a step the run reaches"
            )

    def _stop(self, strategy: GPipeStrategy) -> None:
        strategy.timeline.enabled = False
        self._recording = False
