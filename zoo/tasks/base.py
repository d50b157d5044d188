"""What every zoo model shares: one flat layer sequence, a registry name in its checkpoints, and named heads."""

from __future__ import annotations

from typing import Any, ClassVar

import lightning as L
from torch import nn

from zoo.deferred import DeferredWeights

__all__ = ["ZooModule"]


class ZooModule(DeferredWeights, L.LightningModule):
    """Base class of the zoo's LightningModules.

    Subclasses build their whole network as ``self.layers`` (one flat ``nn.Sequential``, so ``strategy="gpipe"`` can
    split it), call ``self.save_hyperparameters()`` in ``__init__`` and return the state-dict prefixes of their
    task heads from :meth:`head_prefixes`. Checkpoints then carry the registry name and the constructor arguments,
    which is all :func:`zoo.load_pretrained` needs to rebuild the model. Pretrained weights wait on the meta device
    until their first use, or until ``GPipeStrategy`` reads each stage's (:class:`~zoo.deferred.DeferredWeights`).
    """

    zoo_name: ClassVar[str] = ""  # set by zoo.register_model
    layers: nn.Sequential
    load_report: Any = None  # what zoo.load_pretrained loaded into this model (a zoo.backbone.LoadReport)

    def head_prefixes(self) -> tuple[str, ...]:
        """State-dict prefixes (e.g. ``"layers.21.fc"``) of the modules fine-tuning replaces with fresh ones."""
        raise NotImplementedError(f"{type(self).__name__} does not say which of its modules are task heads")

    def is_head(self, key: str) -> bool:
        """Whether the parameter or state-dict ``key`` belongs to a task head (one of :meth:`head_prefixes`)."""
        return any(key == prefix or key.startswith(prefix + ".") for prefix in self.head_prefixes())

    def freeze_backbone_parameters(self) -> None:
        """Train the heads only: ``requires_grad=False`` on every parameter outside them."""
        for name, parameter in self.named_parameters():
            parameter.requires_grad_(self.is_head(name))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["zoo_model"] = self.zoo_name
