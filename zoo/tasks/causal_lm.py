"""A pretrained Hugging Face decoder-only language model (Llama, Mistral, Qwen, Gemma, Gemma 3, Phi-3, OLMo, OLMo 3,
GPT-2) as a zoo LightningModule.

Like :class:`~zoo.tasks.pretrained_translation.PretrainedTranslator`, it is not in the registry of
``zoo.create_model``; its checkpoints carry ``zoo_model: "hf_causal_lm"``, which ``zoo.load_pretrained`` recognizes.
Importing this module imports ``transformers``, so ``import zoo`` leaves it out until it is used.
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from zoo.deferred import allocate_unread
from zoo.hf.causal_lm import build_causal_lm, causal_layers
from zoo.hf.causal_lm_generation import MAX_NEW_TOKENS, generate
from zoo.hf.checkpoint import build_on_meta
from zoo.hf.conversion import key_map
from zoo.hf.export import DEFAULT_SHARD_SIZE, export_directory
from zoo.tasks.base import ZooModule

__all__ = ["IGNORE_INDEX", "SAMPLE_TOKENS", "PretrainedCausalLM"]

IGNORE_INDEX = -100  # the label of tokens left out of the loss, as Hugging Face's collators write it
SAMPLE_TOKENS = 2048
"""The length of ``example_input_array``'s sequence, at most: the planned length of the docs' recipe."""
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
    schedule, trains as the whole batch does. A packed batch (``DataCollatorWithFlattening``: ``position_ids`` [B, T]
    restarting at each sequence, no ``attention_mask``) runs as the library's forward runs it: positions restart and
    attention stays within each sequence.
    Validation logs ``val_loss`` and test ``test_loss``, the same token mean. ``predict_step`` returns
    :meth:`generate`'s tokens for the batch's (left-padded) prompts, with the ``generation`` settings.
    ``example_input_array`` is one sequence of :data:`SAMPLE_TOKENS` tokens (fewer if the model's context is shorter),
    what ``GPipeStrategy(plan="auto")`` and ``balance="flops"`` measure the layers on: set it to one sequence of your
    training length to plan for that.

    With ``pretrained``, building the model reads no weight: under ``GPipeStrategy`` each process reads its own stage's
    tensors at setup, anywhere else the first use reads them all (:mod:`zoo.deferred`).

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
            ``target_modules`` defaults to every linear layer of the decoder layers): only the adapters train,
            :meth:`export_pretrained` writes the merged weights and :meth:`export_adapter` the adapters alone.
        generation: keyword arguments of :func:`~zoo.hf.causal_lm_generation.generate` for ``predict_step`` (e.g.
            ``{"max_new_tokens": 64, "do_sample": True, "top_p": 0.9, "seed": 0}``).
        generation_config: the library's generation config as a dict; filled in from ``name_or_path`` (its
            ``generation_config.json``), saved with the hyper-parameters and exported. Its end-of-sequence tokens
            (Llama 3 Instruct lists several) and padding token are those :meth:`generate` uses.
        dtype: what the pretrained weights load as: ``"float32"`` (Lightning's ``precision`` then decides what trains:
            ``"bf16-true"`` casts the model, ``"bf16-mixed"`` keeps float32 weights), ``"bfloat16"``, or ``"auto"``
            (the checkpoint's, ``transformers``' own default). Each tensor is converted as it is read.
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
        library, weights = build_causal_lm(str(name_or_path), config, pretrained=bool(pretrained), dtype=dtype)
        library_config: PretrainedConfig = library.config
        self.save_hyperparameters(ignore=["config", "generation_config"])
        self.hparams["config"] = library_config.to_dict()
        if generation_config is None:  # the source's generation_config.json, as from_pretrained reads it
            generation_config = _source_generation_config(str(name_or_path), library) if pretrained else None
            generation_config = generation_config or library.generation_config.to_dict()
        self.hparams["generation_config"] = generation_config
        self.layers = causal_layers(library)
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
            if weights is not None and _reads_base_weights(lora):  # PiSSA, OLoRA, ...: read the weights first
                self.defer_weights(weights.reader(self))
                self.load_weights()
                weights = None
            self._add_lora(lora)
        if weights is not None:
            self.defer_weights(weights.reader(self))
        self.example_input_array = self.sample_input()
        # from_pretrained returns the library model in eval mode, and Lightning keeps each module's mode.
        self.train()

    # The model.

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] of the token after each position of ``input_ids`` [B, T] (padding 0 in
        ``attention_mask``, either side; ``position_ids`` without ``attention_mask``: packed sequences)."""
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        return self.layers(self._inputs({key: value for key, value in batch.items() if value is not None}))

    def sample_input(self) -> torch.Tensor:
        """One sequence of token ids [1, T] (zeros), ``T`` the model's context up to :data:`SAMPLE_TOKENS`: the
        default ``example_input_array``, on the default device (meta within ``torch.device("meta")``)."""
        config = self.hparams["config"]
        context = config.get("max_position_embeddings") or config.get("n_positions") or SAMPLE_TOKENS
        return torch.zeros(1, min(int(context), SAMPLE_TOKENS), dtype=torch.long)

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the model's learned positions cover (GPT-2's ``n_positions``); ``None`` for rotary
        positions, which run past ``max_position_embeddings`` as the library's do."""
        config = self.hparams["config"]
        return int(config["n_positions"]) if config.get("model_type") == "gpt2" else None

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
        config = LoraConfig(**settings)
        self._lora_config = config  # the sequence's own peft_config is left behind when a pipeline cuts it
        inject_adapter_in_model(config, self.layers)
        for name, parameter in self.layers.named_parameters():
            parameter.requires_grad_("lora_" in name)
        _initialize_adapters_on_meta(self.layers, config)

    # Training.

    @staticmethod
    def _targets(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """What positions ``0 .. T - 2`` learn, [B, T - 1]: the labels shifted, -100 where nothing is learned.

        Without ``labels``: the ``input_ids``, less the padding and, in a packed batch, each sequence's first token
        (where the positions do not go up by one, as the library's masks find the sequences), which the previous
        sequence's last token must not learn."""
        labels = batch.get("labels")
        if labels is None:
            labels = batch["input_ids"]
            if (mask := batch.get("attention_mask")) is not None:
                labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
            if (positions := batch.get("position_ids")) is not None:
                starts = torch.diff(positions, prepend=positions[:, :1] - 1) != 1
                labels = labels.masked_fill(starts, IGNORE_INDEX)
        return labels[:, 1:]

    def batch_loss_weight(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The number of tokens the loss of ``batch`` averages over (its labels other than -100, shifted).

        ``GPipeStrategy`` weighs each micro-batch's token mean by it under every schedule, so a pipelined step is the
        whole batch's token mean, padding and prompts of any length included; plain Lightning never calls it.
        """
        return (self._targets(_mapping(batch)) != IGNORE_INDEX).sum()

    def _loss(self, batch: Mapping[str, torch.Tensor], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sum of the learned tokens' cross-entropies and their count."""
        targets = self._targets(batch)  # [B, T - 1]: position t learns token t + 1
        total = nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return total, (targets != IGNORE_INDEX).sum()

    def _inputs(self, batch: Mapping[str, torch.Tensor]) -> tuple[Any, ...]:
        """The first layer's input: ``(input_ids, attention_mask)``, or ``(input_ids, attention_mask or None,
        position_ids)`` when the batch gives positions (a packed batch); checked against the model's positions before
        any layer runs, so that under the pipeline every stage refuses it alike."""
        ids = _mapping(batch)["input_ids"]
        mask, positions = batch.get("attention_mask"), batch.get("position_ids")
        if self.max_positions is not None:  # learned positions: refused past them here, not by an embedding's index
            self._check_length(ids.shape[1] if positions is None else int(positions.max()) + 1, "a sequence")
        if positions is None:
            return ids, torch.ones_like(ids) if mask is None else mask
        return ids, mask, positions

    def _check_length(self, tokens: int, what: str) -> None:
        limit = self.max_positions
        if limit is not None and tokens > limit:
            raise ValueError(
                f"{what} of {tokens} tokens exceeds the model's {limit} learned positions (n_positions); truncate to "
                f"{limit}, e.g. tokenizer(..., truncation=True, max_length={limit})"
            )

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.layers(self._inputs(batch))
        # Under GPipeStrategy only the last stage runs past this line.
        total, count = self._loss(batch, logits)
        loss = total / count.clamp(min=1)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluate(batch, "val_loss")

    def test_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluate(batch, "test_loss")

    def _evaluate(self, batch: Mapping[str, torch.Tensor], name: str) -> None:
        logits = self.layers(self._inputs(batch))
        total, count = self._loss(batch, logits)
        tokens = max(int(count), 1)
        # Weighted by their tokens, the batches' losses average to the token mean of the whole set.
        self.log(name, total / tokens, prog_bar=True, sync_dist=True, batch_size=tokens)

    def predict_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        """The prompts and their continuations, [B, P + max_new_tokens], padded after the rows that ended early (so
        that the micro-batches of a pipelined step, which stop on their own, join into one tensor)."""
        ids, mask, *_ = self._inputs(batch)
        settings = self.hparams.get("generation") or {}
        tokens = self.generate(ids, mask, **settings)
        width = ids.shape[1] + settings.get("max_new_tokens", MAX_NEW_TOKENS)
        return nn.functional.pad(tokens, (0, width - tokens.shape[1]), value=self.pad_id)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **settings: Any) -> Any:
        """:func:`~zoo.hf.causal_lm_generation.generate` on this model: prompts [B, P] (left-padded) and their
        continuations, [B, P + n]."""
        settings.setdefault("eos_token_id", self.eos_ids)
        settings.setdefault("pad_token_id", self.pad_id)
        self.load_weights()
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

    def export_pretrained(self, directory: str | Path, max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path:
        """Write the model (LoRA adapters merged) and its tokenizer, when it has one, as a ``transformers`` directory
        (what ``save_pretrained`` writes), which ``AutoModelForCausalLM.from_pretrained(directory)`` loads with these
        weights.

        The model is never gathered in one process (:mod:`zoo.hf.export`): pending weights are read a group of layers
        at a time (at most ``max_shard_size`` bytes, a shard each); a model whose ``layers`` hold one pipeline stage
        (after ``fit`` under ``GPipeStrategy``) exports as a collective, so call it on every process.
        """
        config = AutoConfig.for_model(**self.hparams["config"])
        library = build_on_meta(AutoModelForCausalLM, config, torch.float32)

        def write_rest(staging: Path) -> None:
            GenerationConfig.from_dict(self.hparams["generation_config"]).save_pretrained(staging)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(staging)

        return export_directory(
            self, directory, library, self.library_keys, write_rest=write_rest, max_shard_size=max_shard_size
        )

    def export_adapter(self, directory: str | Path) -> Path:
        """Write the LoRA adapters alone as ``peft`` writes them (``adapter_config.json``,
        ``adapter_model.safetensors``), named for the ``transformers`` model: ``peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(name_or_path), directory)`` gives this model's logits.

        A model whose ``layers`` hold one pipeline stage (after ``fit`` under ``GPipeStrategy``) exports as a
        collective: call it on every process; global rank 0 gathers the stages' adapters (small beside the model) and
        writes them."""
        from peft.utils import SAFETENSORS_WEIGHTS_NAME
        from safetensors.torch import save_file

        config = getattr(self, "_lora_config", None)
        if config is None:
            raise ValueError(
                "export_adapter writes LoRA adapters, and this model has none: load it with lora={'r': 8, ...}, or "
                "write the whole model with export_pretrained(directory)"
            )
        state: dict[str, torch.Tensor] | None = self._adapter_state("default")  # inject_adapter_in_model's name
        if state is not None and not getattr(self.layers, "holds_all_layers", True):
            state = _gathered_adapters(state)
        if state is None:  # not global rank 0 of a pipelined model: its stage's adapters went there
            return Path(directory)
        config = copy.copy(config)
        config.base_model_name_or_path, config.task_type = str(self.hparams["name_or_path"]), "CAUSAL_LM"
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out) as staging:  # each file moved in whole: none is ever half-written
            config.save_pretrained(staging)
            save_file(state, Path(staging) / SAFETENSORS_WEIGHTS_NAME, metadata={"format": "pt"})
            for written in Path(staging).iterdir():
                os.replace(written, out / written.name)
        return out

    def _adapter_state(self, adapter: str) -> dict[str, torch.Tensor]:
        """This process's adapters under ``peft``'s saved names for the library model (``base_model.model.`` and the
        library's module path, the adapter's name left out), read from the parameters: no pending weight is read."""
        # A zoo module path (`1.layer.self_attn.q_proj`) -> the library's (`model.layers.0.self_attn.q_proj`).
        modules = {
            zoo.removeprefix("layers.").rsplit(".", 1)[0]: library.rsplit(".", 1)[0]
            for zoo, library in self.library_keys.items()
        }
        state = {}
        for key, value in self.layers.named_parameters():
            if ".lora_" not in key:
                continue
            module, _, rest = key.partition(".lora_")  # rest: "A.default.weight"
            rest = rest.replace(f".{adapter}.", ".", 1)
            state[f"base_model.model.{modules[module]}.lora_{rest}"] = value.detach().cpu().contiguous()
        return state


def _gathered_adapters(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Every pipeline stage's adapters on global rank 0 (``None`` elsewhere), a collective over the world; replicas
    and tied copies hold equal values: any one is kept."""
    if not dist.is_initialized():
        return state
    parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(state, parts, dst=0)
    if parts is None:
        return None
    return {key: value for part in parts for key, value in part.items()}


_BASE_FREE_LORA_INITS = (True, False, "gaussian")  # peft's initializations that do not read the base weights


def _reads_base_weights(lora: dict[str, Any]) -> bool:
    return lora.get("init_lora_weights", True) not in _BASE_FREE_LORA_INITS


def _initialize_adapters_on_meta(layers: nn.Module, config: Any) -> None:
    """Adapters injected beside base weights still on the meta device were moved there by peft, their initialization
    lost: give them CPU memory and peft's initialization again (no file holds them)."""
    from peft.tuners.lora import LoraLayer

    for module in layers.modules():
        if not isinstance(module, LoraLayer):
            continue
        adapters = [name for name, tensor in module.named_parameters() if "lora_" in name and tensor.is_meta]
        if not adapters:
            continue
        allocate_unread(module, adapters)
        for adapter in module.lora_A:
            if config.init_lora_weights is False:  # peft leaves nn.Linear's own initialization
                for linear in (module.lora_A[adapter], module.lora_B[adapter]):
                    linear.reset_parameters()  # type: ignore[operator]
            else:
                module.reset_lora_parameters(adapter, config.init_lora_weights)


def _source_generation_config(source: str, library: Any) -> dict[str, Any] | None:
    """The generation config ``source`` ships (``generation_config.json``), as ``from_pretrained`` reads it."""
    if not library.can_generate():
        return None
    try:
        return GenerationConfig.from_pretrained(source).to_dict()
    except OSError:  # none: from_pretrained keeps the one derived from the model's config
        return None


def _mapping(batch: Any) -> Mapping[str, torch.Tensor]:
    """``batch`` if it is a collator's mapping with ``input_ids``; else the ``TypeError`` that says what one is."""
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise TypeError(
            f"a PretrainedCausalLM batch is a mapping with 'input_ids' (and 'attention_mask', 'labels'), as "
            f"Hugging Face's collators make it, not a {type(batch).__name__}"
        )
    return batch


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
