"""Re-materialization: modes, what is recomputed, side effects not repeated, and composition with DDP."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from helpers.runif import RunIf
from torch import nn

from lightning_gpipe.engine.rematerialization import checkpoint_stop, checkpointed, is_recomputing, validate_mode
from tools.launch import run_processes


@pytest.mark.parametrize(("mode", "expected"), [("always", 4), ("except_last", 3), ("never", 0)])
def test_checkpoint_stop(mode: str, expected: int) -> None:
    assert checkpoint_stop(validate_mode(mode), 4) == expected
    assert checkpoint_stop(validate_mode(mode), 1) == min(expected, {"always": 1}.get(mode, 0))


def test_unknown_mode_names_the_valid_ones() -> None:
    with pytest.raises(
        ValueError, match=r"checkpoint='sometimes' is not a re-materialization mode; use one of 'always'"
    ):
        validate_mode("sometimes")


class Probe(nn.Module):
    """Records, for every call, whether it ran as a recomputation."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.calls: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(is_recomputing())
        return self.linear(x)


def test_forward_is_replayed_in_backward_and_flagged() -> None:
    probe = Probe()
    checkpointed(nn.Sequential(probe, nn.Tanh(), nn.Linear(3, 1)), torch.randn(4, 3)).sum().backward()
    assert probe.calls == [False, True]
    assert not is_recomputing()


def test_plain_batch_norm_counts_a_recomputed_micro_batch_once() -> None:
    cell = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))
    reference = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))
    reference.load_state_dict(cell.state_dict())
    x = torch.randn(8, 4)
    checkpointed(cell, x).sum().backward()
    reference(x).sum().backward()
    for key in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        assert torch.equal(cell.state_dict()[key], reference.state_dict()[key]), key


def test_non_float_values_pass_through() -> None:
    cell = nn.Sequential(nn.Identity())
    mask = torch.tensor([True, False])
    assert torch.equal(checkpointed(cell, mask), mask)


def _ddp_worker(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    cell = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 2))
    ddp = nn.parallel.DistributedDataParallel(cell)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):  # two iterations: DDP's "mark a variable ready only once" check fires on the second
        ddp.zero_grad()
        checkpointed(ddp, x).pow(2).mean().backward()
    return {name: p.grad for name, p in cell.named_parameters()}


@RunIf(multiprocess=True)
def test_rematerialization_composes_with_ddp() -> None:
    # Reentrant checkpointing inside DDP fails with "Expected to mark a variable ready only once"
    # (torchgpipe#16, PyTorch Pipe's documented limit); non-reentrant does not, and DDP still averages.
    grads = run_processes(_ddp_worker, 2, timeout=300)
    for name in grads[0]:
        assert torch.allclose(torch.from_numpy(grads[0][name]), torch.from_numpy(grads[1][name])), name


@dataclasses.dataclass
class Boundary:
    hidden: torch.Tensor
    extras: dict[str, torch.Tensor]


class Tensors(dict):  # type: ignore[type-arg]
    """A dict subclass: a boundary container that torch's pytree does not open."""


class Noisy(nn.Module):
    """Dropout on every tensor of a dataclass boundary value."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.dropout = nn.Dropout(0.5)

    def forward(self, value: Boundary) -> torch.Tensor:
        return self.dropout(self.linear(value.hidden)) + self.dropout(value.extras["skip"])


def _boundary(device: str) -> Boundary:
    hidden = torch.randn(6, 4, device=device, requires_grad=True)
    return Boundary(hidden, Tensors(skip=torch.randn(6, 4, device=device, requires_grad=True)))


def test_every_tensor_of_a_dataclass_boundary_reaches_torch_rng_saving(monkeypatch: pytest.MonkeyPatch) -> None:
    # R6: torch finds the CUDA devices whose RNG it saves by walking the checkpoint's arguments with pytree, which
    # stops at dataclasses and dict subclasses: handed the value as one argument, it saw no tensor at all.
    seen: list[torch.Tensor] = []
    infer = torch.utils.checkpoint._infer_device_type

    def recording(*args: Any) -> str:
        seen.extend(leaf for leaf in pytree.tree_leaves(args) if isinstance(leaf, torch.Tensor))
        return infer(*args)

    monkeypatch.setattr(torch.utils.checkpoint, "_infer_device_type", recording)
    value = _boundary("cpu")
    checkpointed(Noisy(), value).sum().backward()
    assert {id(t) for t in seen} >= {id(value.hidden), id(value.extras["skip"])}


def _dropout_replay_grads(device: str, rematerialize: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    cell = Noisy().to(device)
    value = _boundary(device)
    torch.manual_seed(1)  # the CPU and CUDA generators start alike for both runs
    output = checkpointed(cell, value) if rematerialize else cell(value)
    output.pow(2).sum().backward()
    return [cell.linear.weight.grad, value.hidden.grad, value.extras["skip"].grad]  # type: ignore[list-item]


def _assert_dataclass_boundary_replays_dropout(device: str) -> None:
    replayed = _dropout_replay_grads(device, rematerialize=True)
    for got, expected in zip(replayed, _dropout_replay_grads(device, rematerialize=False), strict=True):
        assert torch.equal(got, expected)


def test_dataclass_boundary_replays_dropout_masks_on_cpu() -> None:
    _assert_dataclass_boundary_replays_dropout("cpu")


@RunIf(gpu=True)
def test_dataclass_boundary_replays_dropout_masks_on_cuda() -> None:
    # R6 on CUDA: without the CUDA generator's state the replay drew new masks and the gradients were silently wrong.
    _assert_dataclass_boundary_replays_dropout("cuda")
