"""Trainability of a deep, narrow Transformer with and without the paper's two stabilizers; temperature sampling.

Part ``deep``: T(24, 256, 2) with d_model 64 (24 encoder + 24 decoder layers) on the embedded corpus, trained at one
learning rate (an aggressive 3e-2, then 3e-3) with both stabilizers (feed-forward init scaled by
``num_layers ** -0.5`` and training logits clipped to ``[-logits_abs_max, logits_abs_max]``) and with neither; the
training loss of every step is kept, a non-finite loss ends the run and is marked, and the BLEU per pair is measured
after training.

Part ``temperature``: a small T(3, 512, 4) trained on the same four pairs (20,000 / 4,000 / 500 / 300 sentence pairs)
with temperature sampling T = 5 and with proportional sampling (T = 1), BLEU per pair.

Training is single-process (``strategy="auto"`` on one CPU thread): the question is trainability, and that GPipe
training equals plain training is tested elsewhere (``tests/tests_gpipe``). Run from the repository root::

    OMP_NUM_THREADS=1 python experiments/deep_transformer/run.py             # every run, then the plots
    OMP_NUM_THREADS=1 python experiments/deep_transformer/run.py --plot-only # redraw from the saved JSON

Results go to ``docs/img/deep_transformer_results.json`` (after every run, so an interrupted run resumes where it
stopped) and the plots to ``docs/img/deep_transformer_*.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from matplotlib.figure import Figure

from zoo.data.translation import TranslationDataModule
from zoo.evaluation import evaluate_translation
from zoo.tasks.translation import Transformer

__all__ = ["LossRecorder", "main", "plot", "train_and_evaluate"]

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs/img/deep_transformer_results.json"
PAIRS = ["en-xa", "en-xb", "en-xc", "en-xd"]
VOCAB_SIZE = 1000
BATCH_SIZE = 32

DEEP_MODEL = {"num_layers": 24, "ff_dim": 256, "num_heads": 2, "d_model": 64, "head_dim": 32, "dropout": 0.0}
SMALL_MODEL = {"num_layers": 3, "ff_dim": 512, "num_heads": 4, "d_model": 128, "head_dim": 32, "dropout": 0.1}
LOGITS_ABS_MAX = 20.0

# name -> (part, model arguments, training arguments, sampling temperature)
RUNS: dict[str, tuple[str, dict[str, Any], dict[str, Any], float]] = {
    "deep_stabilized": (
        "deep",
        {**DEEP_MODEL, "ff_init_scaling": True, "logits_abs_max": LOGITS_ABS_MAX},
        {"lr": 3e-2, "warmup_steps": 40, "steps": 400},
        5.0,
    ),
    "deep_plain": (
        "deep",
        {**DEEP_MODEL, "ff_init_scaling": False, "logits_abs_max": None},
        {"lr": 3e-2, "warmup_steps": 40, "steps": 400},
        5.0,
    ),
    "deep_stabilized_lr3e-3": (
        "deep",
        {**DEEP_MODEL, "ff_init_scaling": True, "logits_abs_max": LOGITS_ABS_MAX},
        {"lr": 3e-3, "warmup_steps": 40, "steps": 300},
        5.0,
    ),
    "deep_plain_lr3e-3": (
        "deep",
        {**DEEP_MODEL, "ff_init_scaling": False, "logits_abs_max": None},
        {"lr": 3e-3, "warmup_steps": 40, "steps": 300},
        5.0,
    ),
    "temperature_5": ("temperature", SMALL_MODEL, {"lr": 2e-3, "warmup_steps": 100, "steps": 800}, 5.0),
    "temperature_1": ("temperature", SMALL_MODEL, {"lr": 2e-3, "warmup_steps": 100, "steps": 800}, 1.0),
}


class LossRecorder(Callback):
    """Keeps the training loss of every step; a non-finite loss stops training and is recorded as the divergence."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.diverged_at: int | None = None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = float(outputs["loss"])
        self.losses.append(loss)
        if not math.isfinite(loss) and self.diverged_at is None:
            self.diverged_at = len(self.losses) - 1
            trainer.should_stop = True


def train_and_evaluate(
    model_args: dict[str, Any], train_args: dict[str, Any], temperature: float, seed: int, eval_limit: int
) -> dict[str, Any]:
    """Train one model for ``train_args["steps"]`` steps; its greedy BLEU per pair on ``eval_limit`` test sentences."""
    L.seed_everything(seed, verbose=False)
    steps = train_args["steps"]
    datamodule = TranslationDataModule(
        pairs=PAIRS,
        temperature=temperature,
        vocab_size=VOCAB_SIZE,
        batch_size=BATCH_SIZE,
        max_length=64,
        seed=seed,
        num_samples=steps * BATCH_SIZE,  # one epoch is the whole run
    )
    datamodule.setup("fit")
    assert datamodule.tokenizer is not None
    model = Transformer(
        **model_args,
        vocab_size=datamodule.tokenizer.vocab_size,
        label_smoothing=0.1,
        lr=train_args["lr"],
        warmup_steps=train_args["warmup_steps"],
    )
    recorder = LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        max_epochs=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    train_seconds = time.perf_counter() - start
    start = time.perf_counter()
    if recorder.diverged_at is None:
        bleu = evaluate_translation(model, datamodule, "test", beam_size=1, limit=eval_limit)
    else:  # NaN weights decode to nothing meaningful
        bleu = dict.fromkeys([*PAIRS, "mean"], 0.0)
    return {
        "model": model_args,
        "training": train_args,
        "temperature": temperature,
        "seed": seed,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_sizes": datamodule.split_sizes("train"),
        "sampling_probabilities": datamodule.sampling_probabilities(),
        "losses": recorder.losses,
        "diverged_at": recorder.diverged_at,
        "bleu": bleu,
        "eval_sentences_per_pair": eval_limit,
        "train_seconds": train_seconds,
        "eval_seconds": time.perf_counter() - start,
    }


