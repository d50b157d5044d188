"""Tiny sequential models for engine and strategy tests: plain, with dropout, and with nested boundary values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_gpipe.engine.microbatch import scatter
from lightning_gpipe.engine.unbatched import Unbatched

IN, HIDDEN, OUT = 6, 12, 3


def mlp() -> nn.Sequential:
    """8 layers, so that 1, 2 and 4 stages all get whole layers."""
    return nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, OUT),
    )  # fmt: skip


def dropout_mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.Dropout(0.3), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN),
        nn.Dropout(0.3), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, OUT),
    )  # fmt: skip


class Fork(nn.Module):
    """x -> (hidden, {"skip": projection, "mask": bool}, None): a nested boundary value with a non-float tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.skip = nn.Linear(IN, HIDDEN), nn.Linear(IN, HIDDEN)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], None]:
        return self.hidden(x), {"skip": self.skip(x), "mask": x[:, :1] > 0}, None


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, value: tuple[torch.Tensor, dict[str, torch.Tensor], None]) -> tuple[Any, ...]:
        hidden, extras, nothing = value
        return torch.tanh(self.linear(hidden)) * extras["mask"] + extras["skip"], extras, nothing


class Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, OUT)

    def forward(self, value: tuple[torch.Tensor, dict[str, torch.Tensor], None]) -> torch.Tensor:
        hidden, extras, _ = value
        return self.linear(hidden + extras["skip"])


def nested() -> nn.Sequential:
    return nn.Sequential(Fork(), Mix(), Mix(), Mix(), Join())


MODELS = {"mlp": mlp, "dropout": dropout_mlp, "nested": nested}
BALANCES = {"mlp": {1: [8], 2: [4, 4], 4: [2, 2, 2, 2]}, "nested": {1: [5], 2: [3, 2], 4: [2, 1, 1, 1]}}
BALANCES["dropout"] = BALANCES["mlp"]


class WithTable(nn.Module):
    """Adds a (4, 8) table to its output and passes it on marked `Unbatched`: dim 0 is not the batch's."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 8)
        self.table = nn.Parameter(torch.randn(4, 8) / 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Unbatched]:
        return torch.tanh(self.linear(x)), Unbatched(self.table * 2)


def build(name: str, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return MODELS[name]()


def batch(size: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, IN, generator=generator), torch.randn(size, OUT, generator=generator)


def loss_fn(output: torch.Tensor, microbatch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(output, microbatch[1])


def cells(model: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    bounds = [sum(balance[:k]) for k in range(len(balance) + 1)]
    return [model[bounds[k] : bounds[k + 1]] for k in range(len(balance))]


def full_batch_grads(model: nn.Sequential, data: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Gradients of the unpartitioned model on the whole mini-batch: the reference for transparency."""
    model.zero_grad()
    loss_fn(model(data[0]), data).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def stage_stream_grads(
    model: nn.Sequential, balance: Sequence[int], data: Any, chunks: int, seeds: Sequence[int]
) -> dict[str, torch.Tensor]:
    """The reference for random layers: the unpartitioned model's function, with the random numbers that a pipeline
    whose stage ``k`` draws from a generator seeded ``seeds[k]`` uses (micro-batches in order on every stage).

    Dropout masks differ between any two layouts by construction; what must hold is that the pipeline computes this
    function exactly, recomputation included.
    """
    model.zero_grad()
    microbatches = scatter(data, chunks)
    activations = [mb.value[0] for mb in microbatches]
    for cell, seed in zip(cells(model, balance), seeds, strict=True):
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            activations = [cell(a) for a in activations]
    loss = sum(mb.weight * loss_fn(a, mb.value) for a, mb in zip(activations, microbatches, strict=True))
    loss.backward()  # type: ignore[union-attr]
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, the transparency measure."""
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))
