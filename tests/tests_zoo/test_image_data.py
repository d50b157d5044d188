"""Image data modules on tiny local copies of the real schemas, Cutout, and the embedded shapes dataset."""

from __future__ import annotations

import pickle
from collections import Counter
from pathlib import Path

import datasets
import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from zoo.data import (
    CIFAR10DataModule,
    CIFAR100DataModule,
    Cutout,
    EmbeddedImageDataModule,
    Food101DataModule,
    ImageDataModule,
    load_embedded_dataset,
    make_embedded_dataset,
)
from zoo.data.images import CIFAR10_MEAN, CIFAR10_STD, IMAGENET_MEAN, IMAGENET_STD
from zoo.data.synthetic_images import embedded_dataset_path

CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


@pytest.fixture(autouse=True)
def _private_datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # load_dataset(folder) converts data files into an Arrow cache; keep it out of the user's home.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def noise_image(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels).convert(mode)


def cifar10_splits(train: int = 10, test: int = 6) -> datasets.DatasetDict:
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=CIFAR10_NAMES)})
    return datasets.DatasetDict(
        {
            split: datasets.Dataset.from_dict(
                {
                    "img": [noise_image(32, 32, seed=100 * offset + i) for i in range(n)],
                    "label": [i % 10 for i in range(n)],
                },
                features=features,
            )
            for offset, (split, n) in enumerate((("train", train), ("test", test)))
        }
    )


@pytest.fixture
def cifar10_dir(tmp_path: Path) -> Path:
    path = tmp_path / "cifar10"
    cifar10_splits().save_to_disk(str(path))
    return path


@pytest.fixture
def cifar100_dir(tmp_path: Path) -> Path:
    features = datasets.Features(
        {
            "img": datasets.Image(),
            "fine_label": datasets.ClassLabel(names=[f"fine{i}" for i in range(100)]),
            "coarse_label": datasets.ClassLabel(names=[f"coarse{i}" for i in range(20)]),
        }
    )
    splits = {
        split: datasets.Dataset.from_dict(
            {
                "img": [noise_image(32, 32, seed=i) for i in range(n)],
                "fine_label": [97 - 7 * i for i in range(n)],
                "coarse_label": [19 - i for i in range(n)],
            },
            features=features,
        )
        for split, n in (("train", 8), ("test", 5))
    }
    path = tmp_path / "cifar100"
    datasets.DatasetDict(splits).save_to_disk(str(path))
    return path


@pytest.fixture
def food101_dir(tmp_path: Path) -> Path:
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=[f"food{i}" for i in range(101)])}
    )
    # Non-square, larger than the model's input, and one grayscale picture as Food-101 has.
    sizes = [(120, 80, "RGB"), (64, 96, "RGB"), (100, 100, "L"), (90, 60, "RGB")]
    splits = {
        split: datasets.Dataset.from_dict(
            {
                "image": [noise_image(w, h, seed=i, mode=mode) for i, (w, h, mode) in enumerate(sizes)],
                "label": [100, 0, 50, 7],
            },
            features=features,
        )
        for split in ("train", "validation")
    }
    path = tmp_path / "food101"
    datasets.DatasetDict(splits).save_to_disk(str(path))
    return path


def first_batch(dm: ImageDataModule, split: str = "val") -> tuple[torch.Tensor, torch.Tensor]:
    dm.setup("fit")
    loader = dm.train_dataloader() if split == "train" else dm.val_dataloader()
    return next(iter(loader))


def test_cifar10_batches(cifar10_dir: Path) -> None:
    dm = CIFAR10DataModule(source=str(cifar10_dir), batch_size=4)
    assert dm.num_classes == 10
    images, labels = first_batch(dm)
    assert images.shape == (4, 3, 32, 32)
    assert images.dtype == torch.float32
    assert labels.dtype == torch.int64
    assert labels.tolist() == [0, 1, 2, 3]
    images, labels = first_batch(dm, "train")
    assert images.shape == (4, 3, 32, 32)
    assert set(labels.tolist()) <= set(range(10))


def test_cifar10_training_order_follows_seed(cifar10_dir: Path) -> None:
    def order(seed: int) -> list[int]:
        dm = CIFAR10DataModule(source=str(cifar10_dir), batch_size=10, seed=seed)
        return first_batch(dm, "train")[1].tolist()

    assert order(0) == order(0)
    assert sorted(order(0)) == list(range(10))
    assert any(order(0) != order(seed) for seed in (1, 2, 3))


