"""What the zoo's encoder-decoder models share: teacher-forced training, validation loss and accuracy, the optimizer."""

from __future__ import annotations

from typing import Any

import torch

from zoo.tasks.base import ZooModule
from zoo.transformer.objective import sequence_cross_entropy, token_count
from zoo.transformer.optimization import OPTIMIZERS, transformer_optimization

__all__ = ["Seq2SeqTask"]


class Seq2SeqTask(ZooModule):
    """Base class of the zoo's encoder-decoder models (:class:`~zoo.Transformer`, :class:`~zoo.PretrainedTranslator`).

    A batch is ``(source, target)``, LongTensors [B, S] and [B, T] right-padded with :attr:`pad_id`. The model reads
    ``(source, target[:, :-1])`` and learns ``target[:, 1:]`` with label-smoothed cross-entropy over the non-padding
    tokens, a mean whose normalizer (the token count) :meth:`batch_loss_weight` declares, so that ``GPipeStrategy``
    trains on padded batches as on one device. Validation logs ``val_loss`` (label-smoothed, as trained) and
    ``val_acc`` (next-token accuracy), token means per validation loader. The optimizer is
    :func:`~zoo.transformer.optimization.transformer_optimization` over the parameters that require gradients.

    Subclasses build ``self.layers`` so that it maps ``(source, target_in)`` to logits [B, T, V], set :attr:`pad_id`,
    and save the hyper-parameters ``label_smoothing``, ``optimizer``, ``lr`` and ``warmup_steps``.
    """

    pad_id: int  # the padding token of sources and targets, left out of the loss and the accuracy

    def __init__(self, *, optimizer: str, label_smoothing: float) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r} is not supported; use one of {', '.join(map(repr, OPTIMIZERS))}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1), e.g. 0.1 (0 turns smoothing off)")

    def forward(self, source: torch.Tensor, target_in: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] for the next token at every position of ``target_in`` [B, T], given ``source`` [B, S]."""
        return self.layers((source, target_in))

    def _loss(self, logits: torch.Tensor, target_out: torch.Tensor) -> torch.Tensor:
        return sequence_cross_entropy(
            logits, target_out, pad_id=self.pad_id, label_smoothing=self.hparams["label_smoothing"]
        )

    def batch_loss_weight(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The number of target tokens the loss of ``batch`` averages over: the non-padding ones of ``target[:, 1:]``.

        ``GPipeStrategy`` weighs each micro-batch's token mean by it (under every schedule), so a pipelined step is
        the whole batch's token mean; plain Lightning never calls it.
        """
        return token_count(batch[1][:, 1:], pad_id=self.pad_id)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        source, target = batch
        logits = self.layers((source, target[:, :-1]))
        # Under GPipeStrategy only the last stage runs past this line.
        loss = self._loss(logits, target[:, 1:])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        source, target = batch
        logits = self.layers((source, target[:, :-1]))
        target_out = target[:, 1:]
        count = max(int(token_count(target_out, pad_id=self.pad_id)), 1)
        correct = ((logits.argmax(dim=-1) == target_out) & (target_out != self.pad_id)).sum()
        # Translation data modules give one validation loader per directed pair, and Lightning suffixes each key with
        # its loader's index; weighting batches by their tokens makes the epoch values per-pair token means.
        self.log("val_loss", self._loss(logits, target_out), prog_bar=True, sync_dist=True, batch_size=count)
        self.log("val_acc", correct / count, sync_dist=True, batch_size=count)

    def configure_optimizers(self) -> Any:
        return transformer_optimization(
            [p for p in self.parameters() if p.requires_grad],
            self.hparams["optimizer"],
            self.hparams["lr"],
            self.hparams["warmup_steps"],
        )
