"""``self.log`` in a pipeline: recorded on the last stage, replayed on every stage.

Only the last stage computes the loss and the metrics, but Lightning expects every rank to log the same keys: a
``sync_dist`` reduction is a collective, ``ModelCheckpoint(monitor=...)`` and ``EarlyStopping`` agree through
collectives, and the progress bar and loggers live on global rank 0. So during a step the strategy records each
``self.log`` call of the user's step on the last stage, sends the records to the other stages of the pipeline, and
every stage replays them through the real ``LightningModule.log`` in the same order.

A key logged once per micro-batch becomes one value, the micro-batches' values weighted by their share of the batch
(or by the ``loss_weight`` the step returned, see :mod:`lightning_gpipe.strategy`), which is what the user's code
would have logged for the whole batch (exactly so for means). The values stay on the device until the step ends and
then move to the host together, once per step: logging never synchronizes the device per micro-batch.

A torchmetrics ``Metric`` is logged as the object itself on every stage. Its step value (``on_step=True``) is the
whole batch's: a twin of the metric, updated with every micro-batch's inputs of the step, computes it (the
micro-batches' own values would not average to it for metrics such as F1 or macro accuracy). For the epoch value the
last stage sends its accumulated state, and the other stages copy it into their own instance of the same attribute,
so every rank computes the same epoch value.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from numbers import Number
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torchmetrics import Metric

from lightning_gpipe.compat import load_metric_state, metric_step_value, recording_log, set_metric_step_value
from lightning_gpipe.engine.collectives import broadcast_object, portable, to_device
from lightning_gpipe.engine.errors import collective_errors
from lightning_gpipe.engine.layout import ProcessLayout

__all__ = ["LogRecorder", "LoggedValue", "mirror_logs", "sharing_from_last_stage", "sync_metrics_over"]

_LOG_SIGNATURE = inspect.signature(LightningModule.log)
_OPTIONS = frozenset(_LOG_SIGNATURE.parameters) - {"self", "name", "value"}

# One twin per Metric computes step values; made once (a deep copy), reset every step.
_TWINS: weakref.WeakKeyDictionary[Metric, Metric] = weakref.WeakKeyDictionary()


@dataclass
class LoggedValue:
    """One key's values over the micro-batches that logged it (on the device), its options, and its Metric if any."""

    options: dict[str, Any]
    positions: list[int] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    metric: Metric | None = field(default=None, repr=False)
    batch_sizes: list[Any] = field(default_factory=list)  # each micro-batch's `batch_size=`, where given

    def combine(self, weights: torch.Tensor) -> torch.Tensor:
        """The weighted mean of the values, micro-batch ``i`` weighing ``weights[i]``; stays on the device."""
        device = weights.device
        if all(value.device == device for value in self.values):
            values = torch.stack(self.values)
        else:  # logged numbers wait on the host: one copy per key and step, not one per micro-batch
            values = torch.stack([value.cpu() for value in self.values]).to(device)
        chosen = weights.to(values.dtype)
        if self.positions != list(range(len(weights))):  # a key logged by some micro-batches only
            chosen = chosen[torch.tensor(self.positions, device=device)]
        return (values * chosen).sum() / chosen.sum()


def _as_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, Metric):
        cached = metric_step_value(value)  # the step value from the user's `metric(preds, target)` call
        value = cached if cached is not None else value.compute()
    if isinstance(value, torch.Tensor):
        # float64 where the device has it: a sum of many micro-batches' values keeps its precision.
        dtype = torch.float32 if value.device.type == "mps" else torch.float64
        return value.detach().reshape(-1)[0].to(dtype) if value.numel() == 1 else None
    if isinstance(value, Number):
        return torch.tensor(float(value), dtype=torch.float64)  # type: ignore[arg-type]  # on the host until combine
    return None


