"""The whole trained module after ``fit``, got back the way the user guide says: ``gather_module`` on every rank."""

from __future__ import annotations

import lightning as L

from lightning_gpipe import GPipeStrategy

__all__ = ["whole_module"]


def whole_module(module: L.LightningModule) -> L.LightningModule | None:
    """``module`` whole on global rank 0, ``None`` on the other ranks (a collective under GPipeStrategy, which keeps
    each stage on its rank after ``fit``); under another strategy the module itself on rank 0."""
    strategy = module.trainer.strategy
    if isinstance(strategy, GPipeStrategy):
        return strategy.gather_module()
    return module if module.trainer.is_global_zero else None
