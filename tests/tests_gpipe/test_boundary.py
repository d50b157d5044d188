"""What crosses a stage boundary: tensors of any strides, optional leaves, shapes that vary per micro-batch, values
marked `Unbatched`, leaves on another device.

Each case is a two-stage model trained one step through the pipeline and compared with the unpartitioned model on
the whole batch. Strides matter only over gloo (threads copy tensors as they are), so the process test is the one
that catches a receive buffer that is not contiguous.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import pytest
import torch
from helpers.models import WithTable, cells, full_batch_grads, loss_fn, relative_error
from helpers.runif import RunIf
from torch import nn

from lightning_gpipe import Unbatched
from lightning_gpipe.engine.boundary import ActivationLink
from lightning_gpipe.engine.pipeline import Pipeline, run_in_threads
from lightning_gpipe.engine.thread_transport import ThreadTransport
from lightning_gpipe.engine.transport import ProcessGroupTransport
from tools.launch import run_processes

TOLERANCE = 1e-6
CHUNKS = 4
BATCH = 16  # micro-batches of 4 samples


class Permute(nn.Module):
    """A transpose at the boundary: the output is a non-contiguous view."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(0, 2, 3, 1)


class ChannelsLast(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous(memory_format=torch.channels_last)


class MaskOf(nn.Module):
    """Embeds ``x`` and returns ``(h, mask)``, the mask None when no sample is padded, as Hugging Face's helpers do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        padded = x[:, 0] > 0
        mask = (~padded).to(x.dtype)[:, None] if bool(padded.any()) else None
        return self.embed(x), mask


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, value: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
        h, mask = value
        h = torch.tanh(self.linear(h))
        return (h if mask is None else h * mask), mask


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 3)

    def forward(self, value: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        return self.linear(value[0])


class Trim(nn.Module):
    """Cuts the zero padding after the longest sequence of its input: per micro-batch under the pipeline, per batch
    in the plain model, so the boundary's dim 1 varies between the micro-batches of a step."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x: (B, T, 6), zero after each length
        real = x.abs().sum(-1) > 0  # (B, T)
        width = int(real.sum(1).max())
        return x[:, :width], real[:, :width].to(x.dtype)


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 8)

    def forward(self, value: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, mask = value
        return torch.tanh(self.linear(x)), mask  # (B, W, 8), (B, W)


class MaskedMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 3)

    def forward(self, value: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, mask = value
        return self.linear((h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True))


class UseBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 3)

    def forward(self, value: tuple[torch.Tensor, Unbatched]) -> torch.Tensor:
        h, table = value
        assert isinstance(table, Unbatched)
        assert table.value.shape == (4, 8)
        return self.linear(h + table.value.mean(0))


def build(name: str) -> nn.Sequential:
    torch.manual_seed(0)
    if name == "ragged":
        return nn.Sequential(Trim(), Tokens(), MaskedMean())
    if name == "unbatched":
        return nn.Sequential(WithTable(), UseBias())
    if name == "permute":  # NCHW conv, then channels moved last: the boundary is a permuted view
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Permute(), nn.Linear(4, 3), nn.Flatten(), nn.Linear(48, 3))
    if name == "channels_last":
        return nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), ChannelsLast(), nn.Conv2d(4, 2, 3, padding=1), nn.Flatten(), nn.Linear(32, 3)
        )
    return nn.Sequential(MaskOf(), Masked(), Masked(), Head())


BALANCES = {
    "permute": [2, 3],
    "channels_last": [2, 3],
    "mask_first": [2, 2],
    "mask_later": [2, 2],
    "ragged": [2, 1],
    "unbatched": [1, 1],
}
# Which micro-batches hold padded samples: the first (then None at 1 and 3), or not the first (None first, a mask
# appears at micro-batch 1, then goes again).
PADDED = {"mask_first": [0, 2], "mask_later": [1, 3]}


