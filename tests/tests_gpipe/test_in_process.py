"""The in-process runner: each thread-stage keeps its own random streams and device, as a process of its own would."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers.models import BALANCES, batch, build, cells, full_batch_grads, loss_fn, relative_error
from helpers.runif import RunIf
from torch import nn

from lightning_gpipe.engine.microbatch import scatter
from lightning_gpipe.engine.pipeline import run_in_threads


def _dropout_only_step(mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of two stages of dropout alone: the output, and the gradient of its sum with respect to the input."""
    stages = [nn.Sequential(nn.Dropout(0.5), nn.Dropout(0.5)) for _ in range(2)]
    x = torch.ones(32, 2048, requires_grad=True)
    outputs: list[torch.Tensor] = []

    def loss(output: torch.Tensor, microbatch: Any) -> torch.Tensor:
        outputs.append(output.detach())
        return output.sum()

    run_in_threads(stages, (x,), loss, chunks=8, checkpoint=mode)
    assert x.grad is not None
    return torch.cat(outputs), x.grad


@pytest.mark.parametrize("mode", ["except_last", "always"])
def test_gradients_follow_the_forward_masks_without_seeds(mode: str) -> None:
    # C2: without seeds the stages drew from torch's shared generator while the other thread drew too, so a
    # re-materialized forward replayed other dropout masks than its first run (20 of 20 steps here before the fix).
    # The output is zero exactly where the input's gradient is, as in torchgpipe's test_parallel_randoms.
    for _ in range(3):
        output, grad = _dropout_only_step(mode)
        assert torch.equal(output != 0, grad != 0)


def _dropout_grads(**kwargs: Any) -> dict[str, torch.Tensor]:
    model = build("dropout")
    torch.manual_seed(5)
    run_in_threads(cells(model, BALANCES["dropout"][4]), batch(), loss_fn, chunks=4, **kwargs)
    return {name: p.grad.clone() for name, p in model.named_parameters()}  # type: ignore[union-attr]


def test_without_seeds_steps_are_deterministic_and_draw_anew() -> None:
    first, again = _dropout_grads(checkpoint="except_last"), _dropout_grads(checkpoint="never")
    for name in first:
        assert torch.equal(first[name], again[name]), name
    model = build("dropout")
    torch.manual_seed(5)
    grads = []
    for _ in range(2):  # the caller's generator moves on, so the next step draws other masks
        model.zero_grad()
        run_in_threads(cells(model, BALANCES["dropout"][4]), batch(), loss_fn, chunks=4)
        grads.append(model[0].weight.grad.clone())  # type: ignore[union-attr]
    assert not torch.equal(grads[0], grads[1])