def _smooth(values: list[float], window: int = 10) -> list[float]:
    out, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        out.append(total / min(index + 1, window))
    return out


def plot(results: dict[str, Any], directory: Path) -> list[Path]:
    """Draw the loss curves and BLEU bars of the deep runs and the temperature bars; returns the files written."""
    written = []
    deep = {name: run for name, run in results.items() if RUNS[name][0] == "deep"}
    if deep:
        rates = sorted({run["training"]["lr"] for run in deep.values()}, reverse=True)
        figure = Figure(figsize=(5 * len(rates) + 5, 4), layout="constrained")
        *panels, bars = figure.subplots(1, len(rates) + 1, squeeze=True, width_ratios=[3] * len(rates) + [3])
        for lr, curves in zip(rates, panels, strict=True):
            for name, run in deep.items():
                if run["training"]["lr"] == lr:
                    _loss_curve(curves, name, run)
            curves.set_xlabel("step")
            curves.set_ylabel("training loss (label-smoothed, nats/token)")
            curves.set_title(f"T(24, 256, 2), d_model 64: peak lr {lr:g}")
            curves.legend()
        _bleu_bars(bars, deep, "BLEU after training (greedy, test)")
        written.append(directory / "deep_transformer_curves.png")
        figure.savefig(written[-1], dpi=120)
    sampling = {name: run for name, run in results.items() if RUNS[name][0] == "temperature"}
    if sampling:
        figure = Figure(figsize=(7, 4), layout="constrained")
        _bleu_bars(figure.subplots(), sampling, "T(3, 512, 4): BLEU per pair (greedy, test)")
        written.append(directory / "deep_transformer_temperature.png")
        figure.savefig(written[-1], dpi=120)
    return written


def _loss_curve(axes: Any, name: str, run: dict[str, Any]) -> None:
    losses = [loss if math.isfinite(loss) else float("nan") for loss in run["losses"]]
    (line,) = axes.plot(losses, alpha=0.25, linewidth=0.8)
    axes.plot(_smooth(losses), color=line.get_color(), label=f"{name} (10-step mean)")
    if run["diverged_at"] is not None:
        step = run["diverged_at"]
        last = next((x for x in reversed(losses[:step]) if math.isfinite(x)), losses[0])
        axes.plot([step], [last], "x", color="red", markersize=12, label=f"{name}: non-finite loss at step {step}")


def _bleu_bars(axes: Any, runs: dict[str, Any], title: str) -> None:
    sizes = next(iter(runs.values()))["train_sizes"]
    width = 0.8 / len(runs)
    for offset, (name, run) in enumerate(runs.items()):
        xs = [index + offset * width for index in range(len(PAIRS))]
        axes.bar(xs, [run["bleu"][pair] for pair in PAIRS], width, label=name.replace("_", " "))
    axes.set_xticks([index + 0.4 - width / 2 for index in range(len(PAIRS))])
    axes.set_xticklabels([f"{pair}\n{sizes[pair]:,} pairs" for pair in PAIRS])
    axes.set_ylabel("BLEU")
    axes.set_title(title)
    axes.legend()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument("--steps", type=int, default=None, help="override every run's steps (for a quick check)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--eval-limit", type=int, default=100, help="test sentences per pair scored for BLEU")
    options = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[str, Any] = json.loads(options.results.read_text()) if options.results.is_file() else {}
    if not options.plot_only:
        for name in options.runs:
            if name in results:
                print(f"{name}: already in {options.results}, skipped")
                continue
            _, model_args, train_args, temperature = RUNS[name]
            if options.steps is not None:
                train_args = {**train_args, "steps": options.steps}
            results[name] = train_and_evaluate(model_args, train_args, temperature, options.seed, options.eval_limit)
            run = results[name]
            print(
                f"{name}: final loss {run['losses'][-1]:.3f}, diverged at {run['diverged_at']}, "
                f"BLEU {run['bleu']}, {run['train_seconds']:.0f} s + {run['eval_seconds']:.0f} s",
                flush=True,
            )
            options.results.parent.mkdir(parents=True, exist_ok=True)
            options.results.write_text(json.dumps(results, indent=1))
    for path in plot(results, options.results.parent):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
