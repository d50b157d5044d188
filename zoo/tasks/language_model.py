"""The GPipe paper's decoder-only Transformer-L language model as a LightningModule (registered as "transformer_lm")."""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity

from zoo._registry import register_model
from zoo.tasks.base import ZooModule
from zoo.transformer.network import transformer_lm_layers
from zoo.transformer.objective import sequence_cross_entropy, token_count
from zoo.transformer.optimization import OPTIMIZERS, transformer_optimization

__all__ = ["TransformerLM"]


@register_model("transformer_lm")
class TransformerLM(ZooModule):
    """Transformer-L of the GPipe paper's Table 1: ``num_layers`` causal self-attention + feed-forward layers.

    lingvo's ``GPipeTransformerLm``: untied input embedding, softmax with bias, sinusoidal positions, attention
    biases and ``per_dim_scale``, no final LayerNorm (``final_norm=True`` adds one). With the defaults (D 2048, H 8192,
    32 heads, V 32000) it has exactly 50,358,336·L + 131,104,000 parameters: 282.2M / 785.8M / 5.3B / 21.0B / 83.9B
    for L = 3 / 13 / 103 / 415 / 1663, as in the paper.

    A batch is a LongTensor [B, T + 1] of token ids (``pad_id`` right-padding is ignored by the loss): the model reads
    ``tokens[:, :-1]`` and predicts ``tokens[:, 1:]``; the loss is a mean over the non-padding predicted tokens, whose
    count :meth:`batch_loss_weight` declares for ``GPipeStrategy``. Validation logs ``val_loss`` (label-smoothed, as
    trained), ``val_acc`` (next-token accuracy) and ``val_ppl`` (exp of the token-mean NLL, without smoothing).
    Stabilisers and optimizer as in :class:`zoo.tasks.translation.Transformer`, and so is fine-tuning: the softmax is
    the head, and ``freeze_backbone=True`` trains it alone. :func:`zoo.evaluation.evaluate_perplexity` measures a
    split's perplexity.
    """

    def __init__(
        self,
        num_layers: int = 3,
        d_model: int = 2048,
        ff_dim: int = 8192,
        num_heads: int = 32,
        vocab_size: int = 32000,
        head_dim: int | None = None,
        dropout: float = 0.1,
        label_smoothing: float = 0.1,
        ff_init_scaling: bool = True,
        logits_abs_max: float | None = None,
        final_norm: bool = False,
        pad_id: int = 0,
        optimizer: str = "adam",
        lr: float = 5e-4,
        warmup_steps: int = 4000,
        freeze_backbone: bool = False,
    ) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r} is not supported; use one of {', '.join(map(repr, OPTIMIZERS))}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1), e.g. 0.1 (0 turns smoothing off)")
        self.save_hyperparameters()
        self.layers = transformer_lm_layers(
            num_layers,
            d_model=d_model,
            ff_dim=ff_dim,
            num_heads=num_heads,
            vocab_size=vocab_size,
            head_dim=head_dim,
            dropout=dropout,
            ff_init_scaling=ff_init_scaling,
            logits_abs_max=logits_abs_max,
            final_norm=final_norm,
        )
        self.val_accuracy = MulticlassAccuracy(num_classes=vocab_size, average="micro", ignore_index=pad_id)
        if freeze_backbone:
            self.freeze_backbone_parameters()
        self.val_perplexity = Perplexity(ignore_index=pad_id)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits [B, T, V] for ``tokens`` [B, T]."""
        return self.layers(tokens)

    def head_prefixes(self) -> tuple[str, ...]:
        return (f"layers.{len(self.layers) - 1}",)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return sequence_cross_entropy(
            logits, targets, pad_id=self.hparams["pad_id"], label_smoothing=self.hparams["label_smoothing"]
        )

    def batch_loss_weight(self, batch: torch.Tensor) -> torch.Tensor:
        """The number of tokens the loss of ``batch`` averages over: the non-padding ones of ``batch[:, 1:]``.

        ``GPipeStrategy`` weighs each micro-batch's token mean by it (under every schedule), so a pipelined step is
        the whole batch's token mean; plain Lightning never calls it.
        """
        return token_count(batch[:, 1:], pad_id=self.hparams["pad_id"])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.layers(batch[:, :-1])
        # Under GPipeStrategy only the last stage runs past this line.
        loss = self._loss(logits, batch[:, 1:])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        logits = self.layers(batch[:, :-1])
        targets = batch[:, 1:]
        self.val_accuracy(logits.argmax(dim=-1), targets)
        self.val_perplexity(logits.float(), targets)
        self.log("val_loss", self._loss(logits, targets), prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_accuracy, on_epoch=True)
        self.log("val_ppl", self.val_perplexity, on_epoch=True, prog_bar=True)

    def configure_optimizers(self) -> Any:
        return transformer_optimization(
            [p for p in self.parameters() if p.requires_grad],
            self.hparams["optimizer"],
            self.hparams["lr"],
            self.hparams["warmup_steps"],
        )
