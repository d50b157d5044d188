"""Anomaly detection: NaN or Inf in a loss, a boundary activation or a gradient, named by stage and micro-batch.

A non-finite value spreads: one NaN in a stage's output becomes NaN in every later stage, in the loss, and in every
gradient of the step, and the optimizer then writes it into the weights. Checking each value where it is produced
names its origin. The checks synchronize with the device once per checked tensor, so they are opt-in
(``GPipeStrategy(detect_anomalies=True)``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lightning_gpipe.engine.errors import PipelineError
from lightning_gpipe.engine.tree import flatten, leaf_paths

__all__ = ["check_finite"]


def _non_finite(tensor: torch.Tensor) -> str | None:
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return None
    if bool(torch.isfinite(tensor).all()):
        return None
    kinds = []
    if bool(torch.isnan(tensor).any()):
        kinds.append("NaN")
    if bool(torch.isinf(tensor).any()):
        kinds.append("Inf")
    return " and ".join(kinds)


def check_finite(stage: int, microbatch: int, what: str, value: Any) -> None:
    """Raise a :class:`PipelineError` naming ``stage``, ``microbatch`` and the leaf of ``value`` that holds NaN/Inf.

    ``what`` says which value it is ("the loss", "the output", "the gradient sent back").
    """
    leaves, spec = flatten(value)
    paths: Iterable[str] = leaf_paths(spec, "value")
    for path, leaf in zip(paths, leaves, strict=True):
        if not isinstance(leaf, torch.Tensor):
            continue
        found = _non_finite(leaf.detach())
        if found is not None:
            where = "" if path == "value" else f" (at {path})"
            raise PipelineError(
                stage,
                f"{what} of micro-batch {microbatch} holds {found}{where}, the first non-finite value: check this "
                "stage's layers and inputs",
            )