def test_cifar100_fine_and_coarse_labels(cifar100_dir: Path) -> None:
    fine = CIFAR100DataModule(source=str(cifar100_dir), batch_size=8)
    assert fine.num_classes == 100
    assert first_batch(fine)[1].tolist() == [97, 90, 83, 76, 69]
    assert fine.num_classes == 100
    coarse = CIFAR100DataModule(source=str(cifar100_dir), label_column="coarse_label", batch_size=8)
    assert coarse.num_classes == 20
    assert first_batch(coarse)[1].tolist() == [19, 18, 17, 16, 15]


def test_food101_resizes_non_square_images(food101_dir: Path) -> None:
    dm = Food101DataModule(source=str(food101_dir), image_size=40, batch_size=4)
    assert dm.num_classes == 101
    images, labels = first_batch(dm)
    assert images.shape == (4, 3, 40, 40)
    assert labels.tolist() == [100, 0, 50, 7]
    images, _ = first_batch(dm, "train")
    assert images.shape == (4, 3, 40, 40)
    # The grayscale picture became three equal channels.
    gray = first_batch(Food101DataModule(source=str(food101_dir), image_size=40, mean=(0.5,) * 3, std=(0.5,) * 3))[0]
    assert torch.equal(gray[2, 0], gray[2, 1])
    assert torch.equal(gray[2, 1], gray[2, 2])


def test_imagefolder_layout(tmp_path: Path) -> None:
    root = tmp_path / "folder"
    for split, count in (("train", 3), ("test", 2)):
        for name in ("cat", "dog"):
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                noise_image(50, 30, seed=i).save(root / split / name / f"{i}.png")
    dm = ImageDataModule(source=str(root), image_size=24, batch_size=8)
    assert dm.num_classes == 2  # no known count: read from the ClassLabel that imagefolder builds
    images, labels = first_batch(dm)
    assert images.shape == (4, 3, 24, 24)
    assert sorted(labels.tolist()) == [0, 0, 1, 1]


def test_parquet_files(tmp_path: Path) -> None:
    root = tmp_path / "parquet"
    root.mkdir()
    for split, dataset in cifar10_splits(train=4, test=3).items():
        dataset.to_parquet(str(root / f"{split}.parquet"))
    dm = CIFAR10DataModule(source=str(root), batch_size=8)
    images, labels = first_batch(dm)
    assert images.shape == (3, 3, 32, 32)
    assert labels.tolist() == [0, 1, 2]
    assert dm.num_classes == 10


def test_limits_take_the_first_images(cifar10_dir: Path) -> None:
    dm = CIFAR10DataModule(source=str(cifar10_dir), limit_train=3, limit_val=2, batch_size=16)
    dm.setup("fit")
    assert dm.train_set is not None
    assert dm.val_set is not None
    assert len(dm.train_set) == 3
    assert len(dm.val_set) == 2
    assert next(iter(dm.val_dataloader()))[1].tolist() == [0, 1]


def test_normalization_uses_the_dataset_statistics(tmp_path: Path) -> None:
    grey = Image.new("RGB", (32, 32), (128, 64, 200))
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=CIFAR10_NAMES)})
    split = datasets.Dataset.from_dict({"img": [grey], "label": [0]}, features=features)
    datasets.DatasetDict(train=split, test=split).save_to_disk(str(tmp_path / "grey"))
    pixel = torch.tensor([128, 64, 200]) / 255

    def normalized(dm: ImageDataModule) -> torch.Tensor:
        return first_batch(dm)[0][0, :, 5, 7]

    expected = (pixel - torch.tensor(CIFAR10_MEAN)) / torch.tensor(CIFAR10_STD)
    assert torch.allclose(normalized(CIFAR10DataModule(source=str(tmp_path / "grey"))), expected, atol=1e-6)
    expected = (pixel - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)
    assert torch.allclose(normalized(ImageDataModule(source=str(tmp_path / "grey"), image_column="img")), expected)
    custom = CIFAR10DataModule(source=str(tmp_path / "grey"), mean=(0.5, 0.25, 0.0), std=(0.5, 0.5, 2.0))
    assert torch.allclose(normalized(custom), (pixel - torch.tensor([0.5, 0.25, 0.0])) / torch.tensor([0.5, 0.5, 2.0]))


