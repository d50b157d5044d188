"""`make demo`: pretrain a small AmoebaNet-D as a 2-stage GPipe pipeline, then fine-tune it on a second task.

    python examples/demo.py                        # a few minutes on two CPU cores
    python examples/demo.py --quick --out /tmp/d   # the short run the test suite uses

Both tasks are the project's embedded image data (32x32 RGB in the CIFAR-10 schema, generated on first use, so
nothing is downloaded): "shapes" for pretraining, then "pairs", a task with other classes drawn from the same
visual world. Fine-tuning starts from the pretrained backbone with new heads, exactly as the GPipe paper moves its
ImageNet AmoebaNet to CIFAR-10 (``zoo.load_pretrained``). Lightning's launcher runs this script once per stage (it
re-runs it with LOCAL_RANK=1 for the second), so the work lives under ``if __name__ == "__main__":``. It saves two
plots: ``accuracy.png`` (validation accuracy by epoch, both tasks) and ``timeline.png`` (the pipeline's schedule).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar

import lightning_gpipe
import zoo
from lightning_gpipe.callbacks import PipelineTimeline
from zoo.data import EmbeddedImageDataModule

SEED = 0


def trainer(out: Path, epochs: int, *callbacks: Any) -> L.Trainer:
    return L.Trainer(
        strategy=lightning_gpipe.GPipeStrategy(pipe_size=2, chunks=4, deferred_batch_norm=True),
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        logger=False,
        default_root_dir=out,
        gradient_clip_val=10.0,  # the AmoebaNet recipe clips the global norm at 10
        callbacks=[RichProgressBar(), *callbacks],
    )


class AccuracyCurve(L.Callback):
    """Validation accuracy after every epoch, kept on global rank 0 (the last stage, which computes the metrics)."""

    def __init__(self, start: float | None = None) -> None:
        self.points: list[float] = [] if start is None else [start]

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        fitting = trainer.state.fn == "fit" and not trainer.sanity_checking  # not the separate validate() calls
        if fitting and "val_acc" in trainer.callback_metrics:
            self.points.append(float(trainer.callback_metrics["val_acc"]))


def plot_curves(path: Path, curves: dict[str, tuple[list[float], float, int]]) -> None:
    """One panel per task: validation accuracy by epoch (epoch 0 = before training, where known) and chance."""
    from matplotlib.figure import Figure  # only rank 0 draws; the figure needs no display

    figure = Figure(figsize=(4.2 * len(curves), 3.2), layout="constrained")
    for axes, (title, (points, chance, first)) in zip(figure.subplots(1, len(curves)), curves.items(), strict=True):
        epochs = range(first, first + len(points))
        axes.plot(epochs, [100 * p for p in points], marker="o", label="validation accuracy")
        axes.axhline(100 * chance, color="grey", linestyle="--", label="chance")
        axes.set(title=title, xlabel="epoch", ylabel="accuracy (%)", ylim=(0, 100), xticks=list(epochs))
        axes.legend(loc="upper left")
    figure.savefig(path, dpi=120)


def accuracy(trainer: L.Trainer, model: L.LightningModule, data: L.LightningDataModule) -> float:
    (metrics,) = trainer.validate(model, data, verbose=False)
    return float(metrics["val_acc"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/demo"), help="checkpoints and timeline.png go here")
    parser.add_argument("--quick", action="store_true", help="a tiny run that only checks the whole flow works")
    args = parser.parse_args()
    samples = (256, 128) if args.quick else (4000, 1000)
    epochs = (1, 1) if args.quick else (3, 2)
    common = {"num_train": samples[0], "num_val": samples[1], "batch_size": 64, "cache_dir": str(args.out / "data")}
    shapes = EmbeddedImageDataModule(task="shapes", dataset_seed=1, **common)
    pairs = EmbeddedImageDataModule(task="pairs", dataset_seed=2, **common)
    shapes.prepare_data()
    pairs.prepare_data()

    L.seed_everything(SEED, verbose=False)  # both stages build the same initial weights
    # Sized for a few hundred steps on two CPU cores. The CIFAR stem (a stride-1 convolution, no stem cells) keeps the
    # first stack at 32x32: the ImageNet stem shrinks a 32-pixel image to 4x4 before it, and the same budget then
    # ends near 30 %. AdamW at a high rate rather than the paper's RMSProp (whose epsilon of 1.0 wants long runs).
    model = zoo.create_model(
        "amoebanet_d", num_layers=3, num_filters=16, stem="cifar", num_classes=shapes.num_classes, image_size=32,
        optimizer="adamw", lr=1e-2, warmup_epochs=0.3, lr_decay_rate=0.7, lr_decay_epochs=1.0, dropout=0.0,
    )  # fmt: skip
    checkpoint = ModelCheckpoint(dirpath=args.out / "pretrain", save_last=True, save_top_k=0)
    pretrain_curve = AccuracyCurve()
    started = time.perf_counter()
    pretrain = trainer(args.out, epochs[0], checkpoint, pretrain_curve, PipelineTimeline(args.out / "timeline.png"))
    pretrain.fit(model, shapes)
    pretrained = accuracy(pretrain, model, shapes)

    L.seed_everything(SEED, verbose=False)  # the same new heads on both stages
    finetuned = zoo.load_pretrained(checkpoint.last_model_path, num_classes=pairs.num_classes)
    finetune_curve = AccuracyCurve()
    finetune = trainer(args.out, epochs[1], finetune_curve)
    before = accuracy(finetune, finetuned, pairs)
    finetune.fit(finetuned, pairs)
    after = accuracy(finetune, finetuned, pairs)
    seconds = time.perf_counter() - started
    if not pretrain.is_global_zero:
        return
    plot_curves(
        args.out / "accuracy.png",
        {
            "pretraining on 'shapes' (K = 2)": (pretrain_curve.points, 1 / shapes.num_classes, 1),
            "fine-tuning on 'pairs', new heads (K = 2)": ([before, *finetune_curve.points], 1 / pairs.num_classes, 0),
        },
    )
    print(f"\npretrained AmoebaNet-D(3, 16) on 'shapes' ({shapes.num_classes} classes): val accuracy {pretrained:.1%}")
    print(f"fine-tuning on 'pairs' ({pairs.num_classes} classes, new heads): {finetuned.load_report.summary()}")
    print(f"  val accuracy before fine-tuning: {before:.1%} (chance {1 / pairs.num_classes:.1%})")
    print(f"  val accuracy after {epochs[1]} epoch(s):    {after:.1%}")
    print(f"{seconds:.0f} s in all; checkpoint {checkpoint.last_model_path}")
    print(f"plots: {args.out / 'accuracy.png'} (accuracy by epoch), {args.out / 'timeline.png'} (pipeline timeline)")


if __name__ == "__main__":
    main()
