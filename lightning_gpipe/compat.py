"""Every use of Lightning's and torchmetrics' internals, in one place, each checked by ``test_compat.py``.

The strategy needs a few things neither library offers publicly: Lightning's launchers (and what a fork or spawn
worker hands back), process-group set-up and strategy registry (private names), the loader a running ``fit`` reads, a
``self.log`` it can record instead of log,
Lightning's clipping replaced by a clip over every stage, and a torchmetrics ``Metric``'s step value and update
count, read and restored. An upgrade that changes one of them fails in ``test_compat.py`` first, naming
:data:`SUPPORTED`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.device_mesh import DeviceMesh
from torchmetrics import Metric

__all__ = [
    "SUPPORTED",
    "MultiProcessingLauncher",
    "StrategyRegistry",
    "SubprocessScriptLauncher",
    "distributed_is_initialized",
    "init_dist_connection",
    "default_process_group_backend",
    "load_metric_state",
    "metric_step_value",
    "optimizers_to_device",
    "recording_log",
    "replace_clipping",
    "running_loader",
    "set_device_mesh",
    "set_metric_step_value",
    "sync_ddp_if_available",
    "worker_output",
]

SUPPORTED = "lightning>=2.5,<2.7 and torchmetrics>=1.4,<2.0 (checked on lightning 2.6 and torchmetrics 1.9)"
"""The versions whose internals this module was checked against."""

StrategyRegistry = _StrategyRegistry
MultiProcessingLauncher = _MultiProcessingLauncher
SubprocessScriptLauncher = _SubprocessScriptLauncher
default_process_group_backend = _get_default_process_group_backend_for_device
init_dist_connection = _init_dist_connection
sync_ddp_if_available = _sync_ddp_if_available
optimizers_to_device = _optimizers_to_device


# --- Lightning


def distributed_is_initialized() -> bool:
    """Whether the default process group is up (false, not an error, where ``torch.distributed`` is not built)."""
    return _distributed_is_initialized()


def running_loader(trainer: Trainer) -> Any:
    """The loader the running ``trainer.fit`` (or validate, test, predict) reads, as Lightning will request it."""
    loops: dict[TrainerFn | None, Any] = {
        TrainerFn.FITTING: trainer.fit_loop,
        TrainerFn.VALIDATING: trainer.validate_loop,
        TrainerFn.TESTING: trainer.test_loop,
        TrainerFn.PREDICTING: trainer.predict_loop,
    }
    loop = loops.get(trainer.state.fn)
    source = getattr(loop, "_data_source", None)  # Lightning's own record of where the loaders come from
    return source.dataloader() if source is not None and source.is_defined() else None


@contextmanager
def recording_log(module: LightningModule, record: Callable[..., None]) -> Iterator[None]:
    """Within, ``module.log`` (and so ``log_dict``) calls ``record`` with its arguments instead of logging."""
    module.log = record  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log  # the class's own method again


def replace_clipping(plugin: Precision, clip: Callable[[torch.optim.Optimizer, float], None]) -> None:
    """Make ``gradient_clip_algorithm="norm"`` run ``clip(optimizer, clip_val)``, after the plugin unscales."""
    plugin.clip_grad_by_norm = clip  # type: ignore[method-assign,assignment]


def set_device_mesh(module: LightningModule, mesh: DeviceMesh) -> None:
    """Make ``module.device_mesh`` return ``mesh``, as Lightning's ``ModelParallelStrategy`` sets it (no setter)."""
    module._device_mesh = mesh


# --- torchmetrics


def metric_step_value(metric: Metric) -> Any:
    """The step value of the user's last ``metric(preds, target)`` call, ``None`` if it was not called."""
    return metric._forward_cache


def set_metric_step_value(metric: Metric, value: torch.Tensor) -> None:
    """Make Lightning log ``value`` as ``metric``'s step value (it reads the forward cache)."""
    metric._forward_cache = value  # type: ignore[assignment]


def load_metric_state(metric: Metric, state: dict[str, Any], update_count: int, step_value: torch.Tensor) -> None:
    """Make ``metric`` hold another instance's accumulated ``state``, update count and step value.

    ``merge_state`` would add to the state rather than replace it, and refuses metrics with ``full_state_update``.
    """
    for key, value in state.items():
        setattr(metric, key, value)
    # compute() reads the update count (it warns before any update) and caches its result: both must follow the state.
    metric._update_count = update_count
    metric._forward_cache = step_value  # type: ignore[assignment]
    metric._computed = None


def worker_output(
    best_model_path: Any, weights_path: Any, trainer_state: Any, trainer_results: Any, extra: dict[str, Any]
) -> Any:
    """What a worker of Lightning's multiprocessing launcher hands back to the launching process."""
    return _WorkerOutput(best_model_path, weights_path, trainer_state, trainer_results, extra)
