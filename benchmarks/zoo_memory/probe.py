"""One memory probe: two real training steps of a scaled-down zoo model in one setting, counted in exact tensor bytes.

The settings and models are in :mod:`benchmarks.zoo_memory.scales`. Memory is counted by
``lightning_gpipe.profile.layer_profile.LiveTensorBytes`` (a ``TorchDispatchMode`` that sees every operator and frees a
storage's bytes when it dies): independent of the allocator and of the machine's load. The first step creates the
gradients and the optimizer state (gradients are zeroed in place, so they stay allocated); the second step's peak is
the one reported: parameters + batch + everything alive at that step's worst moment.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

import zoo
from benchmarks.zoo_memory.scales import MODELS, SEQUENCE_LENGTH, ModelScale, Probe
from lightning_gpipe.engine.pipeline import Pipeline
from lightning_gpipe.engine.thread_transport import ThreadTransport
from lightning_gpipe.engine.transport import ProcessGroupTransport
from lightning_gpipe.partition.balance import balance_by_cost, split
from lightning_gpipe.profile.cost import memory_cost
from lightning_gpipe.profile.tensor_bytes import LiveTensorBytes

__all__ = ["ProbeResult", "measure_rank"]


@dataclass(frozen=True)
class ProbeResult:
    """Bytes on one rank: the peak of everything alive, and how it splits (all exact tensor-storage bytes)."""

    rank: int
    layers: int  # entries of the model's flat sequence on this rank
    parameters: int  # parameter count on this rank
    parameter_bytes: int
    state_bytes: int  # parameters + gradients + optimizer state + buffers: the paper's "model parameter memory"
    batch_bytes: int
    peak_bytes: int  # parameters + batch + the peak of everything allocated during the measured step

    @property
    def activation_bytes(self) -> int:
        """The peak minus model state and batch: what activations (and transient buffers) held at the peak."""
        return self.peak_bytes - self.state_bytes - self.batch_bytes

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "activation_bytes": self.activation_bytes}


def _batch(model: str, scale: ModelScale) -> Any:
    generator = torch.Generator().manual_seed(0)
    fixed = dict(scale.fixed)
    if model == "transformer_lm":
        return torch.randint(4, fixed["vocab_size"], (scale.batch_size, SEQUENCE_LENGTH + 1), generator=generator)
    size = fixed["image_size"]
    images = torch.randn(scale.batch_size, 3, size, size, generator=generator)
    return images, torch.randint(0, fixed["num_classes"], (scale.batch_size,), generator=generator)


def _objective(module: zoo.ZooModule) -> tuple[Any, Any]:
    """``(input_fn, loss_fn)`` of the module's own training step, in the engine's terms."""
    if isinstance(module, zoo.TransformerLM):
        return (lambda batch: batch[:, :-1]), (lambda logits, batch: module._loss(logits, batch[:, 1:]))
    assert isinstance(module, zoo.ImageClassifier)
    return (lambda batch: batch[0]), (lambda outputs, batch: module.loss(outputs, batch[1])[0])


def _optimizer(module: zoo.ZooModule, parameters: list[nn.Parameter]) -> torch.optim.Optimizer:
    if isinstance(module, zoo.TransformerLM):
        return torch.optim.Adam(parameters, lr=5e-4, betas=(0.9, 0.98), eps=1e-9)  # the zoo's Transformer recipe
    from timm.optim import RMSpropTF

    return RMSpropTF(parameters, lr=0.015, alpha=0.9, eps=1.0, momentum=0.9)  # the zoo's AmoebaNet recipe


def _tensor_bytes(tensors: list[Tensor]) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _state_bytes(parameters: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> int:
    tensors: list[Tensor] = list(parameters)
    tensors += [p.grad for p in parameters if p.grad is not None]
    for state in optimizer.state.values():
        tensors += [value for value in state.values() if isinstance(value, Tensor)]
    return _tensor_bytes(tensors)


def _frozen_bytes(layers: nn.Module) -> int:
    # Buffers (BatchNorm statistics) and parameters without gradients are resident too, outside the optimizer's view.
    return _tensor_bytes([*layers.buffers(), *(p for p in layers.parameters() if not p.requires_grad)])


def _stage_cell(layers: nn.Sequential, scale: ModelScale, batch: Any, input_fn: Any, rank: int) -> nn.Sequential:
    micro = input_fn(batch)[: max(1, scale.batch_size // scale.chunks)]
    costs = memory_cost(layers, micro, optimizer_slots=scale.slots)
    return split(layers, balance_by_cost(costs, 2))[rank]


def measure_rank(rank: int, world_size: int, probe: Probe) -> dict[str, int]:
    """Build the model, train two steps in ``probe.setting``, and return this rank's :class:`ProbeResult` as a dict."""
    torch.manual_seed(0)
    scale = MODELS[probe.model]
    module = scale.build(probe.size)
    module.train()
    batch = _batch(probe.model, scale)
    input_fn, loss_fn = _objective(module)
    layers: nn.Sequential = module.layers
    if probe.setting == "pipeline-2":
        layers = _stage_cell(layers, scale, batch, input_fn, rank)
    parameters = [p for p in layers.parameters() if p.requires_grad]
    optimizer = _optimizer(module, parameters)

    if probe.setting == "naive-1":

        def step() -> None:
            loss_fn(layers(input_fn(batch)), batch).backward()

    else:
        transport = ProcessGroupTransport([0, 1]) if world_size == 2 else ThreadTransport.create(1)[0]
        pipeline = Pipeline(layers, transport, chunks=scale.chunks, checkpoint="always")

        def step() -> None:
            pipeline.train_step(batch, loss_fn, input_fn)

    # The first step allocates the gradients (zeroed in place from then on) and the optimizer state; the second is
    # the steady state, counted from its start (the dispatch mode slows every operator, so only it is counted).
    optimizer.zero_grad(set_to_none=False)
    step()
    optimizer.step()
    resident = _state_bytes(parameters, optimizer) + _frozen_bytes(layers)
    counter = LiveTensorBytes()
    with counter:
        optimizer.zero_grad(set_to_none=False)
        step()
        optimizer.step()
    parameter_bytes = _tensor_bytes(list(layers.parameters()))
    batch_tensors = [batch] if isinstance(batch, Tensor) else list(batch)
    batch_bytes = _tensor_bytes(batch_tensors)
    result = ProbeResult(
        rank=rank,
        layers=len(layers),
        parameters=sum(p.numel() for p in layers.parameters()),
        parameter_bytes=parameter_bytes,
        state_bytes=resident,
        batch_bytes=batch_bytes,
        peak_bytes=resident + batch_bytes + counter.peak,
    )
    return result.to_dict()
