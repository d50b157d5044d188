"""Image-classification data modules over Hugging Face ``datasets``: CIFAR-10/100, Food-101 and the embedded shapes.

Every module yields ``(images, labels)`` batches, float [B, 3, S, S] and int64 [B], from a hub dataset id or a local
folder, with the GPipe fine-tuning augmentation in training (resize to S x S, random horizontal flip, Cutout) and
resize-only evaluation. Images are decoded and transformed lazily, batch by batch (``Dataset.with_transform``).

Without network, pass ``source=<folder>``: a folder written by ``DatasetDict.save_to_disk`` (on a machine with
network: ``datasets.load_dataset("uoft-cs/cifar10").save_to_disk("cifar10")``), or a folder of data files that
``datasets.load_dataset(folder)`` reads (an ``imagefolder`` layout such as ``train/<class>/*.png``, or parquet files).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import datasets
import lightning as L
import torch
from torch.utils.data import DataLoader

from zoo.data.image_transforms import ExampleTransform, Stats, collate_images, image_transform
from zoo.data.synthetic_images import EMBEDDED_MEAN, EMBEDDED_STD, embedded_class_names, load_embedded_dataset

__all__ = [
    "CIFAR100DataModule",
    "CIFAR100_MEAN",
    "CIFAR100_STD",
    "CIFAR10DataModule",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "EmbeddedImageDataModule",
    "Food101DataModule",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ImageDataModule",
    "load_image_dataset",
]

# The Cutout reference code's statistics (train.py there), per RGB channel over the training split.
CIFAR10_MEAN: Stats = (125.3 / 255, 123.0 / 255, 113.9 / 255)
CIFAR10_STD: Stats = (63.0 / 255, 62.1 / 255, 66.7 / 255)
CIFAR100_MEAN: Stats = (129.3 / 255, 124.1 / 255, 112.4 / 255)
CIFAR100_STD: Stats = (68.2 / 255, 65.4 / 255, 70.4 / 255)
IMAGENET_MEAN: Stats = (0.485, 0.456, 0.406)
IMAGENET_STD: Stats = (0.229, 0.224, 0.225)

_OFFLINE_VARIABLES = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


def load_image_dataset(source: str) -> datasets.DatasetDict:
    """All splits of ``source``: a local folder (``save_to_disk`` output or data files) or a Hugging Face hub id.

    Raises ``ConnectionError`` naming the fix (a local ``source``) when a hub dataset cannot be fetched because
    there is no network or ``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE`` is set, and it is not in the local cache.
    """
    path = Path(source).expanduser()
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            return datasets.load_from_disk(str(path))
        if (path / "state.json").is_file():
            raise ValueError(
                f"source={source!r} holds a single split written by Dataset.save_to_disk; save the splits together "
                "instead: DatasetDict(train=train_split, test=val_split).save_to_disk(folder)"
            )
        return datasets.load_dataset(str(path))
    if source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise ValueError(f"source={source!r} looks like a local folder but there is no such folder")
    offline = _offline_requested()
    with _hub_offline(offline):
        try:
            return datasets.load_dataset(source)
        except ConnectionError as error:
            reason = "offline mode is on (" + " or ".join(_OFFLINE_VARIABLES) + ")" if offline else "no network"
            folder = source.rsplit("/", 1)[-1]
            raise ConnectionError(
                f"cannot load the dataset {source!r} from the Hugging Face Hub: {reason}, and it is not in the local "
                f"cache. Pass source=<local folder> instead. To make one, run on a machine with network "
                f"`datasets.load_dataset({source!r}).save_to_disk({folder!r})`, copy the folder here and pass "
                f"source='path/to/{folder}'."
            ) from error


def _offline_requested() -> bool:
    """Whether the hub is off limits, from ``datasets``' setting or from the variables set after it was imported."""
    flags = (os.environ.get(name, "").upper() for name in _OFFLINE_VARIABLES)
    return bool(datasets.config.HF_HUB_OFFLINE) or any(flag in datasets.config.ENV_VARS_TRUE_VALUES for flag in flags)


@contextlib.contextmanager
def _hub_offline(offline: bool) -> Iterator[None]:
    # `datasets` reads the offline variables once, at import; honour them when they were set later, so that the
    # hub is never contacted (and its retries never waited for) once the user has said there is no network.
    previous = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = previous or offline
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = previous