class LogRecorder:
    """Captures the ``self.log`` calls of a LightningModule's step, one micro-batch at a time.

    Args:
        module: the LightningModule whose ``log`` is captured.
        step_values: whether ``on_step`` defaults to true, as in ``training_step``: a logged Metric's step value is
            then computed for the whole batch.
    """

    def __init__(self, module: LightningModule, step_values: bool = True) -> None:
        self.module = module
        self.step_values = step_values
        self.values: dict[str, LoggedValue] = {}
        self._inputs: dict[int, list[tuple[tuple, dict]]] = {}  # id(metric) -> each micro-batch's forward inputs
        self._combined: dict[str, torch.Tensor] = {}
        self._metrics = [child for child in module.modules() if isinstance(child, Metric)]  # once per step

    @contextmanager
    def capture(self, position: int) -> Iterator[None]:
        """Record, instead of logging, every ``self.log`` (and so ``self.log_dict``) call made inside.

        ``position`` is the micro-batch's index in the step; :meth:`combine` weighs it.
        """

        def record(name: str, value: Any, *positional: Any, **keywords: Any) -> None:
            if positional or not _OPTIONS.issuperset(keywords):
                # Lightning's own signature tells which option a positional argument is (prog_bar, logger, ...),
                # and refuses unknown ones as Lightning would. Binding costs ~0.1 ms, so only when needed.
                bound = _LOG_SIGNATURE.bind(self.module, name, value, *positional, **keywords)
                options = {key: item for key, item in bound.arguments.items() if key not in ("self", "name", "value")}
            else:
                options = keywords
            tensor = _as_tensor(value)
            if tensor is None:
                raise TypeError(
                    f"self.log({name!r}, ...) got a {type(value).__name__}"
                    f"{' of ' + str(value.numel()) + ' elements' if isinstance(value, torch.Tensor) else ''}; log "
                    "one-element tensors, numbers or Metrics"
                )
            entry = self.values.get(name)
            if entry is None:
                entry = self.values[name] = LoggedValue(options)
            entry.positions.append(position)
            entry.values.append(tensor)
            entry.options = options
            entry.metric = value if isinstance(value, Metric) else None
            if options.get("batch_size") is not None:
                # In Lightning's epoch mean the step's value weighs as the whole batch: its micro-batches' sizes summed.
                entry.batch_sizes.append(options["batch_size"])
                entry.options = {**options, "batch_size": sum(entry.batch_sizes)}

        def remember_inputs(metric: Metric, args: tuple, kwargs: dict) -> None:
            self._inputs.setdefault(id(metric), []).append((args, kwargs))

        hooks = [metric.register_forward_pre_hook(remember_inputs, with_kwargs=True) for metric in self._metrics]
        try:
            with recording_log(self.module, record):
                yield
        finally:
            for hook in hooks:
                hook.remove()

    def forget(self, position: int) -> None:
        """Drop what micro-batch ``position`` logged (a run of its step that did not finish, and runs again)."""
        for name in list(self.values):
            entry = self.values[name]
            kept = [k for k, at in enumerate(entry.positions) if at != position]
            entry.positions = [entry.positions[k] for k in kept]
            entry.values = [entry.values[k] for k in kept]
            if not kept:
                del self.values[name]

    def combine(self, weights: torch.Tensor) -> None:
        """Combine every key's micro-batch values, micro-batch ``i`` weighing ``weights[i]`` (on the device)."""
        self._combined = {name: entry.combine(weights) for name, entry in self.values.items()}
        for name, entry in self.values.items():
            metric = entry.metric
            if metric is None or not self._logs_step(entry.options):
                continue
            inputs = self._inputs.get(id(metric))
            if inputs:  # the Metric was called in the step: its whole-batch value, from a twin fed every input
                self._combined[name] = _step_value(metric, inputs)

    def _logs_step(self, options: Mapping[str, Any]) -> bool:
        on_step = options.get("on_step")
        return bool(on_step) if on_step is not None else self.step_values

    def portable(self, extra: Mapping[str, torch.Tensor] | None = None) -> tuple[list[tuple[str, Any, dict]], dict]:
        """The combined values, and the one-element tensors in ``extra``, in a form another process can receive.

        Every value crosses to the host in one transfer.
        """
        extra = dict(extra or {})
        names = [*self._combined, *extra]
        scalars = [*self._combined.values(), *extra.values()]
        host = dict(zip(names, torch.stack([s.to(torch.float64) for s in scalars]).cpu(), strict=True)) if names else {}
        paths = {id(child): path for path, child in self.module.named_modules()}
        records: list[tuple[str, Any, dict[str, Any]]] = []
        for name, entry in self.values.items():
            if entry.metric is not None:
                metric = entry.metric
                state = {key: _to_cpu(value) for key, value in metric.metric_state.items()}
                records.append(
                    (name, _MetricState(paths[id(metric)], state, metric.update_count, host[name]), entry.options)
                )
            else:
                records.append((name, host[name], entry.options))
        return records, {name: host[name] for name in extra}

    def replay_own(self) -> None:
        """Log the combined values on the stage that recorded them."""
        for name, entry in self.values.items():
            value = self._combined[name]
            if entry.metric is not None:
                set_metric_step_value(entry.metric, value.to(torch.float32))  # what Lightning logs
                self.module.log(name, entry.metric, **entry.options)
            else:
                self.module.log(name, value.to(self.module.device, torch.float32), **entry.options)

    @staticmethod
    def replay(module: LightningModule, records: list[tuple[str, Any, dict[str, Any]]]) -> None:
        """Log records that another stage recorded; Metrics take the sender's state first."""
        for name, value, options in records:
            if isinstance(value, _MetricState):
                module.log(name, value.load_into(module), **options)
            else:
                module.log(name, value.to(device=module.device, dtype=torch.float32), **options)