def test_flip_and_cutout_only_in_training(tmp_path: Path) -> None:
    # Left half black, right half white: a flip is visible, and after normalization to +-1 no pixel is 0 but Cutout's.
    pixels = np.zeros((32, 32, 3), dtype=np.uint8)
    pixels[:, 16:] = 255
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=CIFAR10_NAMES)})
    split = datasets.Dataset.from_dict({"img": [Image.fromarray(pixels)] * 64, "label": [3] * 64}, features=features)
    datasets.DatasetDict(train=split, test=split).save_to_disk(str(tmp_path / "halves"))
    dm = CIFAR10DataModule(source=str(tmp_path / "halves"), cutout=8, mean=(0.5,) * 3, std=(0.5,) * 3, batch_size=64)
    train, _ = first_batch(dm, "train")
    flipped = train[:, 0, 16, 0] == 1.0  # white at the left edge
    assert 0 < int(flipped.sum()) < 64
    holes = (train == 0).all(dim=1).flatten(1).sum(dim=1)  # zeroed pixels per image, in every channel
    assert (holes > 0).all()
    assert (holes <= 64).all()
    evaluation, _ = first_batch(dm)
    assert not (evaluation == 0).any()
    assert (evaluation[:, :, :, :16] == -1).all()
    assert (evaluation[:, :, :, 16:] == 1).all()


def test_cutout_zeroes_one_square() -> None:
    cutout = Cutout(6, generator=torch.Generator().manual_seed(0))
    image = torch.ones(3, 20, 20)
    sizes: Counter[int] = Counter()
    for _ in range(400):
        out = cutout(image)
        zero = out[0] == 0
        assert torch.equal(zero, out[1] == 0)
        assert torch.equal(zero, out[2] == 0)
        rows, cols = zero.any(dim=1).nonzero().flatten(), zero.any(dim=0).nonzero().flatten()
        box = torch.zeros_like(zero)
        box[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1] = True
        assert torch.equal(zero, box)  # a single filled rectangle
        height, width = len(rows), len(cols)
        inside = rows.min() > 0 and cols.min() > 0 and rows.max() < 19 and cols.max() < 19
        if inside:
            assert (height, width) == (6, 6)
        else:  # clipped by a border: never larger, and cut only where it touches the border
            assert height <= 6
            assert width <= 6
            assert height == 6 or rows.min() == 0 or rows.max() == 19
            assert width == 6 or cols.min() == 0 or cols.max() == 19
        sizes[height * width] += 1
    assert image.eq(1).all()  # the input is left untouched
    # Centres are uniform over the whole image, so squares reach past every border now and then.
    assert sizes[36] > 100
    assert sum(count for area, count in sizes.items() if area < 36) > 100
    assert min(sizes) <= 12  # e.g. a corner: 3x3, 3x4 or 4x3 when the centre sits in it


def test_cutout_odd_length_and_off() -> None:
    image = torch.ones(1, 40, 40)
    areas = {int((Cutout(5, torch.Generator().manual_seed(s))(image) == 0).sum()) for s in range(60)}
    assert 25 in areas
    assert max(areas) == 25
    assert torch.equal(Cutout(0)(image), image)
    with pytest.raises(ValueError, match=r"Cutout length=-1 must be a non-negative"):
        Cutout(-1)


def test_cutout_follows_its_generator() -> None:
    image = torch.ones(3, 16, 16)
    first = Cutout(4, torch.Generator().manual_seed(7))
    second = Cutout(4, torch.Generator().manual_seed(7))
    assert all(torch.equal(first(image), second(image)) for _ in range(10))


def test_bad_column_lists_the_columns(cifar10_dir: Path) -> None:
    dm = ImageDataModule(source=str(cifar10_dir))  # generic default image_column="image"; CIFAR's is "img"
    with pytest.raises(ValueError, match=r"image_column='image' is not a column .* \['img', 'label'\]"):
        dm.setup("fit")
    dm = CIFAR10DataModule(source=str(cifar10_dir), label_column="fine_label")
    with pytest.raises(ValueError, match=r"label_column='fine_label' is not a column .* \['img', 'label'\]"):
        dm.setup("fit")


def test_bad_split_lists_the_splits(cifar10_dir: Path) -> None:
    dm = CIFAR10DataModule(source=str(cifar10_dir), val_split="validation")
    with pytest.raises(ValueError, match=r"no split 'validation'; its splits are \['test', 'train'\]"):
        dm.setup("fit")


