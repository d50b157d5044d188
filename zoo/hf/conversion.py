"""Conversion between a Hugging Face translation model and the zoo's flat layer sequence, both ways.

Supported: ``M2M100ForConditionalGeneration`` (M2M-100 and NLLB, which is M2M-100's architecture) and
``MarianMTModel``. The sequence is built from the library model's own modules (see :mod:`zoo.hf.layers`), so tied
weights stay one ``nn.Parameter`` and every zoo state-dict key names a tensor of the library model; :func:`key_map`
records which, for :mod:`zoo.hf.export` to write them back under the library's names.

The sequence, for ``E`` encoder and ``N`` decoder layers (the norms only where the model has them)::

    SourceEmbedding, EncoderLayer x E, [EncoderNorm], DecoderEmbedding, DecoderLayer x N, [DecoderNorm],
    OutputProjection
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn
from transformers import AutoConfig, AutoModelForSeq2SeqLM, PretrainedConfig, PreTrainedModel

from zoo.hf.checkpoint import LibraryWeights, build_on_meta, resolve_dtype
from zoo.hf.layers import (
    DecoderEmbedding,
    DecoderLayer,
    DecoderNorm,
    EncoderLayer,
    EncoderNorm,
    OutputProjection,
    SourceEmbedding,
)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "build_library_model",
    "is_hf_source",
    "key_map",
    "layers_from_library_model",
]

SUPPORTED_MODEL_TYPES = ("m2m_100", "marian")
"""``config.model_type`` of the architectures the layers wrap (NLLB checkpoints say ``"m2m_100"``)."""


def is_hf_source(source: str | Path) -> bool:
    """Whether ``source`` names a Hugging Face model: a ``save_pretrained`` directory, or a hub id such as
    ``"facebook/m2m100_418M"``.

    A hub id is ``"name"`` or ``"org/name"``, given as a ``str``, that is not a local path: a ``Path``, a string that
    starts with ``.``, ``/`` or ``~``, holds more than one ``/`` or the platform's separator, or ends in a checkpoint
    suffix (``.ckpt``, ``.pt``, ``.pth``) names a local file or directory, whether or not it exists.
    """
    path = Path(source)
    if path.is_dir():
        return (path / "config.json").is_file()
    return not path.exists() and not _names_local_path(source)


def _names_local_path(source: str | Path) -> bool:
    # Hub ids never start with "." and have at most one "/" (org/name), so such a source was meant as a path: treating
    # a missing one as a hub id would turn a typo into a network error.
    if isinstance(source, Path):
        return True
    separators = {"/", os.sep, os.altsep or "/"}
    return (
        source.startswith((".", "~", *separators))
        or source.count("/") > 1
        or any(separator in source for separator in separators - {"/"})
        or source.endswith((".ckpt", ".pt", ".pth"))
    )


def check_config(config: PretrainedConfig, source: str) -> None:
    """Refuse, with the fix, a model type the layers do not wrap."""
    if config.model_type not in SUPPORTED_MODEL_TYPES or not config.is_encoder_decoder:
        raise ValueError(
            f"{source!r} is a {config.model_type!r} model; zoo.load_pretrained converts Hugging Face translation "
            f"models of type {', '.join(map(repr, SUPPORTED_MODEL_TYPES))} (M2M-100, NLLB, Marian/opus-mt). Use one "
            "of those, or train the zoo's own Transformer (zoo.create_model('transformer', ...))"
        )


def build_library_model(
    source: str, config: dict[str, Any] | None = None, *, pretrained: bool = True, dtype: str = "float32"
) -> tuple[PreTrainedModel, LibraryWeights | None]:
    """The ``transformers`` model of ``source``, built without reading a weight, and where its weights are.

    With ``pretrained``: every tensor the checkpoint holds is on the meta device, in ``dtype`` (a ``torch`` dtype's
    name, or ``"auto"``: the checkpoint's), and :class:`~zoo.hf.checkpoint.LibraryWeights` says where each is stored
    (what the files lack, such as Marian's sinusoidal tables, is initialized as ``from_pretrained`` does). Without:
    random weights from ``config`` (a ``config.to_dict()``; default the source's), and nothing to read; random
    initialization also works under ``torch.device("meta")``. A model type the layers do not wrap is refused from its
    config, before any weight file is opened.
    """
    hf_config = AutoConfig.for_model(**config) if config is not None else AutoConfig.from_pretrained(source)
    check_config(hf_config, source)
    if not pretrained:
        model = AutoModelForSeq2SeqLM.from_config(hf_config)
        assert isinstance(model, PreTrainedModel), type(model)
        return model, None
    model = build_on_meta(AutoModelForSeq2SeqLM, hf_config, resolve_dtype(dtype, hf_config, source))
    return model, LibraryWeights.of(model, source)


def layers_from_library_model(model: nn.Module) -> nn.Sequential:
    """The flat layer sequence running ``model``'s own modules (see the module docstring for its entries)."""
    assert isinstance(model, PreTrainedModel), type(model)
    config = model.config
    # The library's attributes, typed Any: transformers' classes are not typed per architecture.
    library: Any = model
    encoder, decoder = library.model.encoder, library.model.decoder
    pad_id = config.pad_token_id

    def embedding(cls: type[SourceEmbedding] | type[DecoderEmbedding], part: Any) -> nn.Module:
        # M2M-100 scales inside its embedding module; Marian keeps the scale on the encoder/decoder.
        return cls(part.embed_tokens, part.embed_positions, getattr(part, "embed_scale", 1.0), part.dropout, pad_id)

    for part in (encoder, decoder):
        # Marian's sinusoidal table is an nn.Parameter that from_pretrained leaves trainable, yet save_pretrained
        # does not write it and loading rebuilds it: training it would change a weight the export cannot carry.
        if isinstance(part.embed_positions, nn.Embedding):
            part.embed_positions.weight.requires_grad_(False)
    encoder_norm = [EncoderNorm(encoder.layer_norm)] if getattr(encoder, "layer_norm", None) is not None else []
    decoder_norm = [DecoderNorm(decoder.layer_norm)] if getattr(decoder, "layer_norm", None) is not None else []
    return nn.Sequential(
        embedding(SourceEmbedding, encoder),
        *[EncoderLayer(layer, config, encoder.layerdrop) for layer in encoder.layers],
        *encoder_norm,
        embedding(DecoderEmbedding, decoder),
        *[DecoderLayer(layer, config, decoder.layerdrop) for layer in decoder.layers],
        *decoder_norm,
        OutputProjection(library.lm_head, getattr(library, "final_logits_bias", None)),
    )


def key_map(layers: nn.Module, model: nn.Module) -> dict[str, str]:
    """For every state-dict key of ``layers``, a key of ``model``'s state dict holding the same tensor."""
    owners: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        owners.setdefault(id(tensor), name)
    mapping = {name: owners.get(id(tensor), "") for name, tensor in layers.state_dict(keep_vars=True).items()}
    unmapped = [name for name, target in mapping.items() if not target]
    assert not unmapped, f"layers hold tensors the library model does not: {unmapped}"
    return mapping
