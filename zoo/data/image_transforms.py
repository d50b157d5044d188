"""The image transforms of the zoo's data modules: the GPipe fine-tuning augmentation, and batches collated."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image
from torchvision.transforms import v2

from zoo.data.cutout import Cutout

__all__ = ["ExampleTransform", "Stats", "collate_images", "image_transform"]

Stats = tuple[float, float, float]
"""Per-channel (R, G, B) values: a mean or a standard deviation of pixel values in [0, 1]."""


class _ToRGB(torch.nn.Module):
    """Convert a PIL image of any mode (grayscale, palette, RGBA, CMYK) to RGB; Food-101 has a few non-RGB JPEGs."""

    def forward(self, image: Any) -> Any:
        if isinstance(image, Image.Image) and image.mode != "RGB":
            return image.convert("RGB")
        return image


def image_transform(
    image_size: int, mean: Stats, std: Stats, *, train: bool, hflip: bool = True, cutout: int = 0
) -> v2.Compose:
    """PIL image (any mode and size) -> normalized float tensor [3, S, S] with S = ``image_size``.

    Training: RGB, resize to S x S, random horizontal flip (if ``hflip``), to [0, 1], normalize, Cutout of side
    ``cutout`` (if > 0). Evaluation (``train=False``): RGB, resize, to [0, 1], normalize.
    """
    steps: list[torch.nn.Module] = [_ToRGB(), v2.Resize((image_size, image_size), antialias=True)]
    if train and hflip:
        steps.append(v2.RandomHorizontalFlip())
    steps += [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))]
    if train and cutout > 0:
        steps.append(Cutout(cutout))
    return v2.Compose(steps)


class ExampleTransform:
    """The batched callable for ``Dataset.with_transform``: decoded rows -> ``{"image": tensors, "label": ints}``."""

    def __init__(self, transform: v2.Compose, image_column: str, label_column: str) -> None:
        self.transform = transform
        self.image_column = image_column
        self.label_column = label_column

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        images = [self.transform(image).as_subclass(torch.Tensor) for image in batch[self.image_column]]
        return {"image": images, "label": batch[self.label_column]}


def collate_images(examples: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack transformed examples into ``(images [B, 3, S, S] float, labels [B] int64)``."""
    images = torch.stack([example["image"] for example in examples])
    labels = torch.tensor([example["label"] for example in examples], dtype=torch.int64)
    return images, labels
