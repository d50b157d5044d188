"""The embedded image dataset: procedurally drawn shapes on textured backgrounds, in the CIFAR-10 schema.

Two tasks share one visual world, so that a network pretrained on the first transfers to the second:

- ``"shapes"`` (pretraining): one of ten shapes, drawn at a random position, scale, rotation and colour; the label
  is the shape.
- ``"pairs"`` (fine-tuning): two smaller shapes out of four (disk, square, triangle, plus), side by side; the label
  is the unordered pair, six classes. Every shape belongs to three classes, so both shapes must be recognised.

Images are 32x32 RGB, stored as PNG in a ``datasets.Image`` column ``img`` next to a ``ClassLabel`` column ``label``
with splits ``train`` and ``test``: the schema of ``uoft-cs/cifar10``, so every CIFAR-10 code path reads it. Nothing
is shipped as binary; :func:`make_embedded_dataset` draws the images from a seed (about a second per 5,000 images on
one core) and :func:`load_embedded_dataset` caches them with ``save_to_disk``.

Legend: N images, H = W = 32 pixels, S = 2 (supersampling factor for anti-aliased edges), C = 3 channels.
"""

from __future__ import annotations

import io
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import datasets
import numpy as np
from PIL import Image

__all__ = [
    "EMBEDDED_MEAN",
    "EMBEDDED_STD",
    "EMBEDDED_TASKS",
    "PAIR_SHAPES",
    "SHAPES",
    "embedded_class_names",
    "load_embedded_dataset",
    "make_embedded_dataset",
]

IMAGE_SIZE = 32
_SUPERSAMPLE = 2
# Bump when the drawing changes, so that a cache written by an older generator is never read back as current.
_GENERATOR_VERSION = 1

SHAPES: tuple[str, ...] = (
    "disk",
    "ring",
    "square",
    "frame",
    "triangle",
    "plus",
    "bars",
    "star",
    "half_disk",
    "corner",
)
PAIR_SHAPES: tuple[str, ...] = ("disk", "square", "triangle", "plus")
_PAIRS: tuple[tuple[int, int], ...] = tuple(
    (i, j) for i in range(len(PAIR_SHAPES)) for j in range(i + 1, len(PAIR_SHAPES))
)

EMBEDDED_TASKS: tuple[str, ...] = ("shapes", "pairs")

# Per-channel statistics of the drawn images, measured over 20,000 images of each task (they agree to 0.002).
EMBEDDED_MEAN: tuple[float, float, float] = (0.502, 0.499, 0.500)
EMBEDDED_STD: tuple[float, float, float] = (0.240, 0.239, 0.239)


def embedded_class_names(task: str) -> list[str]:
    """The label names of ``task``, in label order."""
    _check_task(task)
    if task == "shapes":
        return list(SHAPES)
    return [f"{PAIR_SHAPES[i]}+{PAIR_SHAPES[j]}" for i, j in _PAIRS]


