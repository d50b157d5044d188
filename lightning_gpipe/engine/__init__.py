"""The engine: GPipe's schedules, micro-batches, stages and their links, in plain PyTorch (no Lightning).

It imports neither Lightning nor torchmetrics, so a training loop of your own, a test or a notebook can pipeline a
model with it alone (see the engine guide); :class:`~lightning_gpipe.strategy.GPipeStrategy` is built on it.
"""

from lightning_gpipe.engine.batchnorm import DeferredBatchNorm
from lightning_gpipe.engine.config import PipelineConfig
from lightning_gpipe.engine.errors import PipelineError
from lightning_gpipe.engine.pipeline import Pipeline, run_in_threads
from lightning_gpipe.engine.step import StepRun
from lightning_gpipe.engine.thread_transport import ThreadTransport
from lightning_gpipe.engine.timeline import Timeline
from lightning_gpipe.engine.transport import ProcessGroupTransport
from lightning_gpipe.engine.unbatched import Unbatched

__all__ = [
    "DeferredBatchNorm",
    "Pipeline",
    "PipelineConfig",
    "PipelineError",
    "ProcessGroupTransport",
    "StepRun",
    "ThreadTransport",
    "Timeline",
    "Unbatched",
    "run_in_threads",
]
