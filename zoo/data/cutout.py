"""Cutout (DeVries & Taylor, 2017): one square of zeros at a random place in each training image."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Cutout"]


class Cutout(nn.Module):
    """Zero one ``length x length`` square whose centre is uniform over the whole image.

    This is the paper's reference implementation (``uoguelph-mlrg/Cutout``, ``util/cutout.py``), not timm's
    ``RandomErasing``: the centre may lie anywhere, so near the borders the square is clipped and only part of it
    falls inside; there is one square per image and it is applied to every image (p = 1). It runs after
    normalization, so the hole holds the dataset mean. The reference cuts ``length - 1`` pixels for odd lengths; here
    the square always has side ``length`` when it is fully inside.

    Args:
        length: side of the square in pixels; 0 turns Cutout off.
        generator: draws the centres; ``None`` uses torch's global generator, which is what a data loader needs
            (each worker is seeded differently, while a generator passed here would be copied into every worker and
            repeat the same squares in each).
    """

    def __init__(self, length: int, generator: torch.Generator | None = None) -> None:
        super().__init__()
        if not isinstance(length, int) or length < 0:
            raise ValueError(f"Cutout length={length!r} must be a non-negative number of pixels (0 turns it off)")
        self.length = length
        self.generator = generator

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        """A copy of ``image`` [..., H, W] with the square zeroed in every channel."""
        if self.length == 0:
            return image
        H, W = image.shape[-2:]
        centre_y = int(torch.randint(H, (1,), generator=self.generator))
        centre_x = int(torch.randint(W, (1,), generator=self.generator))
        top, left = centre_y - self.length // 2, centre_x - self.length // 2
        out = image.clone()
        out[..., max(top, 0) : max(top + self.length, 0), max(left, 0) : max(left + self.length, 0)] = 0
        return out

    def extra_repr(self) -> str:
        return f"length={self.length}"
