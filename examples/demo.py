"""`make demo`: pretrain a small AmoebaNet-D as a 2-stage GPipe pipeline, then fine-tune it on a second task.

    python examples/demo.py                        # about 5 minutes on two idle CPU cores
    python examples/demo.py --quick --out /tmp/d   # the short run the test suite uses

Both tasks are the project's embedded image data (32x32 RGB in the CIFAR-10 schema, generated on first use, so
nothing is downloaded): "shapes" for pretraining, then "pairs", a task with other classes drawn from the same
visual world, with few training images. Fine-tuning starts from the pretrained backbone with new heads, exactly as
the GPipe paper moves its ImageNet AmoebaNet to CIFAR-10 (``zoo.load_pretrained``); the same network trained on
"pairs" from random weights, for as many steps, shows what the pretrained features are worth. Lightning's launcher
runs this script once per stage (it re-runs it with LOCAL_RANK=1 for the second), so the work lives under
``if __name__ == "__main__":``. It ends with a summary table and saves two plots: ``accuracy.png`` (validation
accuracy by epoch: pretraining, then fine-tuning against from scratch) and ``timeline.png`` (the pipeline's schedule).
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_gpipe
import zoo
from lightning_gpipe.callbacks import PipelineTimeline
from zoo.data import EmbeddedImageDataModule
from zoo.progress import LineProgress

SEED = 0
PIPE_SIZE, CHUNKS = 2, 4
# Layers per stage: the stem and the first cell, at 32x32, cost about as much CPU time as the six layers after them
# (FLOP balancing, the default, also gives the first stage the reduction cell and leaves the second one waiting).
BALANCE = [2, 6]
# AmoebaNet-D(3, 8): one normal cell per stack, 8 filters in the first. The CIFAR stem (a stride-1 convolution, no
# stem cells) keeps the first stack at 32x32: the ImageNet stem shrinks a 32-pixel image to 4x4 before it, and the
# network then learns little in a few hundred steps. 8 filters cost 30 % less per step than 16 and learned no slower.
ARCHITECTURE: dict[str, Any] = {"num_layers": 3, "num_filters": 8, "stem": "cifar", "image_size": 32}
NAME = "AmoebaNet-D(3, 8)"
# AdamW at a high rate, not the paper's RMSProp (whose epsilon of 1.0 wants long runs); no dropout on runs this short.
RECIPE: dict[str, Any] = {
    "optimizer": "adamw", "lr": 1e-2, "warmup_epochs": 0.3, "lr_decay_rate": 0.7, "lr_decay_epochs": 1.0,
    "dropout": 0.0,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Phase:
    """The data and length of one training run."""

    num_train: int
    num_val: int
    epochs: int


# Full: the pretraining task is large, the fine-tuning task small (where pretrained features pay off the most).
FULL = {"pretrain": Phase(3000, 250, 4), "finetune": Phase(1000, 250, 4)}
QUICK = {"pretrain": Phase(256, 128, 1), "finetune": Phase(128, 128, 1)}


def trainer(out: Path, epochs: int, *callbacks: Any) -> L.Trainer:
    return L.Trainer(
        # No re-materialization: it trades compute for memory, and this network's activations take a few MB.
        strategy=lightning_gpipe.GPipeStrategy(
            pipe_size=PIPE_SIZE, chunks=CHUNKS, balance=BALANCE, checkpoint="never", deferred_batch_norm=True
        ),
        accelerator="cpu",
        devices=PIPE_SIZE,
        max_epochs=epochs,
        logger=False,
        default_root_dir=out,
        gradient_clip_val=10.0,  # the AmoebaNet recipe clips the global norm at 10
        num_sanity_val_steps=0,  # every epoch ends with a full validation anyway
        enable_checkpointing=any(isinstance(callback, ModelCheckpoint) for callback in callbacks),
        callbacks=[*callbacks, LineProgress()],  # a line per epoch when the output is redirected
    )


class AccuracyCurve(L.Callback):
    """Validation accuracy after every epoch, kept on global rank 0 (the last stage, which computes the metrics)."""

    def __init__(self) -> None:
        self.points: list[float] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        fitting = trainer.state.fn == "fit" and not trainer.sanity_checking  # not the separate validate() calls
        if fitting and "val_acc" in trainer.callback_metrics:
            self.points.append(float(trainer.callback_metrics["val_acc"]))


def plot_curves(path: Path, panels: dict[str, tuple[dict[str, tuple[list[float], int]], float]]) -> None:
    """One panel per task: each curve's validation accuracy by epoch (from its first epoch on), and chance."""
    from matplotlib.figure import Figure  # only rank 0 draws; the figure needs no display

    figure = Figure(figsize=(4.6 * len(panels), 3.4), layout="constrained")
    for axes, (title, (curves, chance)) in zip(figure.subplots(1, len(panels)), panels.items(), strict=True):
        ticks: set[int] = set()
        for label, (points, first) in curves.items():
            epochs = range(first, first + len(points))
            axes.plot(epochs, [100 * p for p in points], marker="o", label=label)
            ticks.update(epochs)
        axes.axhline(100 * chance, color="grey", linestyle="--", label="chance")
        axes.set(title=title, xlabel="epoch", ylabel="validation accuracy (%)", ylim=(0, 100), xticks=sorted(ticks))
        axes.legend(loc="upper left", fontsize=8)
    figure.savefig(path, dpi=120)