class ImageDataModule(L.LightningDataModule):
    """Any Hugging Face image-classification dataset as ``(images, labels)`` batches.

    Args:
        source: a hub dataset id (``"uoft-cs/cifar10"``) or a local folder: ``DatasetDict.save_to_disk`` output, or
            data files that ``datasets.load_dataset(folder)`` reads (imagefolder layout, parquet).
        image_column: the column holding the images.
        label_column: the column holding the integer class labels (ideally a ``ClassLabel``).
        train_split: the split to train on.
        val_split: the split to validate and test on.
        image_size: side S of the square images fed to the model; every image is resized to S x S.
        batch_size: images per batch (per process).
        num_workers: data-loader worker processes.
        cutout: side of the Cutout square in pixels at ``image_size`` (DeVries & Taylor use 16 for CIFAR-10 and 8 for
            CIFAR-100 at 32 px); 0 turns Cutout off.
        hflip: flip training images horizontally with probability 1/2.
        mean: per-channel normalization mean; ``None`` takes the dataset's (ImageNet statistics for an unknown one).
        std: per-channel normalization standard deviation; ``None`` as for ``mean``.
        limit_train: use only the first ``limit_train`` training images (smoke runs); ``None`` uses all.
        limit_val: use only the first ``limit_val`` validation images; ``None`` uses all.
        seed: seeds the order in which training images are shuffled.
    """

    default_mean: ClassVar[Stats] = IMAGENET_MEAN
    default_std: ClassVar[Stats] = IMAGENET_STD
    # Classes per label column before the data is loaded, so that a CLI can link num_classes to the model early.
    known_num_classes: ClassVar[dict[str, int]] = {}

    def __init__(
        self,
        source: str,
        image_column: str = "image",
        label_column: str = "label",
        train_split: str = "train",
        val_split: str = "test",
        image_size: int = 224,
        batch_size: int = 64,
        num_workers: int = 0,
        cutout: int = 0,
        hflip: bool = True,
        mean: Stats | None = None,
        std: Stats | None = None,
        limit_train: int | None = None,
        limit_val: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        # Record the arguments of the class being built (a subclass fixes some of the base's, e.g. the embedded
        # dataset's source), so that `type(self)(**self.hparams)` rebuilds it from a checkpoint or a CLI config.
        accepted = inspect.signature(type(self).__init__).parameters
        self.save_hyperparameters(ignore=[name for name in _BASE_ARGUMENTS if name not in accepted])
        for name, value, smallest in (
            ("image_size", image_size, 1),
            ("batch_size", batch_size, 1),
            ("num_workers", num_workers, 0),
            ("cutout", cutout, 0),
        ):
            if not isinstance(value, int) or value < smallest:
                raise ValueError(f"{name}={value!r} must be an integer >= {smallest}")
        for name, limit in (("limit_train", limit_train), ("limit_val", limit_val)):
            if limit is not None and (not isinstance(limit, int) or limit < 1):
                raise ValueError(f"{name}={limit!r} must be a positive number of images, or None for all of them")
        for name, stats in (("mean", mean), ("std", std)):
            if stats is not None and len(stats) != 3:
                raise ValueError(f"{name}={stats!r} must hold one value per RGB channel (3 values)")
        self.source = source
        self.image_column = image_column
        self.label_column = label_column
        self.train_split = train_split
        self.val_split = val_split
        self.image_size = image_size
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.cutout = cutout
        self.hflip = hflip
        self.mean: Stats = tuple(mean) if mean is not None else self.default_mean  # type: ignore[assignment]
        self.std: Stats = tuple(std) if std is not None else self.default_std  # type: ignore[assignment]
        self.limit_train = limit_train
        self.limit_val = limit_val
        self.seed = seed
        self._splits: datasets.DatasetDict | None = None
        self.train_set: datasets.Dataset | None = None
        self.val_set: datasets.Dataset | None = None

    @property
    def num_classes(self) -> int:
        """Classes of the label column: from its ``ClassLabel`` once loaded, the known count before."""
        if self._splits is None:
            known = self._known_num_classes()
            if known is not None:
                return known
            self._splits = self._load_checked()
        feature = self._splits[self.train_split].features[self.label_column]
        if isinstance(feature, datasets.ClassLabel):
            return int(feature.num_classes)
        # Plain integer labels (e.g. parquet files without a ClassLabel): the largest one tells the count.
        return 1 + max(max(self._splits[split][self.label_column]) for split in (self.train_split, self.val_split))

    def _known_num_classes(self) -> int | None:
        return self.known_num_classes.get(self.label_column)

    def _load_splits(self) -> datasets.DatasetDict:
        """All splits of the dataset, decoded lazily; subclasses with another origin override this."""
        return load_image_dataset(self.source)

    def _load_checked(self) -> datasets.DatasetDict:
        splits = self._load_splits()
        for split in (self.train_split, self.val_split):
            if split not in splits:
                raise ValueError(
                    f"the dataset {self.source!r} has no split {split!r}; its splits are {sorted(splits)}: "
                    "pass train_split= and val_split= accordingly"
                )
        columns = splits[self.train_split].column_names
        for argument, column in (("image_column", self.image_column), ("label_column", self.label_column)):
            if column not in columns:
                raise ValueError(
                    f"{argument}={column!r} is not a column of the dataset {self.source!r}; its columns are "
                    f"{columns}: pass {argument}= with one of them"
                )
        return splits

    def prepare_data(self) -> None:
        """Download a hub dataset into the Hugging Face cache (once per node, before :meth:`setup`)."""
        if not Path(self.source).expanduser().is_dir():
            load_image_dataset(self.source)

    def setup(self, stage: str | None = None) -> None:
        """Load the splits, keep the first ``limit_*`` images, and attach the lazy transforms."""
        if self._splits is None:
            self._splits = self._load_checked()
        train = _first(self._splits[self.train_split], self.limit_train)
        val = _first(self._splits[self.val_split], self.limit_val)
        self.train_set = train.with_transform(self._example_transform(train=True))
        self.val_set = val.with_transform(self._example_transform(train=False))

    def _example_transform(self, *, train: bool) -> ExampleTransform:
        transform = image_transform(
            self.image_size, self.mean, self.std, train=train, hflip=self.hflip, cutout=self.cutout
        )
        return ExampleTransform(transform, self.image_column, self.label_column)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def _loader(self, dataset: datasets.Dataset | None, *, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must run before its data loaders are requested")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            collate_fn=collate_images,
            persistent_workers=self.num_workers > 0,
            generator=torch.Generator().manual_seed(self.seed) if shuffle else None,
        )


_BASE_ARGUMENTS = tuple(inspect.signature(ImageDataModule.__init__).parameters)


def _common(
    image_size: int,
    batch_size: int,
    num_workers: int,
    cutout: int,
    hflip: bool,
    mean: Stats | None,
    std: Stats | None,
    limit_train: int | None,
    limit_val: int | None,
    seed: int,
) -> dict[str, Any]:
    """The arguments every dataset shares, by name: the subclasses restate them only to give their own defaults."""
    return {
        "image_size": image_size,
        "batch_size": batch_size,
        "num_workers": num_workers,
        "cutout": cutout,
        "hflip": hflip,
        "mean": mean,
        "std": std,
        "limit_train": limit_train,
        "limit_val": limit_val,
        "seed": seed,
    }


def _first(dataset: datasets.Dataset, limit: int | None) -> datasets.Dataset:
    if limit is None or limit >= len(dataset):
        return dataset
    return dataset.select(range(limit))


class CIFAR10DataModule(ImageDataModule):
    """CIFAR-10 (``uoft-cs/cifar10``: ``img``, ``label``; ``train`` 50,000 / ``test`` 10,000; 10 classes).

    Defaults follow DeVries & Taylor's CIFAR-10 setup at 32 px (Cutout 16); the GPipe paper fine-tunes at 480 px
    (``image_size=480``, with a Cutout side scaled to match). See :class:`ImageDataModule` for the arguments.
    """

    default_mean = CIFAR10_MEAN
    default_std = CIFAR10_STD
    known_num_classes: ClassVar[dict[str, int]] = {"label": 10}

    def __init__(
        self,
        source: str = "uoft-cs/cifar10",
        image_column: str = "img",
        label_column: str = "label",
        train_split: str = "train",
        val_split: str = "test",
        image_size: int = 32,
        batch_size: int = 128,
        num_workers: int = 0,
        cutout: int = 16,
        hflip: bool = True,
        mean: Stats | None = None,
        std: Stats | None = None,
        limit_train: int | None = None,
        limit_val: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(
            source=source,
            image_column=image_column,
            label_column=label_column,
            train_split=train_split,
            val_split=val_split,
            **_common(image_size, batch_size, num_workers, cutout, hflip, mean, std, limit_train, limit_val, seed),
        )


class CIFAR100DataModule(ImageDataModule):
    """CIFAR-100 (``uoft-cs/cifar100``: ``img``, ``fine_label`` (100) and ``coarse_label`` (20); ``train`` / ``test``).

    Defaults follow DeVries & Taylor's CIFAR-100 setup at 32 px (Cutout 8). See :class:`ImageDataModule`.
    """

    default_mean = CIFAR100_MEAN
    default_std = CIFAR100_STD
    known_num_classes: ClassVar[dict[str, int]] = {"fine_label": 100, "coarse_label": 20}

    def __init__(
        self,
        source: str = "uoft-cs/cifar100",
        image_column: str = "img",
        label_column: str = "fine_label",
        train_split: str = "train",
        val_split: str = "test",
        image_size: int = 32,
        batch_size: int = 128,
        num_workers: int = 0,
        cutout: int = 8,
        hflip: bool = True,
        mean: Stats | None = None,
        std: Stats | None = None,
        limit_train: int | None = None,
        limit_val: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(
            source=source,
            image_column=image_column,
            label_column=label_column,
            train_split=train_split,
            val_split=val_split,
            **_common(image_size, batch_size, num_workers, cutout, hflip, mean, std, limit_train, limit_val, seed),
        )


class Food101DataModule(ImageDataModule):
    """Food-101 (``ethz/food101``: ``image``, ``label``; ``train`` 75,750 / ``validation`` 25,250; 101 classes).

    The official test split is named ``validation``. Images are up to 512 px on a side and not square; they are
    resized (not cropped) to ``image_size`` squared, as the GPipe paper does at 480. See :class:`ImageDataModule`.
    """

    known_num_classes: ClassVar[dict[str, int]] = {"label": 101}

    def __init__(
        self,
        source: str = "ethz/food101",
        image_column: str = "image",
        label_column: str = "label",
        train_split: str = "train",
        val_split: str = "validation",
        image_size: int = 224,
        batch_size: int = 64,
        num_workers: int = 0,
        cutout: int = 0,
        hflip: bool = True,
        mean: Stats | None = None,
        std: Stats | None = None,
        limit_train: int | None = None,
        limit_val: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(
            source=source,
            image_column=image_column,
            label_column=label_column,
            train_split=train_split,
            val_split=val_split,
            **_common(image_size, batch_size, num_workers, cutout, hflip, mean, std, limit_train, limit_val, seed),
        )


class EmbeddedImageDataModule(ImageDataModule):
    """The embedded shapes dataset (:mod:`zoo.data.synthetic_images`), drawn locally, in the CIFAR-10 schema.

    Pretrain on ``task="shapes"`` (10 classes), fine-tune on ``task="pairs"`` (6 classes); no download needed.

    Args:
        task: ``"shapes"`` or ``"pairs"``.
        num_train: images in the ``train`` split.
        num_val: images in the ``test`` split.
        dataset_seed: seed of the drawing (the same seed gives the same images).
        cache_dir: folder to keep the drawn dataset in (``save_to_disk``), read back on later runs; ``None`` draws
            it in memory each time (about a second per 5,000 images).

    The other arguments are :class:`ImageDataModule`'s.
    """

    default_mean = EMBEDDED_MEAN
    default_std = EMBEDDED_STD

    def __init__(
        self,
        task: str = "shapes",
        num_train: int = 4000,
        num_val: int = 1000,
        dataset_seed: int = 0,
        cache_dir: str | None = None,
        image_size: int = 32,
        batch_size: int = 128,
        num_workers: int = 0,
        cutout: int = 0,
        hflip: bool = True,
        mean: Stats | None = None,
        std: Stats | None = None,
        limit_train: int | None = None,
        limit_val: int | None = None,
        seed: int = 0,
    ) -> None:
        self._class_names = embedded_class_names(task)  # validates the task name before anything else
        super().__init__(
            source=f"embedded:{task}",
            image_column="img",
            label_column="label",
            train_split="train",
            val_split="test",
            **_common(image_size, batch_size, num_workers, cutout, hflip, mean, std, limit_train, limit_val, seed),
        )
        self.task = task
        self.num_train = num_train
        self.num_val = num_val
        self.dataset_seed = dataset_seed
        self.cache_dir = cache_dir

    def _known_num_classes(self) -> int | None:
        return len(self._class_names)

    def _load_splits(self) -> datasets.DatasetDict:
        return load_embedded_dataset(self.task, self.num_train, self.num_val, self.dataset_seed, self.cache_dir)

    def prepare_data(self) -> None:
        """Draw the dataset into ``cache_dir`` once per node; nothing to do without a cache."""
        if self.cache_dir is not None:
            self._load_splits()
