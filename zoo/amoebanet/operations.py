"""The operations of AmoebaNet cells, built as tensorflow/tpu builds them (``network_utils._apply_operation``).

Every convolution has ``bias=False`` (a BatchNorm follows it), and every convolution and pooling uses TensorFlow's
``SAME`` padding: the output has ``ceil(size / stride)`` cells, and when the padding is odd the extra cell goes at the
bottom/right. Max pooling never selects a padded cell, average pooling does not count padded cells. Where ``SAME``
is symmetric (stride 1, odd kernel) the padding is left to the convolution or pooling itself, which costs no copy.

Shapes: ``B`` batch, ``C`` channels, ``H, W`` height and width.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "FactorizedReduction",
    "Pool2dSame",
    "SamePad2d",
    "batch_norm",
    "build_operation",
    "conv2d_same",
    "relu_conv_bn",
    "same_padding",
]

_SEPARABLE = re.compile(r"^(?:dil_\d+_)?separable_(\d+)x\1(?:_(\d+))?$")
_POOL = re.compile(r"^(max|avg)_pool_(\d+)x\2$")
_BOTTLENECKS = ("3x3", "1x7_7x1")
_KNOWN = "'none', '1x1', '3x3', '1x7_7x1', 'separable_KxK_N', 'max_pool_KxK', 'avg_pool_KxK'"


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow ``SAME`` padding of one spatial dimension: ``(before, after)``, the odd cell after."""
    total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def _pads(x: Tensor, kernel: tuple[int, int], stride: tuple[int, int]) -> tuple[int, int, int, int]:
    top, bottom = same_padding(x.shape[-2], kernel[0], stride[0])
    left, right = same_padding(x.shape[-1], kernel[1], stride[1])
    return left, right, top, bottom  # F.pad's order: last dimension first


def _symmetric(kernel: tuple[int, int], stride: tuple[int, int]) -> bool:
    return stride == (1, 1) and kernel[0] % 2 == 1 and kernel[1] % 2 == 1


class SamePad2d(nn.Module):
    """Pad ``[B, C, H, W]`` as TensorFlow's ``SAME`` does for a given kernel and stride (filling with ``value``)."""

    def __init__(self, kernel: tuple[int, int], stride: tuple[int, int], value: float = 0.0) -> None:
        super().__init__()
        self.kernel = kernel
        self.stride = stride
        self.value = value

    def forward(self, x: Tensor) -> Tensor:
        return F.pad(x, _pads(x, self.kernel, self.stride), value=self.value)

    def extra_repr(self) -> str:
        return f"kernel={self.kernel}, stride={self.stride}, value={self.value}"