def accuracy(trainer: L.Trainer, model: L.LightningModule, data: L.LightningDataModule) -> float:
    (metrics,) = trainer.validate(model, data, verbose=False)
    return float(metrics["val_acc"])


def cpu_seconds() -> float:
    """User + system CPU time of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/demo"), help="checkpoints and plots go here")
    parser.add_argument("--quick", action="store_true", help="a tiny run that only checks the whole flow works")
    args = parser.parse_args()
    phases = QUICK if args.quick else FULL
    pre, fine = phases["pretrain"], phases["finetune"]
    cache = str(args.out / "data")
    shapes, pairs = (
        EmbeddedImageDataModule(task, phase.num_train, phase.num_val, dataset_seed=seed, cache_dir=cache, batch_size=64)
        for task, phase, seed in (("shapes", pre, 1), ("pairs", fine, 2))
    )
    shapes.prepare_data()
    pairs.prepare_data()
    seconds: dict[str, float] = {}

    started = time.perf_counter()
    L.seed_everything(SEED, verbose=False)  # both stages build the same initial weights
    model = zoo.create_model("amoebanet_d", num_classes=shapes.num_classes, **ARCHITECTURE, **RECIPE)
    checkpoint = ModelCheckpoint(dirpath=args.out / "pretrain", save_last=True, save_top_k=0)
    pretrain_curve = AccuracyCurve()
    timeline = PipelineTimeline(args.out / "timeline.png")
    pretrain = trainer(args.out, pre.epochs, checkpoint, pretrain_curve, timeline)
    pretrain.fit(model, shapes)
    seconds["pretraining"] = time.perf_counter() - started

    started = time.perf_counter()
    L.seed_everything(SEED, verbose=False)  # the same new heads on both stages
    finetuned = zoo.load_pretrained(checkpoint.last_model_path, num_classes=pairs.num_classes)
    finetune_curve = AccuracyCurve()
    finetune = trainer(args.out, fine.epochs, finetune_curve)
    before = accuracy(finetune, finetuned, pairs)
    finetune.fit(finetuned, pairs)
    seconds["fine-tuning"] = time.perf_counter() - started

    started = time.perf_counter()
    L.seed_everything(SEED, verbose=False)  # the same steps on 'pairs' from random weights: what pretraining gave
    scratch = zoo.create_model("amoebanet_d", num_classes=pairs.num_classes, **ARCHITECTURE, **RECIPE)
    scratch_curve = AccuracyCurve()
    trainer(args.out, fine.epochs, scratch_curve).fit(scratch, pairs)
    seconds["from scratch"] = time.perf_counter() - started

    # The process group outlives the fits: gather every stage's CPU time, the cost that does not depend on the load.
    cpu: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(cpu, cpu_seconds())
    if not pretrain.is_global_zero:
        return
    plot_curves(
        args.out / "accuracy.png",
        {
            "pretraining on 'shapes' (K = 2)": (
                {f"{NAME}, {pre.num_train:,} images": (pretrain_curve.points, 1)},
                1 / shapes.num_classes,
            ),
            f"'pairs', {fine.num_train:,} images (K = 2)": (
                {
                    "pretrained backbone, new heads": ([before, *finetune_curve.points], 0),
                    "from scratch": (scratch_curve.points, 1),
                },
                1 / pairs.num_classes,
            ),
        },
    )
    pretrained, after, from_scratch = pretrain_curve.points[-1], finetune_curve.points[-1], scratch_curve.points[-1]
    bubble = timeline.measured_bubble
    rows = [
        (f"pretraining on 'shapes', {shapes.num_classes} classes, {pre.num_train:,} images", pre.epochs, pretrained,
         1 / shapes.num_classes, seconds["pretraining"]),
        (f"'pairs', {pairs.num_classes} classes, {fine.num_train:,} images: new heads, untrained", 0, before,
         1 / pairs.num_classes, None),
        ("  fine-tuned from the pretrained backbone", fine.epochs, after, 1 / pairs.num_classes,
         seconds["fine-tuning"]),
        ("  the same network from scratch", fine.epochs, from_scratch, 1 / pairs.num_classes, seconds["from scratch"]),
    ]  # fmt: skip
    print(f"\n{finetuned.load_report.summary()}")
    print(f"{NAME} as a GPipe pipeline of K = {PIPE_SIZE} stages (one CPU process each), M = {CHUNKS}")
    print(f"{'run':<64} {'epochs':>6} {'val accuracy':>12} {'chance':>7} {'wall':>6}")
    for name, epochs, value, chance, wall in rows:
        took = "" if wall is None else f"{wall:.0f} s"
        print(f"{name:<64} {epochs:>6} {value:>12.1%} {chance:>7.1%} {took:>6}")
    total = sum(seconds.values())
    print(
        f"{total:.0f} s of training and validation; CPU time {sum(cpu):.0f} s ({' + '.join(f'{c:.0f}' for c in cpu)} "
        f"s over the {len(cpu)} processes); measured pipeline bubble {bubble if bubble is None else f'{bubble:.0%}'}"
    )
    print(f"plots: {args.out / 'accuracy.png'} (accuracy by epoch), {args.out / 'timeline.png'} (pipeline timeline)")


if __name__ == "__main__":
    main()
