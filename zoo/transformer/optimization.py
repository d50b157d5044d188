"""How the zoo's Transformers are optimized: Adam or Adafactor under an inverse-square-root warmup schedule.

Adam with betas (0.9, 0.98) and eps 1e-9 under linear warmup then ``1/sqrt(step)`` decay is the recipe of the
Transformer paper (Vaswani et al. 2017), which the GPipe paper's T(L, H, A) models follow. lingvo trained its largest
GPipe/M4 runs with Adafactor, whose factored second moments save memory on billion-parameter models; it is offered
as ``optimizer="adafactor"`` (``torch.optim.Adafactor``) under the same schedule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["OPTIMIZERS", "inverse_sqrt_warmup", "transformer_optimization"]

OPTIMIZERS = ("adam", "adafactor")


def inverse_sqrt_warmup(step: int, warmup_steps: int) -> float:
    """Learning-rate factor after ``step`` optimizer steps: ``s / w`` up to the peak 1 at ``s = w``, then
    ``sqrt(w / s)``.

    ``s = step + 1`` so that the first step already moves; ``warmup_steps`` 0 behaves as 1 (no warmup).
    """
    s, w = step + 1, max(warmup_steps, 1)
    return min(s / w, math.sqrt(w / s))


def transformer_optimization(
    parameters: Iterable[torch.nn.Parameter], optimizer: str, lr: float, warmup_steps: int
) -> dict[str, Any]:
    """``configure_optimizers``' answer: the optimizer and the per-step schedule, ``lr`` being the peak rate."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not supported; use one of {', '.join(map(repr, OPTIMIZERS))}")
    if not lr > 0:
        raise ValueError(f"lr={lr} must be a positive peak learning rate, e.g. 5e-4")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps} must be >= 0 optimizer steps, e.g. 4000")
    built: torch.optim.Optimizer
    if optimizer == "adam":
        built = torch.optim.Adam(parameters, lr=lr, betas=(0.9, 0.98), eps=1e-9)
    else:
        built = torch.optim.Adafactor(parameters, lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(built, lambda step: inverse_sqrt_warmup(step, warmup_steps))
    return {"optimizer": built, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