def noisy_input(microbatch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return microbatch[0] + 0.1 * torch.randn_like(microbatch[0])


def dropout_loss(output: torch.Tensor, microbatch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(F.dropout(output, 0.5), microbatch[1])


def one_process_per_stage_grads(model: nn.Sequential, balance: Sequence[int], seeds: Sequence[int]) -> dict[str, Any]:
    """What stage ``j`` seeded ``seeds[j]`` computes in a process of its own, in its order of calls: stage 0 draws
    ``noisy_input`` before each micro-batch's forward, the last stage ``dropout_loss`` after each."""
    microbatches = scatter(batch(), 4)
    stages = cells(model, balance)
    activations: list[Any] = [mb.value for mb in microbatches]
    losses = []
    for j, (cell, seed) in enumerate(zip(stages, seeds, strict=True)):
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            outputs = []
            for a, mb in zip(activations, microbatches, strict=True):
                outputs.append(cell(noisy_input(a) if j == 0 else a))
                if j == len(stages) - 1:
                    losses.append(dropout_loss(outputs[-1], mb.value) * mb.weight)
            activations = outputs
    model.zero_grad()
    torch.stack(losses).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", ["always", "never"])
def test_input_fn_and_loss_fn_draw_from_their_stage_stream(mode: str) -> None:
    # C3: input_fn and loss_fn ran outside the stage's private stream, so random augmentation or a random loss drew
    # other numbers than with one process per stage (and could steal numbers from another stage's stream).
    seeds = [3, 4]
    reference = one_process_per_stage_grads(build("dropout"), [4, 4], seeds)
    model = build("dropout")
    run_in_threads(
        cells(model, [4, 4]), batch(), dropout_loss, chunks=4, input_fn=noisy_input, checkpoint=mode, seeds=seeds
    )
    for name, expected in reference.items():
        assert relative_error(model.get_parameter(name).grad, expected) <= 1e-6, name  # type: ignore[arg-type]


def _single_device_grads(name: str, device: str) -> dict[str, torch.Tensor]:
    model = build(name).to(device)
    x, y = batch()
    return full_batch_grads(model, (x.to(device), y.to(device)))


@RunIf(gpu=True)
@pytest.mark.parametrize("devices", [["cuda", "cuda"], ["cpu", "cuda"], ["cuda", "cpu"]])
@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
def test_cuda_stages_equal_single_device_gradients(devices: list[str], mode: str) -> None:
    # R8: the runner's transports received on the CPU and it swapped only the CPU generator, so CUDA cells failed
    # with a device mismatch (and dropout on them would not have been replayed).
    reference = _single_device_grads("mlp", "cuda")
    model = build("mlp")
    stages = [cell.to(device) for cell, device in zip(cells(model, [4, 4]), devices, strict=True)]
    run_in_threads(stages, batch(), loss_fn, chunks=4, checkpoint=mode)
    for name, expected in reference.items():
        error = relative_error(model.get_parameter(name).grad.cuda(), expected)  # type: ignore[union-attr]
        assert error <= 1e-5, f"{name}: relative error {error:.2e}"


@RunIf(gpu=True)
def test_cuda_stages_replay_dropout_exactly() -> None:
    # R8: each CUDA stage draws from its own CUDA stream, so re-materialization replays its masks bit for bit.
    grads = {}
    for mode in ("always", "never"):
        model = build("dropout").cuda()
        run_in_threads(cells(model, [4, 4]), batch(), loss_fn, chunks=4, checkpoint=mode, seeds=[1, 2])
        grads[mode] = {name: p.grad.clone() for name, p in model.named_parameters()}  # type: ignore[union-attr]
    for name in grads["never"]:
        assert torch.equal(grads["always"][name], grads["never"][name]), name


class _Waiter(nn.Module):
    """Stage 0's cell: in its second micro-batch, it waits (a while) for stage 1 to have computed.

    With ``during``, only what stage 1 computes during the wait counts: stages that take turns may well have run
    stage 1's first micro-batch between stage 0's two forwards (a loaded machine deschedules stage 0 after its send).
    """

    def __init__(self, other_ran: Any, wait: float, during: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.other_ran, self.wait, self.during, self.calls, self.overlapped = other_ran, wait, during, 0, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            if self.during:
                self.other_ran.clear()
            self.overlapped = self.other_ran.wait(self.wait)
        return self.linear(x)


class _Signal(nn.Module):
    def __init__(self, event: Any) -> None:
        super().__init__()
        self.linear, self.event = nn.Linear(2, 2), event

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.event.set()
        return self.linear(x)


@pytest.mark.parametrize("concurrent", [False, True])
def test_stages_take_turns_unless_concurrent(concurrent: bool) -> None:
    # Taking turns keeps each stage's random stream its own (C2) but hides the schedule's overlap, which notebook 04
    # measures: there the stages draw no random numbers and run concurrently, as devices would.
    event = threading.Event()
    # Concurrent: stage 1 computes its first micro-batch, before or during the wait. Taking turns: never during it.
    first = _Waiter(event, wait=10.0 if concurrent else 0.5, during=not concurrent)
    run_in_threads(
        [first, _Signal(event)],
        (torch.ones(4, 2), torch.ones(4, 2)),
        loss_fn,
        chunks=4,
        checkpoint="never",
        concurrent=concurrent,
    )
    assert first.overlapped is concurrent


def test_concurrent_stages_cannot_have_seeds_of_their_own() -> None:
    with pytest.raises(ValueError, match="concurrent=True shares torch's global random generators.*drop seeds"):
        run_in_threads(
            [nn.Linear(2, 2)] * 2,
            (torch.ones(4, 2), torch.ones(4, 2)),
            loss_fn,
            chunks=2,
            seeds=[0, 1],
            concurrent=True,
        )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_last_stage_drops_its_output_once_the_loss_holds_it(schedule: str) -> None:
    # Regression: Pipeline.train_step kept a reference to the last forward's output through the backward passes that
    # followed it, so a language model's logits (a micro-batch of them) stayed alive in every backward; the planner,
    # which counts the output as gone once the loss holds what its backward needs, was 14% under on the calibrated
    # Transformer's last stage at M = 1.
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    outputs: list[weakref.ref[torch.Tensor]] = []
    alive: list[list[bool]] = []

    def loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
        outputs.append(weakref.ref(output))
        return output.sum()  # its backward keeps no copy of the output

    layers[0].weight.register_hook(lambda grad: alive.append([ref() is not None for ref in outputs]))
    run_in_threads([layers], (torch.randn(4, 4), None), loss, chunks=2, checkpoint="never", schedule=schedule)
    assert len(alive) == 2  # one backward per micro-batch
    assert not any(flag for flags in alive for flag in flags), alive
