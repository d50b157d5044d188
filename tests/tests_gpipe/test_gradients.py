"""Gradient collectives: data-parallel averaging against DDP, and loss scaling that every rank agrees on."""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers.runif import RunIf
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from lightning_gpipe.engine.gradients import WorldGradScaler, average_gradients
from tools.launch import run_processes


class _Branches(nn.Module):
    """``shared`` always runs, ``sometimes`` only where asked, ``never`` is never used, ``frozen`` needs no grad."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 3)
        self.sometimes = nn.Linear(3, 3)
        self.never = nn.Linear(3, 3)
        self.frozen = nn.Linear(3, 3).requires_grad_(False)

    def forward(self, x: torch.Tensor, take_branch: bool) -> torch.Tensor:
        h = self.frozen(self.shared(x).tanh())
        return self.sometimes(h) if take_branch else h


def _step(model: nn.Module, rank: int) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
    model(x, take_branch=rank == 0).pow(2).sum().backward()


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: p.grad for name, p in model.named_parameters()}


def _average_like_ddp(rank: int, world_size: int) -> tuple[dict, dict]:
    torch.manual_seed(0)
    ours = _Branches()
    torch.manual_seed(0)
    reference = _Branches()
    ddp = nn.parallel.DistributedDataParallel(reference, find_unused_parameters=True)
    _step(ddp, rank)
    _step(ours, rank)
    # A tiny bucket size: every gradient travels in its own all-reduce, all of them in flight together.
    average_gradients(ours.parameters(), dist.group.WORLD, world_size, bucket_bytes=16)
    return _grads(ours), _grads(reference)


@RunIf(multiprocess=True)
def test_average_matches_ddp_when_a_parameter_is_unused_on_one_replica() -> None:
    # R17: a replica without a gradient for `sometimes` used to leave it out of the flat buffer, so the replicas
    # all-reduced buffers of different sizes (gloo fails, NCCL hangs or mixes unrelated values).
    for ours, reference in run_processes(_average_like_ddp, 2, timeout=300, pg_timeout=120):
        assert ours.keys() == reference.keys()
        for name, expected in reference.items():
            if expected is None:
                assert ours[name] is None, name  # unused everywhere (or frozen): no gradient, as under DDP
            else:
                torch.testing.assert_close(torch.as_tensor(ours[name]), torch.as_tensor(expected), msg=name)
    assert reference["sometimes.weight"] is not None  # the case under test happened


def _fused_overflow_on_one_rank(rank: int, world_size: int) -> dict[str, tuple[torch.Tensor, float]]:
    results = {}
    for scaler_class in (WorldGradScaler, ShardedGradScaler):
        parameter = nn.Parameter(torch.ones(4))
        optimizer = torch.optim.AdamW([parameter], lr=0.1, fused=True)
        scaler = scaler_class(device="cpu", init_scale=8.0)
        scaler.scale(torch.ones(()))  # the scale comes into being with the first scaled loss
        parameter.grad = torch.full((4,), 8.0)  # a scaled gradient
        if rank == 1:
            parameter.grad[0] = float("inf")  # an overflow on this rank only
        scaler.step(optimizer)
        scaler.update()
        results[scaler_class.__name__] = (parameter.detach().clone(), scaler.get_scale())
    return results


@RunIf(multiprocess=True)
def test_fused_optimizer_skips_the_step_on_every_rank_when_one_overflows() -> None:
    # R7: fused optimizers unscale inside their step, so Lightning never calls `unscale_` (where ShardedGradScaler
    # all-reduces the overflow flags); `_check_inf_per_device` decided per rank, and rank 0 stepped alone.
    results = run_processes(_fused_overflow_on_one_rank, 2, timeout=300, pg_timeout=120)
    for rank, by_scaler in enumerate(results):
        parameter, scale = by_scaler["WorldGradScaler"]
        assert torch.equal(torch.as_tensor(parameter), torch.ones(4)), f"rank {rank} stepped"
        assert scale == 4.0, f"rank {rank} kept scale {scale}"
    # What the scaler guards against, shown on torch's own: rank 0 steps and keeps its scale while rank 1 skips.
    parameter, scale = results[0]["ShardedGradScaler"]
    assert not torch.equal(torch.as_tensor(parameter), torch.ones(4))
    assert scale == 8.0


def test_like_copies_the_settings_and_scale() -> None:
    original = torch.amp.GradScaler("cpu", init_scale=512.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=7)
    scaler = WorldGradScaler.like(original, "cpu")
    assert (scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor()) == (512.0, 3.0, 0.25)
    assert scaler.get_growth_interval() == 7


def test_one_replica_is_left_alone() -> None:
    parameter = nn.Parameter(torch.ones(2))
    parameter.grad = torch.full((2,), 3.0)
    average_gradients([parameter], None, 1)  # type: ignore[arg-type]  # no group needed, none touched
    assert torch.equal(parameter.grad, torch.full((2,), 3.0))