def test_offline_hub_id_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    before = datasets.config.HF_HUB_OFFLINE
    dm = CIFAR10DataModule()
    with pytest.raises(ConnectionError, match=r"'uoft-cs/cifar10'.*offline.*source=<local folder>.*save_to_disk"):
        dm.prepare_data()
    with pytest.raises(ConnectionError, match=r"'ethz/food101'.*save_to_disk\('food101'\)"):
        Food101DataModule().setup("fit")
    assert before == datasets.config.HF_HUB_OFFLINE


def test_missing_local_folder_and_single_split(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"source='\./nowhere/cifar' looks like a local folder but there is no such"):
        CIFAR10DataModule(source="./nowhere/cifar").setup("fit")
    cifar10_splits()["train"].save_to_disk(str(tmp_path / "one"))
    with pytest.raises(ValueError, match=r"single split written by Dataset.save_to_disk.*DatasetDict\("):
        CIFAR10DataModule(source=str(tmp_path / "one")).setup("fit")


@pytest.mark.parametrize(
    ("argument", "value", "message"),
    [
        ("image_size", 0, r"image_size=0 must be an integer >= 1"),
        ("cutout", -2, r"cutout=-2 must be an integer >= 0"),
        ("limit_train", 0, r"limit_train=0 must be a positive number of images"),
        ("mean", (0.5, 0.5), r"mean=\(0.5, 0.5\) must hold one value per RGB channel"),
    ],
)
def test_bad_arguments(argument: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CIFAR10DataModule(**{argument: value})  # type: ignore[arg-type]


def test_hyperparameters_rebuild_the_module(cifar10_dir: Path) -> None:
    for dm in (
        CIFAR10DataModule(source=str(cifar10_dir), cutout=4),
        EmbeddedImageDataModule(task="pairs", num_train=20, batch_size=5),
    ):
        rebuilt = type(dm)(**dm.hparams)
        assert dict(rebuilt.hparams) == dict(dm.hparams)
    assert "source" not in EmbeddedImageDataModule().hparams


def test_transformed_split_survives_pickling(cifar10_dir: Path) -> None:
    # Data-loader workers started with "spawn" receive the dataset, transform included, by pickle.
    dm = CIFAR10DataModule(source=str(cifar10_dir), cutout=4)
    dm.setup("fit")
    example = pickle.loads(pickle.dumps(dm.train_set))[0]
    assert example["image"].shape == (3, 32, 32)


def png_bytes(split: datasets.Dataset) -> list[bytes]:
    return [image["bytes"] for image in split.cast_column("img", datasets.Image(decode=False))["img"]]


def test_embedded_dataset_is_deterministic() -> None:
    first = make_embedded_dataset("shapes", num_train=30, num_val=10, seed=3)
    again = make_embedded_dataset("shapes", num_train=30, num_val=10, seed=3)
    other = make_embedded_dataset("shapes", num_train=30, num_val=10, seed=4)
    for split in ("train", "test"):
        assert png_bytes(first[split]) == png_bytes(again[split])
        assert first[split]["label"] == again[split]["label"]
        assert set(png_bytes(first[split])).isdisjoint(png_bytes(other[split]))
    assert set(png_bytes(first["train"])).isdisjoint(png_bytes(first["test"]))
    # The test split does not depend on the size of the training split.
    larger = make_embedded_dataset("shapes", num_train=50, num_val=10, seed=3)
    assert png_bytes(larger["test"]) == png_bytes(first["test"])


def test_embedded_dataset_has_the_cifar10_schema() -> None:
    cifar = cifar10_splits(train=2, test=2)
    for task, num_classes in (("shapes", 10), ("pairs", 6)):
        embedded = make_embedded_dataset(task, num_train=12, num_val=6)
        assert list(embedded) == list(cifar)
        for split in embedded.values():
            assert split.column_names == cifar["train"].column_names
            assert split.features["img"] == cifar["train"].features["img"]
            assert isinstance(split.features["label"], datasets.ClassLabel)
            assert split.features["label"].num_classes == num_classes
            image = split[0]["img"]
            assert (image.mode, image.size) == ("RGB", (32, 32))


@pytest.mark.parametrize(("task", "num_classes"), [("shapes", 10), ("pairs", 6)])
def test_embedded_classes_are_balanced(task: str, num_classes: int) -> None:
    labels = make_embedded_dataset(task, num_train=97, num_val=13)["train"]["label"]
    counts = Counter(labels)
    assert set(counts) == set(range(num_classes))
    assert max(counts.values()) - min(counts.values()) <= 1
    assert labels != sorted(labels)


def test_embedded_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown embedded task 'circles'; choose one of 'shapes', 'pairs'"):
        make_embedded_dataset("circles")
    with pytest.raises(ValueError, match=r"unknown embedded task"):
        EmbeddedImageDataModule(task="circles")
    with pytest.raises(ValueError, match=r"num_val=0 must be a positive number of images"):
        make_embedded_dataset("shapes", num_train=10, num_val=0)


def test_embedded_cache_is_read_back(tmp_path: Path) -> None:
    drawn = load_embedded_dataset("pairs", num_train=12, num_val=6, seed=1, cache_dir=str(tmp_path))
    path = embedded_dataset_path(tmp_path, "pairs", 12, 6, 1)
    assert (path / "dataset_dict.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no staging folder left behind
    (path / "train" / "dataset_info.json").touch()  # a redraw would rewrite it; reading leaves it as it is
    stamp = (path / "train" / "dataset_info.json").stat().st_mtime_ns
    cached = load_embedded_dataset("pairs", num_train=12, num_val=6, seed=1, cache_dir=str(tmp_path))
    assert (path / "train" / "dataset_info.json").stat().st_mtime_ns == stamp
    assert png_bytes(cached["train"]) == png_bytes(drawn["train"])


def test_embedded_data_module_reads_like_cifar10(tmp_path: Path) -> None:
    dm = EmbeddedImageDataModule(task="pairs", num_train=24, num_val=12, cache_dir=str(tmp_path), batch_size=8)
    assert dm.num_classes == 6
    dm.prepare_data()
    images, labels = first_batch(dm)
    assert images.shape == (8, 3, 32, 32)
    assert labels.dtype == torch.int64
    assert dm.num_classes == 6
    # The cached folder is an ordinary CIFAR-10-schema dataset: the CIFAR-10 module reads it unchanged.
    cifar = CIFAR10DataModule(source=str(embedded_dataset_path(tmp_path, "pairs", 24, 12, 0)), batch_size=8)
    assert torch.equal(first_batch(cifar)[1], labels)
    assert cifar.num_classes == 6
    # Without a cache the same images are drawn in memory.
    in_memory = EmbeddedImageDataModule(task="pairs", num_train=24, num_val=12, batch_size=8)
    assert torch.equal(first_batch(in_memory)[0], images)


def test_embedded_statistics_normalize_to_zero_mean_unit_std() -> None:
    dm = EmbeddedImageDataModule(task="shapes", num_train=16, num_val=600, batch_size=600)
    images, _ = first_batch(dm)
    assert images.mean(dim=(0, 2, 3)).abs().max() < 0.06
    assert (images.std(dim=(0, 2, 3)) - 1).abs().max() < 0.06


class TinyClassifier(L.LightningModule):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes)
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self.layers(images), labels)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        self.log("val_loss", F.cross_entropy(self.layers(images), labels))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_trainer_runs_on_the_embedded_data(tmp_path: Path) -> None:
    dm = EmbeddedImageDataModule(task="shapes", num_train=16, num_val=8, batch_size=8, cutout=8)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(TinyClassifier(dm.num_classes), datamodule=dm)
    assert trainer.global_step == 2
    assert "val_loss" in trainer.callback_metrics


@pytest.mark.slow
@pytest.mark.parametrize("task", ["shapes", "pairs"])
def test_embedded_tasks_are_learnable(task: str) -> None:
    """A small CNN ends far above chance after a few epochs (about a minute of one CPU core each)."""
    dm = EmbeddedImageDataModule(task=task, num_train=4000, num_val=1000, batch_size=64, hflip=True)
    dm.setup("fit")

    def block(inputs: int, outputs: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(inputs, outputs, 3, padding=1, bias=False), nn.BatchNorm2d(outputs), nn.ReLU())

    net = nn.Sequential(
        block(3, 32), nn.MaxPool2d(2), block(32, 64), nn.MaxPool2d(2), block(64, 128), nn.MaxPool2d(2),
        block(128, 128), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, dm.num_classes),
    )  # fmt: skip
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=1e-4)
    steps = 12 * len(dm.train_dataloader())
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps)
    for _ in range(12):
        for images, labels in dm.train_dataloader():
            loss = F.cross_entropy(net(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
    net.eval()
    with torch.no_grad():
        correct = sum(int((net(images).argmax(1) == labels).sum()) for images, labels in dm.val_dataloader())
    assert correct / 1000 > 3 / dm.num_classes
