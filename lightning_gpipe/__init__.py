"""GPipe pipeline parallelism for PyTorch Lightning.

Importing the package registers the strategy name ``"gpipe"`` (and ``"gpipe_notebook"``, which forks its processes)::

    import lightning as L
    import lightning_gpipe

    trainer = L.Trainer(strategy="gpipe", accelerator="cpu", devices=2)
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_gpipe.batchnorm import DeferredBatchNorm
from lightning_gpipe.callbacks import PipelineTimeline
from lightning_gpipe.errors import PipelineError
from lightning_gpipe.pipeline import Pipeline, run_in_threads
from lightning_gpipe.plan import AutoPlan, plan
from lightning_gpipe.strategy import GPipeStrategy
from lightning_gpipe.timeline import Timeline
from lightning_gpipe.unbatched import Unbatched

__all__ = [
    "AutoPlan",
    "DeferredBatchNorm",
    "GPipeStrategy",
    "Pipeline",
    "PipelineError",
    "PipelineTimeline",
    "Timeline",
    "Unbatched",
    "plan",
    "run_in_threads",
]
__version__ = "0.1.0"

GPipeStrategy.register_strategies(StrategyRegistry)
