"""The AmoebaNet network as one flat sequence of pipeline-able layers, following tensorflow/tpu's ``model_builder.py``.

Layout of ``amoebanet_layers(genotype, num_layers=L, num_filters=D, ...)``, one entry per layer:

===========================  ==============================================================================
entry                        what it is
===========================  ==============================================================================
``Stem``                     3x3 stride-2 VALID conv (3 -> ``stem_filters``, 32 in TF) -> BN
2 stem cells                 reduction cells with D/4 and D/2 filters; the first has no previous input
stack 1                      L/3 normal cells with D filters (output 4D channels)
reduction cell               2D filters
stack 2                      L/3 normal cells with 2D filters
``AuxHead`` (if on)          after the last cell of stack 2, as in TF (``reduction_indices[1] - 1``)
reduction cell               4D filters
stack 3                      L/3 normal cells with 4D filters (output 16D channels)
``Classifier``               ReLU -> global average pool -> dropout -> ``fc`` (16D -> classes)
===========================  ==============================================================================

Boundary protocol: each entry takes one value and returns one value, a tensor or a tuple of tensors.

* ``Stem``: image ``[B, 3, H, W]`` -> tensor ``cur``.
* first stem cell: ``cur`` -> ``(cur, out)``; every later cell: ``(prev, cur)`` -> ``(cur, out)``.
* ``AuxHead``: ``(prev, cur)`` -> ``(prev, cur, aux_logits)`` in training mode, ``(prev, cur)`` unchanged in eval mode.
* cells after the aux head carry ``aux_logits`` untouched: ``(prev, cur, aux_logits)`` -> ``(cur, out, aux_logits)``.
* ``Classifier``: ``(prev, cur)`` -> ``logits``; ``(prev, cur, aux_logits)`` -> ``(logits, aux_logits)``.

So the network returns ``logits`` in eval mode or without an aux head, and ``(logits, aux_logits)`` in training mode
with one. The heads to replace for fine-tuning are the ``fc`` attributes of the entries at :func:`head_indices`.

Parameter counts (aux head on, 1000 classes, 224 px, as TF counts trainable variables in training; the GPipe paper's
Table 1 figure beside it):

=======================  ===============  ======  ========
model                    parameters       paper   error
=======================  ===============  ======  ========
AmoebaNet-D(18, 208)        81,781,529    82M     -0.27 %
AmoebaNet-D(18, 416)       318,270,652    318M    +0.09 %
AmoebaNet-D(18, 544)       540,977,420    542M    -0.19 %
AmoebaNet-D(36, 544)     1,054,074,956    1.05B   +0.39 %
AmoebaNet-D(72, 512)     1,843,378,372    1.8B    +2.41 %
AmoebaNet-B(18, 512)       557,277,864    557M    +0.05 %  (480 px, no aux head)
=======================  ===============  ======  ========

Without the aux head AmoebaNet-D(18, 208) has 81,137,437 parameters.

Batch normalization uses tensorflow/tpu's ``amoeba_net.py`` flags, epsilon 1e-5 and decay 0.9 (torch momentum 0.1),
which override the model's own defaults (1e-3, 0.9997). Weights keep torch's default initialization, so a model built
on the ``meta`` device and materialized with ``reset_parameters()`` starts like one built directly.

Shapes: ``B`` batch, ``C`` channels, ``H, W`` height and width, ``K`` classes.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from zoo.amoebanet.cell import Boundary, Cell
from zoo.amoebanet.genotype import CellGenotype, Genotype
from zoo.amoebanet.operations import batch_norm

__all__ = ["AuxHead", "Classifier", "Stem", "amoebanet_layers", "head_indices", "reduction_indices"]

AUX_SCALING = 0.4  # tensorflow/tpu's aux_scaling: 128 and 768 channels become 51 and 307
STEMS = ("imagenet", "cifar")


def reduction_indices(num_layers: int) -> tuple[int, int]:
    """The normal cells before which a reduction cell is inserted (TF's ``calc_reduction_layers(L, 2)``)."""
    return int(num_layers / 3), int(2 * num_layers / 3)


class Stem(nn.Module):
    """3x3 convolution and BatchNorm, no ReLU.

    ImageNet stem (``stride=2``, VALID): ``[B, 3, H, W] -> [B, C, (H-3)//2+1, (W-3)//2+1]``; CIFAR stem
    (``stride=1``, SAME): ``[B, 3, H, W] -> [B, C, H, W]``.
    """

    def __init__(self, out_channels: int = 32, in_channels: int = 3, stride: int = 2) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=0 if stride == 2 else 1, bias=False)
        self.bn = batch_norm(out_channels)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(self.conv(x))


