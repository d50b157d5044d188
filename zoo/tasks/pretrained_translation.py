"""A pretrained Hugging Face translation model (M2M-100, NLLB, Marian) as a zoo LightningModule.

It is not in the registry of ``zoo.create_model`` (a model needs a ``name_or_path`` to exist, and the registry's
models are the paper's); its checkpoints carry ``zoo_model: "hf_translation"``, which ``zoo.load_pretrained``
recognizes.
Importing this module imports ``transformers``, so ``import zoo`` leaves it out until it is used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from zoo.hf.checkpoint import build_on_meta
from zoo.hf.conversion import build_library_model, key_map, layers_from_library_model
from zoo.hf.export import DEFAULT_SHARD_SIZE, export_directory
from zoo.tasks.seq2seq import Seq2SeqTask

__all__ = ["PretrainedTranslator"]


class PretrainedTranslator(Seq2SeqTask):
    """A ``transformers`` encoder-decoder translation model whose modules form one flat ``nn.Sequential``.

    ``name_or_path`` is a hub id (``"facebook/m2m100_418M"``, ``"Helsinki-NLP/opus-mt-en-de"``) or a ``save_pretrained``
    directory; ``zoo.load_pretrained(name_or_path)`` is the usual way in. The layers wrap the library's own modules
    (:mod:`zoo.hf.layers`), so the forward is the library's and the output projection is the shared embedding's
    ``nn.Parameter`` itself. :meth:`export_pretrained` writes a directory that ``transformers`` loads back.

    A batch is ``(source, target)``, LongTensors [B, S] and [B, T] right-padded with the model's pad id, as the
    model's tokenizer makes them: ``source`` the tokenizer's ``input_ids`` (M2M-100: ``__en__ ... </s>``), ``target``
    the ``decoder_start_token_id`` followed by the tokenizer's labels (M2M-100: ``</s> __de__ ... </s>``; Marian:
    ``<pad> ... </s>``). :class:`zoo.hf.data.PretrainedTranslationDataModule` makes such batches. The model reads
    ``(source, target[:, :-1])`` and learns ``target[:, 1:]`` with label-smoothed cross-entropy over non-padding
    tokens; validation logs ``val_loss`` and ``val_acc`` as the zoo's :class:`~zoo.Transformer` does (both are
    :class:`~zoo.tasks.seq2seq.Seq2SeqTask`).

    Args:
        name_or_path: where the tokenizer (and, with ``pretrained``, the weights) come from.
        config: the library config as a dict; filled in from ``name_or_path`` and saved with the
            hyper-parameters, so a checkpoint rebuilds the architecture without reading ``name_or_path`` (not named
            ``source``: the data modules' hyper-parameter of that name is their corpus, and Lightning merges both).
        pretrained: load ``name_or_path``'s weights (True), or start from random ones (``zoo.load_pretrained`` passes
            None when a zoo checkpoint provides the weights).
        label_smoothing, lr, warmup_steps, optimizer: the objective and the optimizer (Adam with an
            inverse-square-root warmup by default, :mod:`zoo.transformer.optimization`).
        dtype: what the pretrained weights load as: ``"float32"`` (Lightning's ``precision`` then decides what
            trains), ``"bfloat16"``, or ``"auto"`` (the checkpoint's). Each tensor is converted as it is read.

    With ``pretrained``, building the model reads no weight: under ``GPipeStrategy`` each process reads its own stage's
    tensors at setup, anywhere else the first use reads them all (:mod:`zoo.deferred`).
    """

    zoo_name: ClassVar[str] = "hf_translation"

    def __init__(
        self,
        name_or_path: str,
        config: dict[str, Any] | None = None,
        pretrained: bool | None = True,
        label_smoothing: float = 0.1,
        optimizer: str = "adam",
        lr: float = 1e-4,
        warmup_steps: int = 100,
        dtype: str = "float32",
    ) -> None:
        super().__init__(optimizer=optimizer, label_smoothing=label_smoothing)
        library, weights = build_library_model(str(name_or_path), config, pretrained=bool(pretrained), dtype=dtype)
        library_config: PretrainedConfig = library.config
        self.save_hyperparameters(ignore=["config"])
        self.hparams["config"] = library_config.to_dict()
        self.layers = layers_from_library_model(library)
        # Zoo state-dict key -> library state-dict key, for export; the library model itself is not kept.
        self.library_keys = {f"layers.{key}": value for key, value in key_map(self.layers, library).items()}
        self.pad_id = int(library_config.pad_token_id)
        self.decoder_start_id = int(library_config.decoder_start_token_id)
        self.eos_id = int(library_config.eos_token_id)
        self._tokenizer: PreTrainedTokenizerBase | None = None
        if weights is not None:
            self.defer_weights(weights.reader(self))
        self.train()

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's own tokenizer, ``AutoTokenizer.from_pretrained(source)``, read on first use."""
        if self._tokenizer is None:
            self._tokenizer = AutoTokenizer.from_pretrained(self.hparams["name_or_path"])
        return self._tokenizer

    @property
    def num_encoder_entries(self) -> int:
        """How many entries of ``layers`` turn ``(source, target_in)`` into the encoder stream (embedding, layers,
        norm): ``layers[:n]`` is the encoder, ``layers[n:]`` the decoder."""
        config = self.hparams["config"]
        has_norm = config.get("model_type") != "marian"
        return 1 + int(config["encoder_layers"]) + int(has_norm)

    def encode(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the encoder once: ``source`` [B, S] -> (memory [B, S, D], source_mask [B, S] bool)."""
        self.load_weights()
        memory, source_mask, _ = self.layers[: self.num_encoder_entries]((source, source[:, :0]))
        return memory, source_mask

    def decode(self, memory: torch.Tensor, source_mask: torch.Tensor, target_in: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] for ``target_in`` [B, T] attending to an :meth:`encode` result."""
        self.load_weights()
        return self.layers[self.num_encoder_entries :]((memory, source_mask, target_in))

    def head_prefixes(self) -> tuple[str, ...]:
        # The output projection is the shared embedding: fine-tuning keeps every pretrained weight.
        return ()

    def export_pretrained(self, directory: str | Path, max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path:
        """Write the model and its tokenizer as a ``transformers`` directory (what ``save_pretrained`` writes), which
        ``AutoModelForSeq2SeqLM.from_pretrained(directory)`` loads with this model's weights.

        The model is never gathered in one process (:mod:`zoo.hf.export`): pending weights are read a group of layers
        at a time (at most ``max_shard_size`` bytes, a shard each); a model whose ``layers`` hold one pipeline stage
        (after ``fit`` under ``GPipeStrategy``) exports as a collective, so call it on every process.
        """
        config = AutoConfig.for_model(**self.hparams["config"])
        library = build_on_meta(AutoModelForSeq2SeqLM, config, torch.float32)

        def write_rest(staging: Path) -> None:
            if library.can_generate():
                library.generation_config.save_pretrained(staging)
            self.tokenizer.save_pretrained(staging)

        return export_directory(
            self, directory, library, self.library_keys, write_rest=write_rest, max_shard_size=max_shard_size
        )
