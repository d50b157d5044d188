"""The training objective of the zoo's Transformers: token cross-entropy with label smoothing, padding ignored.

Shape legend: B batch, T target length, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["sequence_cross_entropy", "token_count"]


def sequence_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, pad_id: int = 0, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Mean over the non-padding target tokens of the label-smoothed cross-entropy.

    ``logits`` [B, T, V], ``targets`` [B, T] long. With smoothing s the target distribution is ``(1 - s)·onehot + s/V``
    (TF's ``softmax_cross_entropy(label_smoothing=s)``); positions whose target is ``pad_id`` add nothing, to the
    loss or to the token count. The mean divides by :func:`token_count`, which differs between micro-batches of a
    padded batch: weighed by their share of the samples, their means would not make the batch's. So the zoo's models
    declare the count (``batch_loss_weight``) and ``GPipeStrategy`` weighs micro-batch ``i`` by ``n_i / sum(n)``,
    which gives exactly the whole batch's token mean under every schedule.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1), e.g. 0.1 (0 turns smoothing off)")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not match targets of shape {tuple(targets.shape)}: "
            "expected logits [B, T, V] for targets [B, T]"
        )
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        targets.reshape(-1),
        ignore_index=pad_id,
        label_smoothing=label_smoothing,
    )


def token_count(targets: torch.Tensor, *, pad_id: int = 0) -> torch.Tensor:
    """How many tokens :func:`sequence_cross_entropy` averages over: the targets that are not ``pad_id`` (0-d long)."""
    return (targets != pad_id).sum()