def data(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    if name == "ragged":  # sequences of 1 to 7 tokens, zero-padded to 7: each micro-batch has its own longest
        lengths = torch.tensor([2, 1, 3, 2, 7, 1, 1, 2, 4, 5, 1, 3, 1, 6, 2, 1])
        x = torch.randn(BATCH, 7, 6, generator=generator) * (torch.arange(7)[None, :, None] < lengths[:, None, None])
        return x, torch.randn(BATCH, 3, generator=generator)
    if name == "unbatched":  # 14 samples: micro-batches of 4, 4, 3, 3, and the table's dim 0 is 4 too
        return torch.randn(14, 6, generator=generator), torch.randn(14, 3, generator=generator)
    if name in PADDED:
        x = torch.randn(BATCH, 6, generator=generator).abs().neg()  # nothing padded...
        for microbatch in PADDED[name]:
            x[microbatch * (BATCH // CHUNKS), 0] = 1.0  # ...but one sample of these micro-batches
        return x, torch.randn(BATCH, 3, generator=generator)
    return torch.randn(BATCH, 3, 4, 4, generator=generator), torch.randn(BATCH, 3, generator=generator)


def reference(name: str) -> dict[str, torch.Tensor]:
    return full_batch_grads(build(name), data(name))


def assert_same(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert grads.keys() == expected.keys()
    for key, value in expected.items():
        assert relative_error(grads[key], value) <= TOLERANCE, key


@pytest.mark.parametrize("name", ["mask_first", "mask_later"])
def test_a_leaf_that_is_none_on_some_microbatches_trains_as_the_plain_model(name: str) -> None:
    # Hugging Face's mask helpers return None for a micro-batch without padding: the boundary is (h, mask) on some
    # micro-batches and (h, None) on others. The step's header describes the first micro-batch only.
    model = build(name)
    model.zero_grad()
    run_in_threads(cells(model, BALANCES[name]), data(name), loss_fn, chunks=CHUNKS, timeout=60)
    assert_same({key: p.grad for key, p in model.named_parameters()}, reference(name))


@pytest.mark.parametrize("name", ["ragged", "unbatched"])
def test_shapes_that_vary_per_microbatch_train_as_the_plain_model(name: str) -> None:
    # Sequences trimmed per micro-batch cross the boundary with their own lengths (refused before: "may differ only in
    # the micro-batch dimension"); a table marked Unbatched is never resized to the micro-batch size, and arrives
    # still wrapped, as the unsplit model's next layer sees it.
    model = build(name)
    model.zero_grad()
    run_in_threads(cells(model, BALANCES[name]), data(name), loss_fn, chunks=CHUNKS, timeout=60)
    assert_same({key: p.grad for key, p in model.named_parameters()}, reference(name))


class _RecordingTransport(ThreadTransport):
    sent_devices: list[torch.device]

    def send(self, tensor: torch.Tensor, peer: int, what: str) -> None:
        self.sent_devices.append(tensor.device)
        super().send(tensor, peer, what)


def test_leaves_are_sent_from_the_transports_device() -> None:
    # R11: a stage on a GPU whose output holds a CPU tensor; NCCL would refuse the CPU send after the header had gone
    # and the peer would wait forever. "meta" stands in for the GPU: only the devices of what is sent matter here.
    sender, _receiver = _RecordingTransport.create(2, device="meta", timeout=datetime.timedelta(seconds=10))
    sender.sent_devices = []
    link = ActivationLink(sender, peer=1)
    link.begin_step([2, 2])
    for index in range(2):
        link.send(index, (torch.ones(2, 3), torch.ones(2, 1, dtype=torch.bool), None))
    assert sender.sent_devices
    assert set(sender.sent_devices) == {torch.device("meta")}


CASES = ["permute", "channels_last", "mask_first", "mask_later", "ragged", "unbatched"]
STEPS = {"ragged": 2}  # the second step starts described: its link remembers that shapes vary


def _worker(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    grads = {}
    for name in CASES:
        model = build(name)
        pipeline = Pipeline(cells(model, BALANCES[name])[rank], ProcessGroupTransport(range(world_size)), chunks=CHUNKS)
        for _ in range(STEPS.get(name, 1)):
            pipeline.train_step(data(name), loss_fn)
        steps = STEPS.get(name, 1)
        grads[name] = {key: p.grad / steps for key, p in model.named_parameters() if p.grad is not None}
    return grads


@RunIf(multiprocess=True)
def test_boundaries_over_gloo_train_as_the_plain_model() -> None:
    # A permuted or channels_last boundary tensor made gloo refuse the gradient's receive buffer, which kept the
    # output's strides (torch.empty_like); optional leaves use the control messages and the restart; shapes that
    # vary per micro-batch switch the step to described micro-batches, and the next step starts described.
    per_rank: list[dict[str, dict[str, Callable]]] = run_processes(_worker, 2, timeout=420)
    for name in CASES:
        grads = {}
        for rank_grads in per_rank:
            grads.update({key: torch.from_numpy(g) for key, g in rank_grads[name].items()})
        assert_same(grads, reference(name))
