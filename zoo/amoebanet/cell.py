"""The AmoebaNet cell: two input states, five combinations of two operations each, a concatenation of chosen states.

Follows tensorflow/tpu's ``network_utils.BaseCell``. The cell base turns the current input into state 0
(ReLU -> 1x1 conv -> BN to ``filters`` channels) and the previous-previous output into state 1 (``_reduce_prev_layer``):
the raw current input when there is no previous output (the first stem cell), a ReLU and a factorized reduction when
its spatial size differs, a ReLU -> 1x1 conv -> BN when only its channels differ, itself otherwise. A reduction cell
strides only the operations that read state 0 or 1. Drop path follows every operation except ``none``.

Shapes: ``B`` batch, ``C`` channels, ``H, W`` height and width of the current input; a reduction cell's output has
``ceil(H / 2), ceil(W / 2)``.
"""

from __future__ import annotations

import math

import torch
from timm.layers import DropPath
from torch import Tensor, nn

from zoo.amoebanet.genotype import NUM_COMBINATIONS, CellGenotype
from zoo.amoebanet.operations import FactorizedReduction, batch_norm, build_operation, conv2d_same, relu_conv_bn

__all__ = ["Boundary", "Cell"]

Boundary = Tensor | tuple[Tensor, ...]
"""What flows between the entries of the AmoebaNet sequence (see :mod:`zoo.amoebanet.network`)."""


class Cell(nn.Module):
    """One normal (``stride=1``) or reduction (``stride=2``) cell.

    Takes ``(prev, cur, *carried)`` and returns ``(cur, out, *carried)``, so the next cell finds its own previous
    input first; ``carried`` (the aux logits) passes through untouched. A cell built with ``prev_channels=None`` (the
    first stem cell) takes the plain tensor ``cur`` instead.

    Args:
        genotype: the cell's operations, their input states and the concatenated states.
        in_channels: channels of ``cur``.
        prev_channels: channels of ``prev``, or ``None`` when the cell has no previous input.
        size: spatial size (height, taken equal to the width for the decisions) of ``cur``.
        prev_size: spatial size of ``prev`` (ignored without one).
        filters: channels of every state; the output has ``filters * len(genotype.concat)``.
        stride: 2 for a reduction cell, 1 for a normal cell.
        depth_ratio: the cell's depth in the network as tensorflow/tpu counts it, ``(cell_num + 1) / total_cells``;
            used only by the depth-scaled drop-path schedule.
        drop_path: drop-path probability at the end of training (``1 - drop_connect_keep_prob``).
    """

    def __init__(
        self,
        genotype: CellGenotype,
        *,
        in_channels: int,
        prev_channels: int | None,
        size: int,
        prev_size: int,
        filters: int,
        stride: int,
        depth_ratio: float = 1.0,
        drop_path: float = 0.0,
    ) -> None:
        super().__init__()
        self.genotype = genotype
        self.filters = filters
        self.stride = stride
        self.depth_ratio = depth_ratio
        self.drop_path = drop_path
        self.has_prev = prev_channels is not None
        self.out_channels = filters * len(genotype.concat)

        self.base = relu_conv_bn(in_channels, filters)
        self.reduce_prev = self._reduce_prev(prev_channels, prev_size, size, filters)

        # (channels, spatial size) of every state: 0 and 1 at the input's size, the combinations' after the stride.
        state1_channels = filters if prev_channels is not None else in_channels
        out_size = math.ceil(size / stride)
        shapes = [(filters, size), (state1_channels, size)] + [(filters, out_size)] * NUM_COMBINATIONS

        self.ops = nn.ModuleList()
        self.drop_paths = nn.ModuleList()
        for name, state in zip(genotype.operations, genotype.inputs, strict=True):
            op_stride = stride if state < 2 else 1
            self.ops.append(build_operation(name, shapes[state][0], filters, op_stride))
            self.drop_paths.append(nn.Identity() if name == "none" else DropPath(0.0))

        # TF reshapes a concatenated state that does not match the last state (never the case for AmoebaNet-B/-D).
        self.concat_fix = nn.ModuleList()
        for state in genotype.concat:
            channels, state_size = shapes[state]
            if state_size != out_size:
                self.concat_fix.append(FactorizedReduction(channels, filters))
            elif channels != filters:
                self.concat_fix.append(nn.Sequential(conv2d_same(channels, filters, 1), batch_norm(filters)))
            else:
                self.concat_fix.append(nn.Identity())

    @staticmethod
    def _reduce_prev(prev_channels: int | None, prev_size: int, size: int, filters: int) -> nn.Module:
        if prev_channels is None:
            return nn.Identity()  # unused: state 1 is the raw current input
        if prev_size != size:
            return nn.Sequential(nn.ReLU(), FactorizedReduction(prev_channels, filters))
        if prev_channels != filters:
            return relu_conv_bn(prev_channels, filters)
        return nn.Identity()

    def set_drop_prob(self, probability: float) -> None:
        """Set the current drop-path probability of every operation of the cell."""
        for module in self.drop_paths:
            if isinstance(module, DropPath):
                module.drop_prob = probability

    def forward(self, x: Boundary) -> tuple[Tensor, ...]:
        if self.has_prev == isinstance(x, Tensor):
            expected = "a (prev, cur, ...) tuple" if self.has_prev else "a plain tensor"
            raise TypeError(f"this cell takes {expected}, got {type(x).__name__}; keep the layers in their built order")
        carried: tuple[Tensor, ...] = ()
        if isinstance(x, Tensor):
            cur = x
            states = [self.base(cur), cur]  # no previous input: state 1 is the raw current input
        else:
            prev, cur, *rest = x
            carried = tuple(rest)
            states = [self.base(cur), self.reduce_prev(prev)]

        for combination in range(NUM_COMBINATIONS):
            left, right = 2 * combination, 2 * combination + 1
            h_left = self.drop_paths[left](self.ops[left](states[self.genotype.inputs[left]]))
            h_right = self.drop_paths[right](self.ops[right](states[self.genotype.inputs[right]]))
            states.append(h_left + h_right)

        parts = [fix(states[state]) for fix, state in zip(self.concat_fix, self.genotype.concat, strict=True)]
        out = torch.cat(parts, dim=1)  # [B, filters * len(concat), H / stride, W / stride]
        return (cur, out, *carried)

    def extra_repr(self) -> str:
        return f"filters={self.filters}, stride={self.stride}, out_channels={self.out_channels}"
