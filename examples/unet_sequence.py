"""A U-Net written as one ``nn.Sequential`` for ``GPipeStrategy``: its skip connections ride along in a tuple.

A U-Net is usually written with encoder and decoder stages as attributes that ``forward`` joins, each decoder stage
reading the output of its encoder twin. A pipeline cuts one sequence of layers into stages and passes one value from
each layer to the next, so here that value is a tuple: the current feature map, then the encoder outputs the
decoder still needs. ``Down`` pushes its output onto the tuple, ``Up`` pops the last one, and whatever crosses a
stage boundary is the whole tuple (any nest of tuples, lists and dicts of tensors may). Shapes: B batch, C channels,
S side of the square image.

    OMP_NUM_THREADS=1 python examples/unet_sequence.py   # K = 2 stages on 2 CPU processes, a few seconds
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gpipe  # noqa: F401  (registers strategy="gpipe")

SIDE, WIDTH = 16, 8

State = tuple[torch.Tensor, ...]  # the feature map, then the encoder outputs kept for the skip connections


def convolutions(channels_in: int, channels_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(channels_in, channels_out, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(channels_out, channels_out, 3, padding=1),
        nn.ReLU(),
    )


class Down(nn.Module):
    """An encoder stage: (x (B, C, S, S), *skips) -> (y halved (B, C', S/2, S/2), *skips, y)."""

    def __init__(self, channels_in: int, channels_out: int) -> None:
        super().__init__()
        self.convolutions = convolutions(channels_in, channels_out)

    def forward(self, state: State) -> State:
        x, *skips = state
        y = self.convolutions(x)
        return (F.max_pool2d(y, 2), *skips, y)


class Bottom(nn.Module):
    """The bottleneck: (x, *skips) -> (convolved x, *skips)."""

    def __init__(self, channels_in: int, channels_out: int) -> None:
        super().__init__()
        self.convolutions = convolutions(channels_in, channels_out)

    def forward(self, state: State) -> State:
        x, *skips = state
        return (self.convolutions(x), *skips)


class Up(nn.Module):
    """A decoder stage: (x (B, C, S, S), *skips, skip) -> (convolved [doubled x, skip] (B, C/2, 2S, 2S), *skips)."""

    def __init__(self, channels_in: int, channels_out: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(channels_in, channels_out, 2, stride=2)
        self.convolutions = convolutions(2 * channels_out, channels_out)

    def forward(self, state: State) -> State:
        x, *skips, skip = state
        return (self.convolutions(torch.cat([self.up(x), skip], dim=1)), *skips)


class Out(nn.Module):
    """Per-pixel logits: ((x (B, C, S, S),)) -> (B, 1, S, S)."""

    def __init__(self, channels_in: int) -> None:
        super().__init__()
        self.convolution = nn.Conv2d(channels_in, 1, 1)

    def forward(self, state: State) -> torch.Tensor:
        (x,) = state  # every skip has been used
        return self.convolution(x)


def unet(width: int = WIDTH) -> nn.Sequential:
    """A two-level U-Net as one sequence, where the usual code has ``self.enc1``, ``self.dec1``, ... and ``forward``."""
    return nn.Sequential(
        Down(1, width), Down(width, 2 * width), Bottom(2 * width, 4 * width),
        Up(4 * width, 2 * width), Up(2 * width, width), Out(width),
    )  # fmt: skip


class Segmenter(L.LightningModule):
    """Per-pixel segmentation with the U-Net of :func:`unet` in ``self.layers``."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.layers = unet()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, masks = batch  # (B, 1, S, S) each
        logits = self.layers((images,))  # the state: the image, no skips yet
        loss = F.binary_cross_entropy_with_logits(logits, masks)  # as many pixels in every micro-batch
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def dataset(samples: int = 256, seed: int = 0) -> TensorDataset:
    """Noisy images of one bright square each, and its mask."""
    generator = torch.Generator().manual_seed(seed)
    corner = torch.randint(0, SIDE - 6, (samples, 2), generator=generator)
    size = torch.randint(3, 7, (samples, 1), generator=generator)
    rows, columns = torch.arange(SIDE).view(1, SIDE, 1), torch.arange(SIDE).view(1, 1, SIDE)
    top, left, size = corner[:, 0, None, None], corner[:, 1, None, None], size[:, :, None]
    masks = ((rows >= top) & (rows < top + size) & (columns >= left) & (columns < left + size)).float().unsqueeze(1)
    images = masks + 0.5 * torch.randn(masks.shape, generator=generator)
    return TensorDataset(images, masks)


if __name__ == "__main__":
    L.seed_everything(0)
    model = Segmenter()
    trainer = L.Trainer(strategy="gpipe", accelerator="cpu", devices=2, max_epochs=3, logger=False)
    trainer.fit(model, DataLoader(dataset(), batch_size=32, shuffle=True, drop_last=True))
    if trainer.is_global_zero:
        print(f"final loss {trainer.callback_metrics['train_loss']:.3f}")
