"""The zoo models the throughput benchmark trains, scaled down for one CPU thread, with their batch and loss.

Shapes: ``B`` samples per mini-batch, ``T`` tokens per sample, ``V`` vocabulary, ``D`` model width.

Every configuration of a workload trains the same model (same seed) on the same mini-batch with the model's own
training loss and plain SGD, so the configurations differ only in how the work is spread over threads,
micro-batches and processes. The stage split is the same for every pipeline: the cut that balances the layers'
forward FLOPs (:func:`lightning_gpipe.partition.balance.balance_by_cost`, as ``GPipeStrategy`` balances zoo models).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
from torch import nn

import zoo
from lightning_gpipe.partition.balance import balance_by_cost
from lightning_gpipe.profile.cost import flops_cost
from zoo.transformer.objective import sequence_cross_entropy

__all__ = ["WORKLOADS", "Batch", "LossFn", "Workload", "balance"]

Batch = Any  # a LongTensor [B, T + 1] of tokens, or an (images, labels) tuple
LossFn = Callable[[Any, Any], torch.Tensor]  # (last stage's output, target) -> scalar


@dataclass(frozen=True)
class Workload:
    """A zoo model at a benchmark size: how to build it, its mini-batch, and how its stages are fed and scored.

    ``split`` turns a mini-batch into ``(input, target)``: the first stage reads the input, the loss compares the last
    stage's output with the target.
    """

    name: str
    title: str
    model: str  # registry name
    options: dict[str, Any] = field(hash=False)
    batch_size: int
    sample_shape: tuple[int, ...]

    def build(self) -> zoo.ZooModule:
        """The model, seeded: every process of every configuration builds the same weights."""
        torch.manual_seed(0)
        model = zoo.create_model(self.model, **self.options)
        assert isinstance(model, zoo.ZooModule)
        return model

    def batch(self) -> Batch:
        """The same mini-batch for every step and configuration: only speed is measured."""
        generator = torch.Generator().manual_seed(1)
        if self.model == "transformer_lm":
            vocab = self.options["vocab_size"]
            # Ids from 3 up: no padding (id 0), so every token counts and equal micro-batches weigh the same.
            return torch.randint(3, vocab, (self.batch_size, *self.sample_shape), generator=generator)  # [B, T + 1]
        images = torch.randn((self.batch_size, *self.sample_shape), generator=generator)  # [B, 3, H, W]
        return images, torch.randint(0, self.options["num_classes"], (self.batch_size,), generator=generator)

    def split(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input of the first stage, target of the loss)`` of a mini-batch or micro-batch."""
        if self.model == "transformer_lm":
            return batch[:, :-1], batch[:, 1:]
        return batch[0], batch[1]

    def loss_fn(self, model: zoo.ZooModule) -> LossFn:
        """``loss(output, target)``, the model's own training loss (mean over the samples or tokens given)."""
        if self.model == "transformer_lm":
            smoothing = model.hparams["label_smoothing"]
            return lambda logits, tokens: sequence_cross_entropy(logits, tokens, pad_id=0, label_smoothing=smoothing)
        assert isinstance(model, zoo.ImageClassifier)
        return lambda outputs, labels: model.loss(outputs, labels)[0]


WORKLOADS: dict[str, Workload] = {
    # ~0.3-0.5 s per unpipelined step on one quiet thread; 9 entries: embedding, 7 layers, softmax. The vocabulary
    # makes the softmax cost about one layer, so the FLOP-balanced cut [embedding + 4 layers | 3 layers + softmax]
    # splits the work evenly (within 1%): the bubble bound E is read against assumes equal stages.
    "transformer": Workload(
        "transformer",
        "TransformerLM(L=7, D=256, H=1024, A=4, V=3000), batch 16 x 32 tokens",
        "transformer_lm",
        {"num_layers": 7, "d_model": 256, "ff_dim": 1024, "num_heads": 4, "vocab_size": 3000},
        16,
        (33,),
    ),
    # ~0.5-0.8 s per unpipelined step; 13 entries: stem, 2 stem cells, 6 normal + 2 reduction cells, aux head, head.
    # Batch 64, so that M = 32 leaves 2 images per micro-batch: the aux head's BatchNorm sees a 1 x 1 map, and
    # training-mode BatchNorm needs more than one value per channel.
    "amoebanet": Workload(
        "amoebanet",
        "AmoebaNet-D(6, 24) with its aux head, 40 x 40 images, 10 classes, batch 64",
        "amoebanet_d",
        {"num_layers": 6, "num_filters": 24, "num_classes": 10, "image_size": 40},
        64,
        (3, 40, 40),
    ),
    # The same architecture as "transformer" made tiny: a pass is tens of microseconds of arithmetic, so a step's
    # time is each engine's per-micro-batch overhead (Python, messages, waits).
    "tiny": Workload(
        "tiny",
        "TransformerLM(L=2, D=16, H=32, A=2, V=32), batch 64 x 8 tokens",
        "transformer_lm",
        {"num_layers": 2, "d_model": 16, "ff_dim": 32, "num_heads": 2, "head_dim": 8, "vocab_size": 32},
        64,
        (9,),
    ),
}


@cache
def balance(workload_name: str, stages: int = 2) -> tuple[int, ...]:
    """Layers per stage that balance the layers' forward FLOPs (the same split for every configuration).

    Counted on two samples: a training-mode BatchNorm on a 1 x 1 map needs more than one.
    """
    workload = WORKLOADS[workload_name]
    layers: nn.Sequential = workload.build().layers
    sample, _ = workload.split(workload.batch())
    return tuple(balance_by_cost(flops_cost(layers, sample[:2]), stages))
