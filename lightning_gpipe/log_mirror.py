"""``self.log`` in a pipeline: recorded on the last stage, replayed on every stage.

Only the last stage computes the loss and the metrics, but Lightning expects every rank to log the same keys: a
``sync_dist`` reduction is a collective, ``ModelCheckpoint(monitor=...)`` and ``EarlyStopping`` agree through
collectives, and the progress bar and loggers live on global rank 0. So during a step the strategy records each
``self.log`` call of the user's step on the last stage, sends the records to the other stages of the pipeline, and
every stage replays them through the real ``LightningModule.log`` in the same order.

A key logged once per micro-batch becomes one value, the micro-batches' values weighted by their share of the batch,
which is what the user's code would have logged for the whole batch (exactly so for means). A torchmetrics ``Metric``
is logged as the object itself on every stage: the last stage sends its accumulated state, and the other stages copy
it into their own instance of the same attribute, so every rank computes the same epoch value.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from numbers import Number
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torchmetrics import Metric

__all__ = ["LogRecorder", "LoggedValue"]

_LOG_SIGNATURE = inspect.signature(LightningModule.log)


@dataclass
class LoggedValue:
    """One key's micro-batch values combined: weighted sum and total weight, its options, and its Metric if any."""

    weighted_sum: torch.Tensor
    weight: float
    options: dict[str, Any]
    metric: Metric | None = field(default=None, repr=False)

    @property
    def value(self) -> torch.Tensor:
        """The weighted mean of what was logged."""
        return self.weighted_sum / self.weight


def _as_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, Metric):
        cached = value._forward_cache  # the step value from the user's `metric(preds, target)` call
        value = cached if cached is not None else value.compute()
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64).cpu()
    if isinstance(value, Number):
        return torch.tensor(float(value), dtype=torch.float64)  # type: ignore[arg-type]
    return None


class LogRecorder:
    """Captures the ``self.log`` calls of a LightningModule's step, one micro-batch at a time."""

    def __init__(self, module: LightningModule) -> None:
        self.module = module
        self.values: dict[str, LoggedValue] = {}

    @contextmanager
    def capture(self, weight: float) -> Iterator[None]:
        """Record, instead of logging, every ``self.log`` (and so ``self.log_dict``) call made inside."""

        def record(name: str, value: Any, *positional: Any, **keywords: Any) -> None:
            # Lightning's own signature tells which option a positional argument is (prog_bar, logger, ...).
            bound = _LOG_SIGNATURE.bind(self.module, name, value, *positional, **keywords)
            options = {key: item for key, item in bound.arguments.items() if key not in ("self", "name", "value")}
            tensor = _as_tensor(value)
            if tensor is None:
                raise TypeError(
                    f"self.log({name!r}, ...) got a {type(value).__name__}; under GPipeStrategy logged values must be "
                    "tensors, numbers or torchmetrics Metrics, so that they can be sent to every stage"
                )
            entry = self.values.get(name)
            if entry is None:
                entry = self.values[name] = LoggedValue(torch.zeros_like(tensor), 0.0, options)
            entry.weighted_sum = entry.weighted_sum + weight * tensor
            entry.weight += weight
            entry.options = options
            entry.metric = value if isinstance(value, Metric) else None

        self.module.log = record  # type: ignore[method-assign]
        try:
            yield
        finally:
            del self.module.log  # the class's own method again

    def portable(self) -> list[tuple[str, Any, dict[str, Any]]]:
        """The combined values in a form that can be sent to another process: tensors, or a Metric's state."""
        paths = {id(child): path for path, child in self.module.named_modules()}
        records: list[tuple[str, Any, dict[str, Any]]] = []
        for name, entry in self.values.items():
            if entry.metric is not None:
                metric = entry.metric
                state = {key: _to_cpu(getattr(metric, key)) for key in metric._defaults}
                cache = _to_cpu(metric._forward_cache)
                records.append(
                    (name, _MetricState(paths[id(metric)], state, metric._update_count, cache), entry.options)
                )
            else:
                records.append((name, entry.value, entry.options))
        return records

    def replay_own(self) -> None:
        """Log the recorded values on the stage that recorded them."""
        for name, entry in self.values.items():
            value = entry.metric if entry.metric is not None else entry.value.to(self.module.device, torch.float32)
            self.module.log(name, value, **entry.options)

    @staticmethod
    def replay(module: LightningModule, records: list[tuple[str, Any, dict[str, Any]]]) -> None:
        """Log records that another stage recorded; Metrics take the sender's state first."""
        for name, value, options in records:
            if isinstance(value, _MetricState):
                module.log(name, value.load_into(module), **options)
            else:
                module.log(name, value.to(device=module.device, dtype=torch.float32), **options)


@dataclass
class _MetricState:
    """A torchmetrics Metric's accumulated state, addressed by its attribute path in the module."""

    path: str
    state: dict[str, Any]
    update_count: int
    forward_cache: Any

    def load_into(self, module: LightningModule) -> Metric:
        metric = module.get_submodule(self.path)
        assert isinstance(metric, Metric)
        for key, value in self.state.items():
            setattr(metric, key, _to_device(value, module.device))
        # torchmetrics' bookkeeping of updates and its cached step value: compute() reads both.
        metric._update_count = self.update_count
        metric._forward_cache = _to_device(self.forward_cache, module.device)
        metric._computed = None
        return metric


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, list):
        return [_to_cpu(item) for item in value]
    return value


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_to_device(item, device) for item in value]
    return value