class AuxHead(nn.Module):
    """The auxiliary classifier: adds ``aux_logits`` ``[B, K]`` to the boundary in training mode only.

    ReLU -> 5x5 stride-3 VALID average pool -> 1x1 conv to 51 -> BN -> ReLU -> conv over the whole remaining map to 307
    -> BN -> ReLU -> ``fc``. On maps smaller than 5 (small images) the pool shrinks to ``min(5, size)`` with stride
    ``min(3, size)``; at 224 px (map 14) and 480 px (map 30) that is TF's pool, leaving 4x4 and 9x9.

    Args:
        in_channels: channels of the cell output it reads.
        size: spatial size of that output (it fixes the last convolution's kernel).
        num_classes: classes of ``fc``.
    """

    def __init__(self, in_channels: int, size: int, num_classes: int) -> None:
        super().__init__()
        kernel, stride = min(5, size), min(3, size)
        remaining = (size - kernel) // stride + 1
        hidden, features = int(128 * AUX_SCALING), int(768 * AUX_SCALING)
        self.pool = nn.AvgPool2d(kernel, stride)
        self.proj = nn.Conv2d(in_channels, hidden, 1, bias=False)
        self.bn0 = batch_norm(hidden)
        self.conv = nn.Conv2d(hidden, features, remaining, bias=False)
        self.bn1 = batch_norm(features)
        self.fc = nn.Linear(features, num_classes)

    def forward(self, x: Boundary) -> Boundary:
        if not self.training:
            return x
        prev, cur = x
        h = self.pool(F.relu(cur))
        h = F.relu(self.bn0(self.proj(h)))
        h = F.relu(self.bn1(self.conv(h)))  # [B, 307, 1, 1]
        return prev, cur, self.fc(h.flatten(1))


class Classifier(nn.Module):
    """The final layer: ReLU -> global average pool -> dropout -> ``fc``; passes carried ``aux_logits`` on.

    Args:
        in_channels: channels of the last cell's output (16D).
        num_classes: classes of ``fc``.
        dropout: dropout probability before ``fc`` (TF: ``dense_dropout_keep_prob=0.5``).
    """

    def __init__(self, in_channels: int, num_classes: int, dropout: float = 0.5) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, x: Boundary) -> Tensor | tuple[Tensor, Tensor]:
        _, cur, *aux = x
        logits = self.fc(self.dropout(F.relu(cur).mean(dim=(2, 3))))  # [B, K]
        if aux:
            return logits, aux[0]
        return logits


def _check(genotype: Genotype, num_layers: int, num_filters: int, num_classes: int, image_size: int) -> None:
    if not isinstance(genotype, Genotype):
        raise TypeError(f"genotype={genotype!r}: pass a Genotype such as AMOEBANET_D or AMOEBANET_B")
    if num_layers < 3 or num_layers % 3:
        raise ValueError(f"num_layers={num_layers}: L counts the normal cells of 3 stacks; use a multiple of 3 (18)")
    if num_filters < 4 or num_filters % 4:
        raise ValueError(
            f"num_filters={num_filters}: the stem cells use D/4 and D/2 filters and a factorized reduction needs an "
            "even count; use a multiple of 4 (e.g. 208)"
        )
    if num_classes < 1:
        raise ValueError(f"num_classes={num_classes}: give at least one class")
    if image_size < 3:
        raise ValueError(f"image_size={image_size}: the 3x3 VALID stem convolution needs images of 3 pixels or more")


