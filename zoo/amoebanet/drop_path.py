"""The drop-path schedule of tensorflow/tpu's AmoebaNet: the drop probability grows linearly over training.

tensorflow/tpu (``network_utils.BaseCell._apply_drop_path``) knows three versions:

* ``v1``: ``keep_t = 1 - min(1, step / burn_in) * (1 - keep_prob)`` with ``burn_in`` the total number of training
  steps, the same for every cell;
* ``v2``: ``keep = 1 - depth_ratio * (1 - keep_prob)``, fixed over training, with
  ``depth_ratio = (cell_num + 1) / (L + 4)``: cells are numbered 0, 1 for the stem cells and on through every
  reduction and normal cell in network order, so the last cell has ratio 1;
* ``v3``: both factors.

tensorflow/tpu always runs ``v1``: ``_apply_drop_path`` is called without a version and defaults to ``v1`` (the
``drop_connect_version`` hparam never reaches it). ``v1`` is therefore the default here; ``scale_by_depth=True`` gives
``v3``. The mask itself is per example (``[B, 1, 1, 1]``) and rescales the kept examples by ``1 / keep``, which is
what ``timm.layers.DropPath`` does.
"""

from __future__ import annotations

import math

from torch import nn

from zoo.amoebanet.cell import Cell

__all__ = ["set_drop_path_progress"]


def set_drop_path_progress(module: nn.Module, progress: float, *, scale_by_depth: bool = False) -> None:
    """Set the drop-path probability of every AmoebaNet cell in ``module`` for a point of training.

    Each cell drops with probability ``min(1, progress) * drop_path`` (tensorflow/tpu's ``v1`` schedule), times its
    ``depth_ratio`` when ``scale_by_depth`` (``v3``). Call it before each training step with
    ``progress = step / total_steps``; works on any part of the sequence (a pipeline stage holds only some cells).

    Args:
        module: the AmoebaNet layers, or any module holding some of its cells.
        progress: fraction of training done, from 0 (nothing dropped) on; values past 1 count as 1.
        scale_by_depth: also scale each cell's probability by its depth in the network.
    """
    if not math.isfinite(progress) or progress < 0:
        raise ValueError(f"progress={progress}: pass the fraction of training done, step / total_steps (0 or more)")
    fraction = min(1.0, progress)
    for cell in module.modules():
        if isinstance(cell, Cell):
            ratio = cell.depth_ratio if scale_by_depth else 1.0
            cell.set_drop_prob(fraction * ratio * cell.drop_path)