def make_embedded_dataset(
    task: str = "shapes", num_train: int = 4000, num_val: int = 1000, seed: int = 0
) -> datasets.DatasetDict:
    """Draw the embedded dataset ``task`` with splits ``train`` and ``test`` in the CIFAR-10 schema.

    The same arguments give byte-identical images. Labels are balanced: every class has ``n // k`` or ``n // k + 1``
    images in a split of ``n`` images with ``k`` classes, in random order. The two splits (and the two tasks) draw
    from independent random streams, so a larger ``num_train`` does not change the ``test`` images.
    """
    _check_task(task)
    for name, value in (("num_train", num_train), ("num_val", num_val)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive number of images")
    names = embedded_class_names(task)
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    splits = {}
    for split_index, (split, size) in enumerate((("train", num_train), ("test", num_val))):
        rng = np.random.default_rng([seed, EMBEDDED_TASKS.index(task), split_index])
        images, labels = _draw_task(task, size, rng)
        encoded = [{"bytes": _png_bytes(image), "path": None} for image in images]
        splits[split] = datasets.Dataset.from_dict({"img": encoded, "label": labels.tolist()}, features=features)
    return datasets.DatasetDict(splits)


def load_embedded_dataset(
    task: str = "shapes", num_train: int = 4000, num_val: int = 1000, seed: int = 0, cache_dir: str | None = None
) -> datasets.DatasetDict:
    """:func:`make_embedded_dataset`, cached under ``cache_dir`` when given (drawn once, then read from disk).

    The cache folder is named after every argument and the generator version, so changing any of them draws anew.
    """
    if cache_dir is None:
        return make_embedded_dataset(task, num_train, num_val, seed)
    path = embedded_dataset_path(cache_dir, task, num_train, num_val, seed)
    if not (path / "dataset_dict.json").is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write next to the target and rename, so that an interrupted run never leaves a half-written cache behind.
        staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
        try:
            make_embedded_dataset(task, num_train, num_val, seed).save_to_disk(str(staging))
            if not path.exists():
                staging.rename(path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return datasets.load_from_disk(str(path))


def embedded_dataset_path(cache_dir: str | Path, task: str, num_train: int, num_val: int, seed: int) -> Path:
    """The folder under ``cache_dir`` that :func:`load_embedded_dataset` uses for these arguments."""
    _check_task(task)
    return Path(cache_dir) / f"{task}-train{num_train}-test{num_val}-seed{seed}-v{_GENERATOR_VERSION}"


def _check_task(task: str) -> None:
    if task not in EMBEDDED_TASKS:
        raise ValueError(f"unknown embedded task {task!r}; choose one of {', '.join(map(repr, EMBEDDED_TASKS))}")


def _png_bytes(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    # Level 1: these tiny noisy images barely compress further, and encoding is the generator's slowest part.
    Image.fromarray(image).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def _balanced_labels(num_images: int, num_classes: int, rng: np.random.Generator) -> np.ndarray:
    return rng.permutation(np.arange(num_images) % num_classes)


def _draw_task(task: str, num_images: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Images [N, H, W, C] uint8 and labels [N] of ``task``."""
    labels = _balanced_labels(num_images, len(embedded_class_names(task)), rng)
    canvas = _background(num_images, rng)  # [N, H, W, C] float in [0, 1]
    if task == "shapes":
        radius = rng.uniform(6.0, 12.0, num_images)
        margin = 0.6 * radius
        centre = rng.uniform(margin[:, None], IMAGE_SIZE - margin[:, None], (num_images, 2))
        _paint(canvas, labels, SHAPES, centre, radius, rng)
    else:
        pairs = np.array(_PAIRS)[labels]  # [N, 2] indices into PAIR_SHAPES
        pairs = np.where(rng.random((num_images, 1)) < 0.5, pairs, pairs[:, ::-1])
        # The two shapes sit in opposite halves (left/right or top/bottom), so they never hide each other.
        radius = rng.uniform(4.5, 7.0, (num_images, 2))
        along = rng.uniform(radius, IMAGE_SIZE / 2 - 0.3 * radius)
        along[:, 1] += IMAGE_SIZE / 2
        across = rng.uniform(radius, IMAGE_SIZE - radius)
        vertical = rng.random((num_images, 1)) < 0.5
        x = np.where(vertical, across, along)
        y = np.where(vertical, along, across)
        for k in range(2):
            centre = np.stack([x[:, k], y[:, k]], axis=1)
            _paint(canvas, pairs[:, k], PAIR_SHAPES, centre, radius[:, k], rng)
    canvas += 0.04 * rng.standard_normal(canvas.shape, dtype=np.float32)
    images = np.clip(np.rint(canvas * 255.0), 0, 255).astype(np.uint8)
    return images, labels


def _background(num_images: int, rng: np.random.Generator) -> np.ndarray:
    """Textured backgrounds [N, H, W, C]: a random colour, a smooth blotchy texture and a linear gradient."""
    base = rng.uniform(0.15, 0.85, (num_images, 1, 1, 3)).astype(np.float32)
    coarse = rng.normal(0.0, 0.12, (num_images, 4, 4, 3)).astype(np.float32)
    texture = _upsample(coarse, IMAGE_SIZE // 4)
    ramp = np.linspace(-0.5, 0.5, IMAGE_SIZE, dtype=np.float32)
    slope = rng.normal(0.0, 0.15, (num_images, 2, 1, 1, 1)).astype(np.float32)
    gradient = slope[:, 0] * ramp[None, :, None, None] + slope[:, 1] * ramp[None, None, :, None]
    texture += base
    texture += gradient
    return texture


def _upsample(values: np.ndarray, factor: int) -> np.ndarray:
    """Bilinear upsampling of [N, h, w, C] by ``factor`` along h and w, as two small interpolation matrices."""
    h, w = values.shape[1:3]
    return np.einsum("yh,nhwc,xw->nyxc", _interpolation(h, factor), values, _interpolation(w, factor), optimize=True)


def _interpolation(size: int, factor: int) -> np.ndarray:
    """The [size * factor, size] matrix of bilinear weights (pixel centres aligned, edges clamped)."""
    position = np.clip((np.arange(size * factor) + 0.5) / factor - 0.5, 0, size - 1)
    low = np.floor(position).astype(int)
    high = np.minimum(low + 1, size - 1)
    weights = np.zeros((size * factor, size), dtype=np.float32)
    rows = np.arange(size * factor)
    np.add.at(weights, (rows, low), 1 - (position - low))
    np.add.at(weights, (rows, high), position - low)
    return weights


def _paint(
    canvas: np.ndarray,
    shape_ids: np.ndarray,
    vocabulary: tuple[str, ...],
    centre: np.ndarray,
    radius: np.ndarray,
    rng: np.random.Generator,
) -> None:
    """Blend one shape per image into ``canvas`` [N, H, W, C] in place: shape ``vocabulary[shape_ids[n]]``."""
    num_images = len(shape_ids)
    angle = rng.uniform(0.0, 2 * np.pi, num_images)
    colour = _shape_colours(canvas, rng)
    # Pixel-centre coordinates on a grid S times finer than the image, averaged back for soft edges.
    grid = ((np.arange(IMAGE_SIZE * _SUPERSAMPLE) + 0.5) / _SUPERSAMPLE).astype(np.float32)
    centre = centre.astype(np.float32)
    dx = grid[None, None, :] - centre[:, 0, None, None]  # [N, 1, H*S]
    dy = grid[None, :, None] - centre[:, 1, None, None]  # [N, H*S, 1]
    cos = np.cos(angle).astype(np.float32)[:, None, None]
    sin = np.sin(angle).astype(np.float32)[:, None, None]
    scale = radius.astype(np.float32)[:, None, None]
    u = (dx * cos + dy * sin) / scale  # [N, H*S, W*S], shape-local units of one radius
    v = (dy * cos - dx * sin) / scale
    fine = np.zeros(u.shape, dtype=bool)
    for shape_id, name in enumerate(vocabulary):
        chosen = shape_ids == shape_id
        if chosen.any():
            fine[chosen] = _MASKS[name](u[chosen], v[chosen])
    coverage = fine.reshape(num_images, IMAGE_SIZE, _SUPERSAMPLE, IMAGE_SIZE, _SUPERSAMPLE).mean(axis=(2, 4))
    alpha = coverage[..., None].astype(np.float32)  # [N, H, W, 1]
    canvas *= 1 - alpha
    canvas += alpha * colour.astype(np.float32)[:, None, None, :]


def _shape_colours(canvas: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One colour [N, C] per image that stands out from its background's mean by at least 0.35 (Euclidean, RGB)."""
    mean = canvas.mean(axis=(1, 2))  # [N, C]
    colour = rng.uniform(0.0, 1.0, mean.shape)
    for _ in range(16):  # resample the colours too close to their background; 16 rounds leave none in practice
        close = np.linalg.norm(colour - mean, axis=1) < 0.35
        if not close.any():
            break
        colour[close] = rng.uniform(0.0, 1.0, (int(close.sum()), 3))
    return colour


def _star(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    rho = np.hypot(u, v)
    phase = (np.arctan2(v, u) * 5 / (2 * np.pi)) % 1.0  # position within one of the five points
    return rho <= 0.42 + 0.58 * np.abs(2 * phase - 1)


_SQRT3 = np.sqrt(3.0)
_MASKS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "disk": lambda u, v: u**2 + v**2 <= 0.85,
    "ring": lambda u, v: (u**2 + v**2 <= 1.0) & (u**2 + v**2 >= 0.35),
    "square": lambda u, v: np.maximum(np.abs(u), np.abs(v)) <= 0.72,
    "frame": lambda u, v: (np.maximum(np.abs(u), np.abs(v)) <= 0.8) & (np.maximum(np.abs(u), np.abs(v)) >= 0.45),
    "triangle": lambda u, v: (v >= -0.55) & (_SQRT3 * u + v <= 1.1) & (-_SQRT3 * u + v <= 1.1),
    "plus": lambda u, v: ((np.abs(u) <= 0.28) & (np.abs(v) <= 1.0)) | ((np.abs(v) <= 0.28) & (np.abs(u) <= 1.0)),
    "bars": lambda u, v: (np.abs(v) <= 0.85) & ((np.abs(u) <= 0.14) | ((np.abs(u) >= 0.56) & (np.abs(u) <= 0.84))),
    "star": _star,
    "half_disk": lambda u, v: (u**2 + (v + 0.4) ** 2 <= 1.0) & (v >= -0.4),
    "corner": lambda u, v: (np.abs(u) <= 0.8) & (np.abs(v) <= 0.8) & ((u <= -0.3) | (v <= -0.3)),
}