def mirror_logs(
    recorder: LogRecorder,
    last: bool,
    share: Callable[[Any], Any] | None,
    scalars: Mapping[str, torch.Tensor] | None = None,
    other: Any = None,
) -> tuple[dict[str, torch.Tensor], Any]:
    """Log the last stage's step logs on every stage, and share ``scalars``, ``other`` and ``trainer.should_stop``.

    ``last`` says whether this is the last stage; ``share(payload)`` sends the last stage's payload to the pipeline's
    other stages and returns it everywhere (``None`` for a pipeline of one stage). The last stage alone runs the
    user's code after the sequence's call, so a decision it takes there (``self.trainer.should_stop = True`` in
    ``training_step``) reaches the other stages here, or they would wait for a batch that never comes. Returns
    ``(scalars, other)`` as the last stage gave them.
    """
    trainer = recorder.module.trainer
    if last:
        # Share first: a `sync_dist=True` log runs world collectives, which the other stages join only once they
        # have the records to replay (logging first deadlocks, on gloo as on NCCL).
        if share is not None:
            records, host = recorder.portable(scalars)
            share((records, host, trainer.should_stop, other))
        recorder.replay_own()
        return dict(scalars or {}), other
    assert share is not None
    records, host, should_stop, other = share(None)
    LogRecorder.replay(recorder.module, records)
    trainer.should_stop = trainer.should_stop or should_stop
    return host, other


def sharing_from_last_stage(layout: ProcessLayout, group: Any, device: torch.device) -> Callable[[Any], Any] | None:
    """The ``share`` of :func:`mirror_logs` for this rank: a broadcast over its pipeline's ``group`` from its last
    stage, received onto ``device``; ``None`` for a pipeline of one stage."""
    if layout.pipe_size == 1:
        return None
    source = layout.last_stage_rank

    def share(payload: Any) -> Any:
        # Sent on the CPU (pickled CUDA tensors would be restored on the sender's GPU), received onto this rank's.
        sent = portable(payload) if layout.rank == source else None
        with collective_errors(
            layout.stage, f"receiving the step's loss and logs from the last stage (global rank {source})"
        ):
            received = broadcast_object(sent, source, group)
        return payload if layout.rank == source else to_device(received, device)

    return share


def sync_metrics_over(module: torch.nn.Module, group: Any) -> None:
    """Make every torchmetrics ``Metric`` in ``module`` sync its state over ``group``, the replicas of its stage.

    Metric state lives on the last stage of each pipeline; over the world, the other stages would never join: a hang.
    """
    for metric in module.modules():
        if isinstance(metric, Metric):
            metric.process_group = group


def _step_value(metric: Metric, inputs: list[tuple[tuple, dict]]) -> torch.Tensor:
    twin = _TWINS.get(metric)
    if twin is None:
        # A deep copy, sharing what cannot be copied: the process group the strategy gave the metric.
        group = getattr(metric, "process_group", None)
        twin = _TWINS[metric] = copy.deepcopy(metric, {id(group): group} if group is not None else None)
        # A step value is this rank's batch alone, as torchmetrics' own forward computes it: no sync with replicas.
        twin.distributed_available_fn = lambda: False
    twin.reset()
    for args, kwargs in inputs:
        twin.update(*args, **kwargs)
    value = twin.compute()
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise TypeError(
            f"the Metric {type(metric).__name__} computes a {type(value).__name__}, not one value: log one of its "
            "values"
        )
    return value.detach().reshape(())


@dataclass
class _MetricState:
    """A torchmetrics Metric's accumulated state, addressed by its attribute path in the module."""

    path: str
    state: dict[str, Any]
    update_count: int
    forward_cache: torch.Tensor

    def load_into(self, module: LightningModule) -> Metric:
        metric = module.get_submodule(self.path)
        assert isinstance(metric, Metric)
        state = {key: _to_device(value, module.device) for key, value in self.state.items()}
        step_value = _to_device(self.forward_cache, module.device).to(torch.float32)
        load_metric_state(metric, state, self.update_count, step_value)
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