class Pool2dSame(nn.Module):
    """Max or average pooling with TensorFlow's ``SAME`` padding: ``[B, C, H, W] -> [B, C, ceil(H/s), ceil(W/s)]``."""

    def __init__(self, kind: str, kernel: int, stride: int) -> None:
        super().__init__()
        if kind not in ("max", "avg"):
            raise ValueError(f"pooling kind {kind!r} is not supported; use 'max' or 'avg'")
        self.kind = kind
        self.kernel = kernel
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        k, s = self.kernel, self.stride
        if _symmetric((k, k), (s, s)):
            if self.kind == "max":  # torch pads max pooling with -inf: padding is never selected
                return F.max_pool2d(x, k, s, padding=k // 2)
            return F.avg_pool2d(x, k, s, padding=k // 2, count_include_pad=False)
        pads = _pads(x, (k, k), (s, s))
        if self.kind == "max":
            return F.max_pool2d(F.pad(x, pads, value=-math.inf), k, s)
        # Averages over real cells only: the window sums of the zero-padded input divided by the window counts.
        ones = x.new_ones((1, 1, *x.shape[-2:]))
        return F.avg_pool2d(F.pad(x, pads), k, s) / F.avg_pool2d(F.pad(ones, pads), k, s)

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, kernel={self.kernel}, stride={self.stride}"


def batch_norm(channels: int) -> nn.BatchNorm2d:
    """BatchNorm with tensorflow/tpu's AmoebaNet flags: epsilon 1e-5, decay 0.9 (torch momentum 0.1), scale on."""
    return nn.BatchNorm2d(channels, eps=1e-5, momentum=0.1)


def conv2d_same(
    in_channels: int,
    out_channels: int,
    kernel: int | tuple[int, int],
    stride: int | tuple[int, int] = 1,
    groups: int = 1,
) -> nn.Module:
    """A bias-free convolution with TensorFlow's ``SAME`` padding."""
    kernel = (kernel, kernel) if isinstance(kernel, int) else kernel
    stride = (stride, stride) if isinstance(stride, int) else stride
    if _symmetric(kernel, stride):
        padding = (kernel[0] // 2, kernel[1] // 2)
        return nn.Conv2d(in_channels, out_channels, kernel, stride, padding, groups=groups, bias=False)
    conv = nn.Conv2d(in_channels, out_channels, kernel, stride, groups=groups, bias=False)
    return nn.Sequential(SamePad2d(kernel, stride), conv)


def relu_conv_bn(in_channels: int, out_channels: int, stride: int = 1) -> nn.Sequential:
    """ReLU, 1x1 convolution (strided if asked), BatchNorm: the cell base and the ``1x1`` operation."""
    return nn.Sequential(nn.ReLU(), conv2d_same(in_channels, out_channels, 1, stride), batch_norm(out_channels))


class FactorizedReduction(nn.Module):
    """Halve the spatial size without dropping cells: ``[B, C, H, W] -> [B, out, ceil(H/2), ceil(W/2)]``.

    Half of the output channels see the even cells, half the odd cells (shifted by one, zero past the border),
    each through its own 1x1 convolution; BatchNorm follows the concatenation.
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        if out_channels % 2:
            raise ValueError(f"a factorized reduction needs an even number of output channels, got {out_channels}")
        # A 1x1 convolution with stride 2 is TF's 1x1 stride-2 average pool (a subsampling) followed by a 1x1 conv.
        self.conv1 = nn.Conv2d(in_channels, out_channels // 2, 1, stride=2, bias=False)
        self.conv2 = nn.Conv2d(in_channels, out_channels // 2, 1, stride=2, bias=False)
        self.bn = batch_norm(out_channels)

    def forward(self, x: Tensor) -> Tensor:
        shifted = F.pad(x[:, :, 1:, 1:], (0, 1, 0, 1))  # [B, C, H, W], cell (i, j) holds x[i + 1, j + 1]
        return self.bn(torch.cat([self.conv1(x), self.conv2(shifted)], dim=1))


def _bottleneck_core(name: str, in_channels: int, out_channels: int, stride: int) -> list[nn.Module]:
    if name == "3x3":
        return [conv2d_same(in_channels, out_channels, 3, stride), batch_norm(out_channels)]
    return [  # 1x7_7x1: the 1x7 carries the stride along the width, the 7x1 along the height
        conv2d_same(in_channels, out_channels, (1, 7), (1, stride)),
        batch_norm(out_channels),
        nn.ReLU(inplace=True),
        conv2d_same(out_channels, out_channels, (7, 1), (stride, 1)),
        batch_norm(out_channels),
    ]


def _bottleneck(name: str, in_channels: int, filters: int, stride: int) -> nn.Sequential:
    reduced = filters // 4
    if reduced < 1:  # TF drops the bottleneck when a quarter of the filters would leave no channel
        return nn.Sequential(nn.ReLU(), *_bottleneck_core(name, in_channels, filters, stride))
    return nn.Sequential(
        nn.ReLU(),
        conv2d_same(in_channels, reduced, 1),
        batch_norm(reduced),
        nn.ReLU(inplace=True),
        *_bottleneck_core(name, reduced, reduced, stride),
        nn.ReLU(inplace=True),
        conv2d_same(reduced, filters, 1),
        batch_norm(filters),
    )


def _separable(kernel: int, layers: int, in_channels: int, filters: int, stride: int) -> nn.Sequential:
    # TF's slim.separable_conv2d: depthwise (multiplier 1, carrying the stride), then pointwise; only the first strides.
    modules: list[nn.Module] = []
    channels = in_channels
    for layer in range(layers):
        modules += [
            nn.ReLU(inplace=layer > 0),  # the first ReLU reads a hidden state that other operations share
            conv2d_same(channels, channels, kernel, stride, groups=channels),
            conv2d_same(channels, filters, 1),
            batch_norm(filters),
        ]
        channels, stride = filters, 1
    return nn.Sequential(*modules)


def build_operation(name: str, in_channels: int, filters: int, stride: int) -> nn.Module:
    """The module of operation ``name`` (tensorflow/tpu's spelling) reading ``in_channels`` and giving ``filters``.

    ``none`` is the identity unless the stride or the channel count must change, then it becomes ``1x1``.
    ``dil_2_separable_5x5_2`` is built as tensorflow/tpu builds it: no dilation rate reaches the convolution, so it is
    an ordinary 5x5 separable convolution stacked twice.
    """
    if name in ("none", "1x1"):
        if name == "none" and stride == 1 and in_channels == filters:
            return nn.Identity()
        return relu_conv_bn(in_channels, filters, stride)
    if name in _BOTTLENECKS:
        return _bottleneck(name, in_channels, filters, stride)
    separable = _SEPARABLE.match(name)
    if separable is not None:
        layers = int(separable.group(2)) if separable.group(2) else 1
        return _separable(int(separable.group(1)), layers, in_channels, filters, stride)
    pool = _POOL.match(name)
    if pool is not None:
        pooling = Pool2dSame(pool.group(1), int(pool.group(2)), stride)
        if in_channels == filters:
            return pooling
        # TF projects a pooled input to the cell's width with a 1x1 convolution and BatchNorm, without a ReLU.
        return nn.Sequential(pooling, conv2d_same(in_channels, filters, 1), batch_norm(filters))
    raise ValueError(f"unknown AmoebaNet operation {name!r}; known operations: {_KNOWN}")
