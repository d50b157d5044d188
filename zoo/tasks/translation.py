"""The GPipe paper's multilingual translation model T(L, H, A) as a LightningModule (registered as "transformer")."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zoo._registry import register_model
from zoo.bleu import TokenBLEU
from zoo.tasks.seq2seq import Seq2SeqTask
from zoo.transformer.decoding import beam_search, greedy_decode
from zoo.transformer.network import decoder_slice, encoder_slice, transformer_layers

__all__ = ["Transformer"]


@register_model("transformer")
class Transformer(Seq2SeqTask):
    """Encoder-decoder T(L=``num_layers``, H=``ff_dim``, A=``num_heads``) of GPipe Section 5, lingvo's structure.

    A batch is ``(source, target)``, LongTensors [B, S] and [B, T] right-padded with ``pad_id``: ``source`` is
    ``<2xx> tokens... </s>`` (the target-language token first), ``target`` is ``<s> tokens... </s>``. The model
    reads ``(source, target[:, :-1])`` and is trained to predict ``target[:, 1:]``. Validation logs ``val_loss``
    (label-smoothed, as trained) and ``val_acc`` (next-token accuracy), token means per validation loader, which
    Lightning suffixes ``/dataloader_idx_i`` when there are several (one per directed pair, in the data module's
    ``directed_pairs`` order); training and these two come from :class:`~zoo.tasks.seq2seq.Seq2SeqTask`.

    Depth stabilisers of the paper, both on by choice: ``ff_init_scaling`` (feed-forward init scaled by
    ``num_layers ** -0.5``) and ``logits_abs_max`` (clip training logits; None turns it off, lingvo's default). The
    optimizer is Adam (0.9, 0.98) with an inverse-square-root warmup to the peak ``lr``, or Adafactor
    (``optimizer="adafactor"``, what lingvo used for the large runs); see :mod:`zoo.transformer.optimization`.

    Parameter counts and how they compare with the paper are in :mod:`zoo.transformer.network`. Decoding (greedy,
    beam search, :mod:`zoo.transformer.decoding`) runs on the whole model after training, and inside the steps under
    ``GPipeStrategy`` too: ``predict_step`` returns the decoded tokens [B, ``max_decode_len``] (beam search when
    ``beam_size`` > 1, greedy otherwise, padded), and ``val_bleu=True`` makes validation decode every batch the same
    way and log ``val_bleu``, the corpus BLEU on token ids of each validation loader (:class:`~zoo.bleu.TokenBLEU`).
    BLEU per pair on detokenized text: :mod:`zoo.evaluation`.

    Fine-tuning: ``zoo.load_pretrained(path)`` rebuilds the model with every weight loaded except the softmax (the
    head, :meth:`head_prefixes`), which starts afresh; ``freeze_backbone=True`` then trains the softmax only (every
    other parameter has ``requires_grad=False`` and stays out of the optimizer).
    """

    def __init__(
        self,
        num_layers: int = 6,
        ff_dim: int = 8192,
        num_heads: int = 16,
        d_model: int = 1024,
        vocab_size: int = 64000,
        head_dim: int = 64,
        dropout: float = 0.1,
        label_smoothing: float = 0.1,
        ff_init_scaling: bool = True,
        logits_abs_max: float | None = None,
        pad_id: int = 0,
        optimizer: str = "adam",
        lr: float = 5e-4,
        warmup_steps: int = 4000,
        freeze_backbone: bool = False,
        val_bleu: bool = False,
        beam_size: int = 1,
        max_decode_len: int = 64,
        length_penalty: float = 0.6,
    ) -> None:
        super().__init__(optimizer=optimizer, label_smoothing=label_smoothing)
        if beam_size < 1 or max_decode_len < 1:
            raise ValueError(
                f"beam_size={beam_size} and max_decode_len={max_decode_len} must be at least 1 (beam_size 1 decodes "
                "greedily; max_decode_len counts the generated tokens, </s> included)"
            )
        self.save_hyperparameters()
        self.pad_id = pad_id
        # One BLEU per validation loader (one per directed pair); `setup` adds one per pair of the data module.
        self.val_bleu = nn.ModuleList([TokenBLEU(pad_id=pad_id)]) if val_bleu else None
        self.layers = transformer_layers(
            num_layers,
            ff_dim,
            num_heads,
            d_model=d_model,
            vocab_size=vocab_size,
            head_dim=head_dim,
            dropout=dropout,
            ff_init_scaling=ff_init_scaling,
            logits_abs_max=logits_abs_max,
            pad_id=pad_id,
        )
        if freeze_backbone:
            self.freeze_backbone_parameters()

    def encode(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the encoder part once: ``source`` [B, S] -> (memory [B, S, D], source_mask [B, S] bool)."""
        memory, source_mask, _ = self.layers[encoder_slice(self.hparams["num_layers"])]((source, source[:, :0]))
        return memory, source_mask

    def decode(self, memory: torch.Tensor, source_mask: torch.Tensor, target_in: torch.Tensor) -> torch.Tensor:
        """Run the decoder part: logits [B, T, V] for ``target_in`` [B, T] attending to an :meth:`encode` result."""
        return self.layers[decoder_slice(self.hparams["num_layers"])]((memory, source_mask, target_in))

    def head_prefixes(self) -> tuple[str, ...]:
        return (f"layers.{len(self.layers) - 1}",)

    def setup(self, stage: str) -> None:
        pairs = getattr(getattr(self._trainer, "datamodule", None), "directed_pairs", None) or []
        while self.val_bleu is not None and len(self.val_bleu) < len(pairs):
            self.val_bleu.append(TokenBLEU(pad_id=self.hparams["pad_id"]))

    def translate(self, source: torch.Tensor) -> torch.Tensor:
        """Decoded tokens [B, ``max_decode_len``] for ``source`` [B, S], padded: beam search if ``beam_size`` > 1.

        Works on the whole model and inside a step under ``GPipeStrategy``, where it calls the pipelined sequence once
        per token.
        """
        max_len, beam = self.hparams["max_decode_len"], self.hparams["beam_size"]
        if beam > 1:
            tokens = beam_search(self, source, beam, max_len, self.hparams["length_penalty"]).tokens
        else:
            tokens = greedy_decode(self, source, max_len)
        return nn.functional.pad(tokens, (0, max_len - tokens.shape[1]), value=self.hparams["pad_id"])

    def validation_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        super().validation_step(batch, batch_idx, dataloader_idx)
        if self.val_bleu is not None:
            source, target = batch
            if dataloader_idx >= len(self.val_bleu):
                raise ValueError(
                    f"validation loader {dataloader_idx} has no BLEU metric: val_bleu=True keeps one per directed pair "
                    f"of the data module ({len(self.val_bleu)}); give a TranslationDataModule, or one validation loader"
                )
            bleu = self.val_bleu[dataloader_idx]
            assert isinstance(bleu, TokenBLEU)
            bleu.update(self.translate(source), target)
            self.log("val_bleu", bleu, on_epoch=True, batch_size=source.shape[0])

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        """The decoded tokens [B, ``max_decode_len``] of a batch ``(source, ...)`` or ``source`` (:meth:`translate`)."""
        source = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self.translate(source)
