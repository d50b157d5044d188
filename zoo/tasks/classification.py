"""Image classification with an auxiliary head: the AmoebaNet training recipe, and the AmoebaNet-D and -B models.

The recipe follows tensorflow/tpu's AmoebaNet (``amoeba_net_model.py``): cross-entropy on the main logits plus 0.4
times the auxiliary head's, label smoothing, TF-style RMSProp (timm's ``RMSpropTF``: decay 0.9, momentum 0.9,
epsilon 1.0) with weight decay on weights only, and a staircase exponential learning-rate decay after a linear
warm-up. Batches are ``(images, labels)`` tuples.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from timm.optim import create_optimizer_v2
from timm.scheduler import StepLRScheduler
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from zoo._registry import register_model
from zoo.amoebanet import AMOEBANET_B, AMOEBANET_D, Genotype, amoebanet_layers, head_indices, set_drop_path_progress
from zoo.backbone import load_backbone
from zoo.tasks.base import ZooModule

__all__ = ["AmoebaNetB", "AmoebaNetD", "ImageClassifier"]

Batch = tuple[torch.Tensor, torch.Tensor]


class ImageClassifier(ZooModule):
    """A classifier whose ``layers`` return ``logits``, or ``(logits, aux_logits)`` in training with an aux head.

    Args:
        layers: the whole network, one flat ``nn.Sequential``.
        num_classes: output classes of the heads.
        head_layers: indices in ``layers`` of the entries holding the task heads (each has an ``fc`` linear layer).
        aux_weight: weight of the auxiliary head's loss (TF: 0.4).
        label_smoothing: label smoothing of both losses (TF: 0.1).
        optimizer: a timm optimizer name; ``"rmsproptf"`` (TF's RMSProp: decay 0.9, momentum 0.9, epsilon 1.0) is
            the AmoebaNet recipe. Its epsilon of 1.0 inside the square root makes it behave like momentum SGD while
            gradients are small, so it wants a large ``lr``; ``"adamw"`` learns faster on short runs.
        lr: peak learning rate (after warm-up).
        weight_decay: L2 weight decay on conv and linear weights (not on biases and BatchNorm; TF: 4e-5).
        lr_decay_rate: factor of each staircase decay of the learning rate (TF hparams: 0.97).
        lr_decay_epochs: epochs between decays (TF hparams: 2.4).
        warmup_epochs: epochs of linear warm-up from 0 (TF: 3; fractions allowed).
        freeze_backbone: train the heads only; the backbone's parameters and BatchNorm statistics stay as they are.
    """

    def __init__(
        self,
        layers: nn.Sequential,
        num_classes: int,
        head_layers: tuple[int, ...],
        *,
        aux_weight: float = 0.4,
        label_smoothing: float = 0.1,
        optimizer: str = "rmsproptf",
        lr: float = 0.015,
        weight_decay: float = 4e-5,
        lr_decay_rate: float = 0.97,
        lr_decay_epochs: float = 2.4,
        warmup_epochs: float = 3.0,
        freeze_backbone: bool = False,
    ) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"num_classes={num_classes}: a classifier needs at least 2 classes")
        self.layers = layers
        self.num_classes = num_classes
        self.head_layers = head_layers
        self.aux_weight = aux_weight
        self.label_smoothing = label_smoothing
        self.optimizer_name = optimizer
        self.lr = lr
        self.weight_decay = weight_decay
        self.lr_decay_rate = lr_decay_rate
        self.lr_decay_epochs = lr_decay_epochs
        self.warmup_epochs = warmup_epochs
        self.freeze_backbone = freeze_backbone
        top_k = min(5, num_classes)
        self.train_top1 = MulticlassAccuracy(num_classes, average="micro")
        self.val_top1 = MulticlassAccuracy(num_classes, average="micro")
        self.val_top5 = MulticlassAccuracy(num_classes, top_k=top_k, average="micro")
        if freeze_backbone:
            self.freeze_backbone_parameters()
            self._freeze_batch_norm()

    def head_prefixes(self) -> tuple[str, ...]:
        return tuple(f"layers.{index}.fc" for index in self.head_layers)

    def _freeze_batch_norm(self) -> None:
        # A frozen backbone keeps its BatchNorm statistics too: its BatchNorm layers stay in eval mode (Lightning
        # keeps each module's mode through fit, and warns that some modules are in eval mode, which is intended).
        for name, module in self.layers.named_modules(prefix="layers"):
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and not self.is_head(name):
                module.eval()

    def train(self, mode: bool = True) -> ImageClassifier:
        super().train(mode)
        if mode and self.freeze_backbone:
            self._freeze_batch_norm()
        return self

    def loss(self, outputs: Any, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The training loss and the main logits of ``outputs`` (``logits`` or ``(logits, aux_logits)``)."""
        logits, aux_logits = outputs if isinstance(outputs, tuple) else (outputs, None)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.label_smoothing)
        if aux_logits is not None:
            loss = loss + self.aux_weight * F.cross_entropy(aux_logits, labels, label_smoothing=self.label_smoothing)
        return loss, logits

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """The main logits, ``[B, num_classes]``."""
        outputs = self.layers(images)
        return outputs[0] if isinstance(outputs, tuple) else outputs

    def on_train_batch_start(self, batch: Batch, batch_idx: int) -> None:
        total = self.trainer.estimated_stepping_batches
        progress = self.global_step / total if total and total != float("inf") else 0.0
        set_drop_path_progress(self.layers, min(1.0, progress))

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss, logits = self.loss(self.layers(images), labels)
        self.train_top1(logits, labels)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_top1, prog_bar=True, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        images, labels = batch
        logits = self.layers(images)
        self.val_top1(logits, labels)
        self.val_top5(logits, labels)
        self.log("val_loss", F.cross_entropy(logits, labels), prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_top1, prog_bar=True)
        self.log("val_acc_top5", self.val_top5)

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        images = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self.layers(images).argmax(dim=-1)

    def configure_optimizers(self) -> Any:
        # TF's RMSProp (ms starts at 1, epsilon inside the sqrt); timm leaves biases and BatchNorm out of weight decay.
        options: dict[str, Any] = (
            {"momentum": 0.9, "alpha": 0.9, "eps": 1.0} if self.optimizer_name == "rmsproptf" else {}
        )
        optimizer = create_optimizer_v2(
            self, opt=self.optimizer_name, lr=self.lr, weight_decay=self.weight_decay, **options
        )
        steps_per_epoch = self._steps_per_epoch()
        scheduler = StepLRScheduler(
            optimizer,
            decay_t=max(1, round(self.lr_decay_epochs * steps_per_epoch)),
            decay_rate=self.lr_decay_rate,
            warmup_t=round(self.warmup_epochs * steps_per_epoch),
            warmup_prefix=False,  # TF's warm-up does not delay the decay
            t_in_epochs=False,
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _steps_per_epoch(self) -> int:
        trainer = self.trainer
        _ = trainer.estimated_stepping_batches  # sets up the training dataloader, so its length is known
        batches = trainer.num_training_batches
        if batches == float("inf"):  # an iterable dataset of unknown length: count the schedule in steps
            return 1
        return max(1, math.ceil(batches / trainer.accumulate_grad_batches))

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        scheduler.step_update(num_updates=self.global_step)


class _AmoebaNet(ImageClassifier):
    genotype: Genotype

    def __init__(
        self,
        num_layers: int = 18,
        num_filters: int = 208,
        num_classes: int = 1000,
        image_size: int = 224,
        stem: str = "imagenet",
        aux_head: bool = True,
        drop_path: float = 0.0,
        dropout: float = 0.5,
        aux_weight: float = 0.4,
        label_smoothing: float = 0.1,
        optimizer: str = "rmsproptf",
        lr: float = 0.015,
        weight_decay: float = 4e-5,
        lr_decay_rate: float = 0.97,
        lr_decay_epochs: float = 2.4,
        warmup_epochs: float = 3.0,
        freeze_backbone: bool = False,
        pretrained: str | None = None,
    ) -> None:
        layers = amoebanet_layers(
            self.genotype,
            num_layers=num_layers,
            num_filters=num_filters,
            num_classes=num_classes,
            image_size=image_size,
            stem=stem,
            aux_head=aux_head,
            drop_path=drop_path,
            dropout=dropout,
        )
        super().__init__(
            layers,
            num_classes,
            head_indices(layers),
            aux_weight=aux_weight,
            label_smoothing=label_smoothing,
            optimizer=optimizer,
            lr=lr,
            weight_decay=weight_decay,
            lr_decay_rate=lr_decay_rate,
            lr_decay_epochs=lr_decay_epochs,
            warmup_epochs=warmup_epochs,
            freeze_backbone=freeze_backbone,
        )
        self.save_hyperparameters()
        # A sample input lets GPipeStrategy balance stages by FLOPs: parameters sit mostly in the last stack, compute
        # mostly in the early, high-resolution cells, so balancing by parameters would load the first stage.
        self.example_input_array = torch.zeros(2, 3, image_size, image_size)
        if pretrained is not None:
            load_backbone(self, pretrained)


@register_model("amoebanet_d")
class AmoebaNetD(_AmoebaNet):
    """AmoebaNet-D(L, D) of the GPipe paper, as defined by tensorflow/tpu: ``num_layers`` = L normal cells in three
    stacks, ``num_filters`` = D filters in the first stack (doubled at each of the two reduction cells).

    ``pretrained``: a checkpoint of the same architecture whose backbone weights are loaded; the heads (``fc`` of the
    classifier and of the aux head) start fresh for ``num_classes`` (see :func:`zoo.load_pretrained`).
    """

    genotype = AMOEBANET_D


@register_model("amoebanet_b")
class AmoebaNetB(_AmoebaNet):
    """AmoebaNet-B(L, D) of the GPipe paper (the ImageNet model, B(18, 512) at 480 px), as defined by tensorflow/tpu.

    Arguments as :class:`AmoebaNetD`.
    """

    genotype = AMOEBANET_B
