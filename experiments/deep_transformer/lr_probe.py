"""The learning-rate probe behind run.py's choice: 60 steps of the deep model, with and without the stabilizers.

Prints, per (learning rate, stabilized), the seconds taken, every 6th training loss and the last one. The log of the
run quoted in docs/zoo/transformer_experiments.md is lr_probe.log next to this file (it ran as two invocations,
``3e-3 1e-2`` and ``3e-2 1e-1``, while other jobs shared the machine, so the seconds vary)::

    OMP_NUM_THREADS=1 python experiments/deep_transformer/lr_probe.py 3e-3 1e-2 3e-2 1e-1
"""

from __future__ import annotations

import sys
import time

import torch

from zoo.data.translation import TranslationDataModule
from zoo.tasks.translation import Transformer

__all__ = ["main"]


def main(learning_rates: list[float]) -> None:
    torch.manual_seed(0)
    datamodule = TranslationDataModule(pairs=["en-xa", "en-xb", "en-xc", "en-xd"], vocab_size=1000, batch_size=32)
    datamodule.setup()
    assert datamodule.tokenizer is not None
    for lr in learning_rates:
        for stabilized in (True, False):
            torch.manual_seed(0)
            model = Transformer(
                num_layers=24, ff_dim=256, num_heads=2, d_model=64, head_dim=32,
                vocab_size=datamodule.tokenizer.vocab_size, dropout=0.0,
                ff_init_scaling=stabilized, logits_abs_max=20.0 if stabilized else None, lr=lr, warmup_steps=20,
            )  # fmt: skip
            optimization = model.configure_optimizers()
            optimizer, schedule = optimization["optimizer"], optimization["lr_scheduler"]["scheduler"]
            batches = iter(datamodule.train_dataloader())
            start, losses = time.time(), []
            for _ in range(60):
                source, target = next(batches)
                loss = model._loss(model(source, target[:, :-1]), target[:, 1:])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.step()
                losses.append(loss.item())
            every_sixth = [round(x, 2) for x in losses[::6]]
            print(lr, stabilized, round(time.time() - start), every_sixth, round(losses[-1], 3), flush=True)


if __name__ == "__main__":
    main([float(arg) for arg in sys.argv[1:]] or [3e-3, 1e-2, 3e-2, 1e-1])
