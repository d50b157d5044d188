"""GPipe pipeline parallelism for PyTorch Lightning.

Importing the package registers the strategy name ``"gpipe"`` (and ``"gpipe_notebook"``, which forks its processes)::

    import lightning as L
    import lightning_gpipe

    trainer = L.Trainer(strategy="gpipe", accelerator="cpu", devices=2)

The engine (:mod:`lightning_gpipe.engine`) and the planner need neither Lightning nor torchmetrics; without them,
only the Lightning layer's names (``GPipeStrategy``, ``PipelineTimeline``) are missing.
"""

from typing import Any

from lightning_gpipe.engine import DeferredBatchNorm, Pipeline, PipelineError, Timeline, Unbatched, run_in_threads
from lightning_gpipe.plan import AutoPlan, plan

try:
    import lightning.pytorch  # noqa: F401
    import torchmetrics  # noqa: F401
except ImportError as error:
    _LIGHTNING_MISSING: ImportError | None = error
else:
    _LIGHTNING_MISSING = None
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_gpipe.callbacks import PipelineTimeline
    from lightning_gpipe.strategy import GPipeStrategy

    GPipeStrategy.register_strategies(StrategyRegistry)

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

_LIGHTNING_NAMES = ("GPipeStrategy", "PipelineTimeline")


def __getattr__(name: str) -> Any:
    # Reached only for names the imports above did not bind: the Lightning layer's, when Lightning cannot be imported.
    if name in _LIGHTNING_NAMES:
        raise ImportError(
            f"lightning_gpipe.{name} needs Lightning and torchmetrics ({_LIGHTNING_MISSING}): pip install "
            "lightning torchmetrics, or use lightning_gpipe.engine alone"
        ) from _LIGHTNING_MISSING
    raise AttributeError(f"module 'lightning_gpipe' has no attribute {name!r}")