def amoebanet_layers(
    genotype: Genotype,
    *,
    num_layers: int,
    num_filters: int,
    num_classes: int,
    image_size: int = 224,
    aux_head: bool = True,
    drop_path: float = 0.0,
    dropout: float = 0.5,
    stem_filters: int = 32,
    stem: str = "imagenet",
) -> nn.Sequential:
    """AmoebaNet as one flat ``nn.Sequential`` of stem, cells, aux head and classifier (see the module docstring).

    Builds on any device, ``meta`` included: spatial sizes are computed, never probed.

    Args:
        genotype: ``AMOEBANET_D`` or ``AMOEBANET_B`` (or another :class:`Genotype`).
        num_layers: L, the number of normal cells, a multiple of 3.
        num_filters: D, the filters of the first stack, a multiple of 4.
        num_classes: classes of both heads.
        image_size: input height and width; fixes the aux head's last kernel (other sizes still run without it).
        aux_head: add the auxiliary classifier (trained with weight 0.4 in TF, counted in the paper's sizes).
        drop_path: drop-path probability reached at the end of training (TF ``1 - drop_connect_keep_prob``); the
            schedule starts at 0 and is driven by :func:`set_drop_path_progress`.
        dropout: dropout probability before the classifier.
        stem_filters: output channels of the stem convolution (TF ``stem_reduction_size``).
        stem: ``"imagenet"`` (TF's default: a stride-2 convolution and two stem reduction cells, so the first stack
            sees 1/8 of the image side) or ``"cifar"`` (TF's ``_cifar_stem``: one stride-1 convolution and no stem
            cells, so the first stack works at the full resolution of small images such as CIFAR's 32 px).
    """
    _check(genotype, num_layers, num_filters, num_classes, image_size)
    if stem not in STEMS:
        raise ValueError(f"stem={stem!r}: use one of {', '.join(map(repr, STEMS))} ('cifar' for small images)")
    if not 0.0 <= drop_path < 1.0:
        raise ValueError(f"drop_path={drop_path}: give a drop probability in [0, 1) (TF keep_prob = 1 - drop_path)")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout={dropout}: give a dropout probability in [0, 1)")

    # The cells in network order as (genotype, filters, stride, aux head after it).
    reductions = reduction_indices(num_layers)
    plan: list[tuple[CellGenotype, int, int, bool]] = []
    if stem == "imagenet":
        plan += [(genotype.reduction, num_filters // 4, 2, False), (genotype.reduction, num_filters // 2, 2, False)]
    filters = num_filters
    for n in range(num_layers):
        if n in reductions:
            filters *= 2
            plan.append((genotype.reduction, filters, 2, False))
        plan.append((genotype.normal, filters, 1, aux_head and n == reductions[1] - 1))

    layers: list[nn.Module] = [Stem(stem_filters, stride=2 if stem == "imagenet" else 1)]
    size = (image_size - 3) // 2 + 1 if stem == "imagenet" else image_size
    channels, prev_channels, prev_size = stem_filters, None, size
    for cell_num, (cell_genotype, cell_filters, stride, aux_after) in enumerate(plan):
        cell = Cell(
            cell_genotype,
            in_channels=channels,
            prev_channels=prev_channels,
            size=size,
            prev_size=prev_size,
            filters=cell_filters,
            stride=stride,
            depth_ratio=(cell_num + 1) / len(plan),
            drop_path=drop_path,
        )
        layers.append(cell)
        prev_channels, prev_size = channels, size
        channels, size = cell.out_channels, math.ceil(size / stride)
        if aux_after:
            layers.append(AuxHead(channels, size, num_classes))
    layers.append(Classifier(channels, num_classes, dropout))
    return nn.Sequential(*layers)


def head_indices(layers: nn.Sequential) -> tuple[int, ...]:
    """Indices of the task heads in ``layers`` (the aux head, if any, and the classifier), each with an ``fc``."""
    indices = tuple(index for index, layer in enumerate(layers) if isinstance(layer, (AuxHead, Classifier)))
    if not indices:
        raise ValueError("no AuxHead or Classifier entry in these layers; pass the sequence built by amoebanet_layers")
    return indices
