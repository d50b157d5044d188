"""A pretrained Hugging Face decoder-only language model (Llama, Mistral, Qwen, Gemma, Phi-3, OLMo, GPT-2) as a zoo
LightningModule.

Like :class:`~zoo.tasks.pretrained_translation.PretrainedTranslator`, it is not in the registry of
``zoo.create_model``; its checkpoints carry ``zoo_model: "hf_causal_lm"``, which ``zoo.load_pretrained`` recognizes.
Importing this module imports ``transformers``, so ``import zoo`` leaves it out until it is used.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from zoo.hf.causal_lm import build_causal_lm, causal_layers
from zoo.hf.causal_lm_generation import MAX_NEW_TOKENS, generate
from zoo.hf.conversion import export_state_dict, key_map
from zoo.tasks.base import ZooModule

__all__ = ["IGNORE_INDEX", "PretrainedCausalLM"]

IGNORE_INDEX = -100  # the label of tokens left out of the loss, as Hugging Face's collators write it
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")  # what save_pretrained writes for every tokenizer


class PretrainedCausalLM(ZooModule):
    """A ``transformers`` decoder-only language model whose modules form one flat ``nn.Sequential``.

    ``name_or_path`` is a hub id (``"Qwen/Qwen2.5-0.5B"``) or a ``save_pretrained`` directory;
    ``zoo.load_pretrained(name_or_path)`` is the usual way in. The layers wrap the library's own modules
    (:mod:`zoo.hf.causal_lm_layers`), so the forward is the library's, and a tied output projection is the embedding's
    ``nn.Parameter`` itself (on two stages, the strategy keeps the copies equal). :meth:`export_pretrained` writes a
    directory that ``AutoModelForCausalLM.from_pretrained`` loads back.

    A batch is what Hugging Face's collators make (``DataCollatorForLanguageModeling(tokenizer, mlm=False)``, say): a
    mapping with ``input_ids`` [B, T], ``attention_mask`` [B, T] (optional: all ones) and ``labels`` [B, T]
    (optional: the ``input_ids``, padding left out), ``-100`` where a token is not learned. Position ``t`` learns
    ``labels[t + 1]``, as the library's own loss does; the loss is the mean over the batch's learned tokens, whose
    count :meth:`batch_loss_weight` declares, so a pipelined step with any number of micro-batches, under every
    schedule, trains as the whole batch does.
    Validation logs ``val_loss``, the same token mean. ``predict_step`` returns :meth:`generate`'s tokens for the
    batch's (left-padded) prompts, with the ``generation`` settings.

    Args:
        name_or_path: where the weights (with ``pretrained``) and the tokenizer, if any, come from.
        config: the library config as a dict; filled in from ``name_or_path`` and saved with the hyper-parameters,
            so a checkpoint rebuilds the architecture without reading ``name_or_path``.
        pretrained: load ``name_or_path``'s weights (True), or start from random ones (``zoo.load_pretrained``
            passes None when a zoo checkpoint provides the weights).
        lr, weight_decay, warmup_steps: AdamW at ``lr`` after a linear warmup of ``warmup_steps`` optimizer steps.
        freeze_backbone: train the final norm and the output projection only (with tied embeddings, the embedding
            is the output projection and trains too).
        lora: LoRA adapters, as ``peft.LoraConfig`` keyword arguments (e.g. ``{"r": 8, "lora_alpha": 16}``;
            ``target_modules`` defaults to every linear layer of the decoder layers): only the adapters train, and
            :meth:`export_pretrained` writes the merged weights.
        generation: keyword arguments of :func:`~zoo.hf.causal_lm_generation.generate` for ``predict_step`` (e.g.
            ``{"max_new_tokens": 64, "do_sample": True, "top_p": 0.9, "seed": 0}``).
        generation_config: the library's generation config as a dict; filled in from ``name_or_path`` (its
            ``generation_config.json``), saved with the hyper-parameters and exported. Its end-of-sequence tokens
            (Llama 3 Instruct lists several) and padding token are those :meth:`generate` uses.
        dtype: what the pretrained weights load as: ``"float32"`` (Lightning's ``precision`` then decides what trains:
            ``"bf16-true"`` casts the model, ``"bf16-mixed"`` keeps float32 weights), ``"bfloat16"``, or ``"auto"``
            (the checkpoint's, ``transformers``' own default). Each process reads the whole model into host memory
            before the strategy keeps its stage, so a large model loads in ``"bfloat16"`` to halve that.
    """

    zoo_name: ClassVar[str] = "hf_causal_lm"

    def __init__(
        self,
        name_or_path: str,
        config: dict[str, Any] | None = None,
        pretrained: bool | None = True,
        lr: float = 2e-5,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        freeze_backbone: bool = False,
        lora: dict[str, Any] | None = None,
        generation: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        dtype: str = "float32",
    ) -> None:
        super().__init__()
        if not lr > 0:
            raise ValueError(f"lr={lr} must be a positive learning rate, e.g. 2e-5")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0 optimizer steps, e.g. 100")
        if freeze_backbone and lora is not None:
            raise ValueError(
                "freeze_backbone=True and lora=... both choose what trains (the head, or the adapters); pass one"
            )
        library = build_causal_lm(str(name_or_path), config, pretrained=bool(pretrained), dtype=dtype)
        library_config: PretrainedConfig = library.config
        self.save_hyperparameters(ignore=["config", "generation_config"])
        self.hparams["config"] = library_config.to_dict()
        if generation_config is None:  # from_pretrained read the source's generation_config.json, if it has one
            generation_config = library.generation_config.to_dict()
        self.hparams["generation_config"] = generation_config
        self.layers = causal_layers(library)
        positions: Any = self.layers[0].positions  # GPT-2's learned positions bound a prompt and its new tokens
        self.max_positions: int | None = int(positions.num_embeddings) if positions is not None else None
        # Zoo state-dict key -> library state-dict key, for export; the library model itself is not kept.
        self.library_keys = {f"layers.{key}": value for key, value in key_map(self.layers, library).items()}
        eos = _first_set(generation_config.get("eos_token_id"), library_config.eos_token_id)
        self.eos_ids: list[int] = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        pad = _first_set(generation_config.get("pad_token_id"), library_config.pad_token_id)
        self.pad_id = int(pad if pad is not None else (self.eos_ids or [0])[0])
        self._tokenizer: PreTrainedTokenizerBase | None = None
        if freeze_backbone:
            self.freeze_backbone_parameters()
        if lora is not None:
            self._add_lora(lora)
        # from_pretrained returns the library model in eval mode, and Lightning keeps each module's mode.
        self.train()

    # The model.

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, V] of the token after each position of ``input_ids`` [B, T] (padding 0 in
        ``attention_mask``, either side)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return self.layers((input_ids, attention_mask))

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The model's own tokenizer, ``AutoTokenizer.from_pretrained(name_or_path)``, read on first use; None when
        the source has none."""
        if self._tokenizer is None:
            source = Path(self.hparams["name_or_path"])
            # transformers builds an empty tokenizer for a directory without one: look for its files first.
            if source.is_dir() and not any((source / name).is_file() for name in _TOKENIZER_FILES):
                return None
            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.hparams["name_or_path"])
            except (OSError, ValueError, TypeError):  # a hub model without one, or a source no longer there
                return None
        return self._tokenizer

    def head_prefixes(self) -> tuple[str, ...]:
        # The model keeps its vocabulary: fine-tuning starts from every pretrained weight, the head included.
        return ()

    def freeze_backbone_parameters(self) -> None:
        """Train the final norm and the output projection only (a tied embedding is the output projection)."""
        last = {f"layers.{len(self.layers) - 2}", f"layers.{len(self.layers) - 1}"}
        for parameter in self.parameters():
            parameter.requires_grad_(False)
        for name, parameter in self.named_parameters(remove_duplicate=False):
            if ".".join(name.split(".")[:2]) in last:
                parameter.requires_grad_(True)

    def _add_lora(self, lora: dict[str, Any]) -> None:
        from peft import LoraConfig, inject_adapter_in_model
        from transformers.pytorch_utils import Conv1D

        linear = (nn.Linear, Conv1D)  # GPT-2's projections are Conv1D
        default = sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, module in self.layers.named_modules()
                if isinstance(module, linear) and ".layer." in name
            }
        )
        settings = {"target_modules": default, **lora}
        if self.hparams["config"].get("model_type") == "gpt2":
            settings.setdefault("fan_in_fan_out", True)  # Conv1D stores its weight transposed
        inject_adapter_in_model(LoraConfig(**settings), self.layers)
        for name, parameter in self.layers.named_parameters():
            parameter.requires_grad_("lora_" in name)

    # Training.

    @staticmethod
    def _targets(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """What positions ``0 .. T - 2`` learn, [B, T - 1]: the labels shifted, -100 where nothing is learned."""
        labels = batch.get("labels")
        if labels is None:
            mask = batch.get("attention_mask")
            labels = batch["input_ids"] if mask is None else batch["input_ids"].masked_fill(mask == 0, IGNORE_INDEX)
        return labels[:, 1:]

    def batch_loss_weight(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The number of tokens the loss of ``batch`` averages over (its labels other than -100, shifted).

        ``GPipeStrategy`` weighs each micro-batch's token mean by it under every schedule, so a pipelined step is the
        whole batch's token mean, padding and prompts of any length included; plain Lightning never calls it.
        """
        return (self._targets(batch) != IGNORE_INDEX).sum()

    def _loss(self, batch: Mapping[str, torch.Tensor], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sum of the learned tokens' cross-entropies and their count."""
        targets = self._targets(batch)  # [B, T - 1]: position t learns token t + 1
        total = nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return total, (targets != IGNORE_INDEX).sum()

    def _inputs(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            raise TypeError(
                f"a PretrainedCausalLM batch is a mapping with 'input_ids' (and 'attention_mask', 'labels'), as "
                f"Hugging Face's collators make it, not a {type(batch).__name__}"
            )
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        return ids, torch.ones_like(ids) if mask is None else mask

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.layers(self._inputs(batch))
        # Under GPipeStrategy only the last stage runs past this line.
        total, count = self._loss(batch, logits)
        loss = total / count.clamp(min=1)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        logits = self.layers(self._inputs(batch))
        total, count = self._loss(batch, logits)
        tokens = max(int(count), 1)
        # Weighted by their tokens, the batches' losses average to the token mean of the whole validation set.
        self.log("val_loss", total / tokens, prog_bar=True, sync_dist=True, batch_size=tokens)

    def predict_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        """The prompts and their continuations, [B, P + max_new_tokens], padded after the rows that ended early (so
        that the micro-batches of a pipelined step, which stop on their own, join into one tensor)."""
        ids, mask = self._inputs(batch)
        settings = self.hparams.get("generation") or {}
        tokens = self.generate(ids, mask, **settings)
        width = ids.shape[1] + settings.get("max_new_tokens", MAX_NEW_TOKENS)
        return nn.functional.pad(tokens, (0, width - tokens.shape[1]), value=self.pad_id)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **settings: Any) -> Any:
        """:func:`~zoo.hf.causal_lm_generation.generate` on this model: prompts [B, P] (left-padded) and their
        continuations, [B, P + n]."""
        settings.setdefault("eos_token_id", self.eos_ids)
        settings.setdefault("pad_token_id", self.pad_id)
        return generate(self, input_ids, attention_mask, **settings)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(
            [p for p in self.parameters() if p.requires_grad], lr=self.hparams["lr"],
            weight_decay=self.hparams["weight_decay"],
        )  # fmt: skip
        warmup = max(int(self.hparams["warmup_steps"]), 1)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min((step + 1) / warmup, 1.0))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    # Export.

    def library_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights (LoRA adapters merged) under the ``transformers`` model's own names (tied names share one
        tensor)."""
        state = {f"layers.{key}": value for key, value in _merged(self.layers).state_dict().items()}
        return {library: state[zoo] for zoo, library in self.library_keys.items()}

    def export_pretrained(self, directory: str | Path) -> Path:
        """Write the model (LoRA adapters merged) and its tokenizer, when it has one, as a ``transformers`` directory
        (``save_pretrained``), which ``AutoModelForCausalLM.from_pretrained(directory)`` loads with these weights."""
        library = build_causal_lm(self.hparams["name_or_path"], self.hparams["config"], pretrained=False)
        state = {f"layers.{key}": value for key, value in _merged(self.layers).state_dict().items()}
        export_state_dict(state, self.library_keys, library)
        library.generation_config = GenerationConfig.from_dict(self.hparams["generation_config"])
        out = Path(directory)
        library.save_pretrained(out)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(out)
        return out


def _first_set(*values: Any) -> Any:
    return next((value for value in values if value is not None), None)


def _merged(layers: nn.Module) -> nn.Module:
    """``layers`` with every LoRA adapter merged into its base layer (a copy; ``layers`` itself when it has none)."""
    from peft.tuners.lora import LoraLayer

    if not any(isinstance(module, LoraLayer) for module in layers.modules()):
        return layers
    merged = copy.deepcopy(layers)
    for name, module in list(merged.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(merged.get_submodule(parent), child, module.get_base_layer())
    return merged
