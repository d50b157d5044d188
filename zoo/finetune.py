"""Fine-tuning from a pretrained checkpoint: the backbone's weights loaded exactly, the task heads new.

A checkpoint written by ``Trainer.save_checkpoint`` (with any number of pipeline stages: GPipeStrategy saves the whole
model under its unpartitioned names; a file, or a sharded directory) carries the zoo model's registry name and
constructor arguments, so :func:`load_pretrained` can rebuild the architecture, load every backbone weight and start
the heads afresh, as the GPipe paper fine-tunes its ImageNet AmoebaNet on CIFAR and Food-101. Files are read with
``weights_only=True``: a checkpoint whose unpickling would run code is refused. No weight is read by
:func:`load_pretrained` itself: the model is built on the meta device, and its weights are read on first use, or by
``GPipeStrategy`` one stage per process (:mod:`zoo.deferred`).
"""

from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path
from typing import Any

from torch import nn

from zoo._registry import model_class
from zoo.backbone import load_backbone, read_checkpoint
from zoo.deferred import initialize_unread, parameters_on_meta
from zoo.tasks.base import ZooModule
from zoo.timm_models import load_timm

__all__ = ["load_pretrained"]

log = logging.getLogger(__name__)

TIMM_SOURCE = "timm/"  # load_pretrained("timm/<model name>"): timm's pretrained weights (zoo.timm_models)


def load_pretrained(
    path: str | Path,
    num_classes: int | None = None,
    freeze_backbone: bool = False,
    *,
    architecture: str | None = None,
    **overrides: Any,
) -> ZooModule:
    """Rebuild the zoo model saved at ``path`` for a new task: backbone weights loaded, heads new.

    Args:
        path: a checkpoint written by ``Trainer.save_checkpoint`` from a zoo model, with any number of stages (a
            file, or a sharded checkpoint directory);
            ``"timm/<model name>"`` for a timm ResNet, ConvNeXt or ViT with timm's pretrained weights (a local file
            with ``weights=PATH``; see :func:`zoo.timm_models.load_timm`); or a Hugging Face translation model
            (M2M-100, NLLB, Marian): a hub id such as ``"facebook/m2m100_418M"`` or a ``save_pretrained`` directory,
            converted into a :class:`~zoo.tasks.pretrained_translation.PretrainedTranslator` with every weight loaded
            (``overrides`` are its training arguments, e.g. ``lr``; it has no ``num_classes``); or a Hugging Face
            decoder-only language model (Llama, Mistral, Qwen, Gemma, Phi-3, OLMo, GPT-2, ...), likewise converted
            into a :class:`~zoo.tasks.causal_lm.PretrainedCausalLM` (``freeze_backbone`` trains its head only). A
            source that starts with ``.``, ``/`` or ``~`` (expanded to the home directory), has more than one ``/`` or
            is a ``Path`` is a local path, never a hub id.
        num_classes: classes of the new task; the classifier and the aux classifier are re-created for it and
            freshly initialized. ``None`` keeps the checkpoint's number of classes (the heads are still new).
        freeze_backbone: train the heads only; every other parameter has ``requires_grad=False``.
        architecture: the registry name the checkpoint must hold (e.g. ``"amoebanet_d"``); another one is refused.
        overrides: other constructor arguments to change (training hyper-parameters such as ``lr``; architecture
            arguments must stay as saved, or the backbone will not fit).

    Returns:
        The model, its pretrained weights on the meta device until their first use (``model.load_weights()`` reads
        them now; under ``GPipeStrategy`` each process reads its own stage's); ``model.load_report`` (a
        :class:`LoadReport`) lists the loaded, new and skipped keys of a zoo checkpoint or timm source.

    Raises:
        FileNotFoundError: ``path`` is neither an existing file or directory nor a hub id, with the accepted forms.
    """
    if isinstance(path, str) and path.startswith(TIMM_SOURCE):
        return load_timm(path.removeprefix(TIMM_SOURCE), num_classes, freeze_backbone, **overrides)
    if str(path).startswith("~"):  # as a shell would; neither torch.load nor the hub's loader expands it
        path = Path(path).expanduser() if isinstance(path, Path) else os.path.expanduser(path)
    if _is_hf_source(path):
        return _load_hf(path, num_classes, freeze_backbone, architecture, overrides)
    if not Path(path).exists():
        raise FileNotFoundError(
            f"no checkpoint at {str(path)!r}: no such file or directory. zoo.load_pretrained takes a checkpoint file "
            "written by Trainer.save_checkpoint, a save_pretrained directory, 'timm/<model name>', or a Hugging Face "
            "hub id 'org/name' (e.g. 'facebook/m2m100_418M'); a source that starts with '.', '/' or '~', has more "
            "than one '/' or is a Path is read as a local path, not a hub id"
        )
    checkpoint = read_checkpoint(path)
    name = checkpoint["zoo_model"]
    if architecture is not None and name != architecture:
        raise ValueError(
            f"{str(path)!r} holds a {name!r} model, not the expected {architecture!r}: pass a checkpoint of "
            f"{architecture!r}, or architecture={name!r}"
        )
    cls = _HF_CLASSES[name]() if name in _HF_CLASSES else model_class(name)
    accepted = inspect.signature(cls).parameters
    # LightningCLI adds its own entries ("_class_path", "_instantiator") to the saved hyper-parameters.
    arguments = {key: value for key, value in checkpoint.get("hyper_parameters", {}).items() if not key.startswith("_")}
    arguments.update(overrides)
    if "pretrained" in accepted:
        arguments["pretrained"] = None  # the weights come from this checkpoint, not from the one it was made from
    for key, value in (("num_classes", num_classes), ("freeze_backbone", freeze_backbone or None)):
        if value is None:
            continue
        if key not in accepted:
            raise ValueError(f"{key}={value!r}: the {name!r} model has no such argument ({', '.join(accepted)})")
        arguments[key] = value
    with parameters_on_meta():  # the backbone is read later, the heads start as the model's code starts them
        model = cls(**arguments)
    assert isinstance(model, ZooModule)
    heads = [key for key in nn.Module.state_dict(model) if model.is_head(key)]
    initialize_unread(model, heads, _reset)
    model.load_report = load_backbone(model, path, checkpoint)
    return model


def _reset(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


_HF_TRANSLATION = "hf_translation"  # PretrainedTranslator.zoo_name, outside the registry


def _hf_translation_class() -> type[ZooModule]:
    from zoo.tasks.pretrained_translation import PretrainedTranslator

    return PretrainedTranslator


def _hf_causal_lm_class() -> type[ZooModule]:
    from zoo.tasks.causal_lm import PretrainedCausalLM

    return PretrainedCausalLM


# The Hugging Face models' zoo names (outside the registry: they need a source to exist), imported when met.
_HF_CLASSES = {_HF_TRANSLATION: _hf_translation_class, "hf_causal_lm": _hf_causal_lm_class}


def _is_hf_source(path: str | Path) -> bool:
    from zoo.hf.conversion import is_hf_source  # transformers is imported only for Hugging Face sources

    return is_hf_source(path)


def _load_hf(
    source: str | Path, num_classes: int | None, freeze_backbone: bool, architecture: str | None, overrides: Any
) -> ZooModule:
    from transformers import AutoConfig

    if AutoConfig.from_pretrained(str(source)).is_encoder_decoder:
        return _load_hf_translation(source, num_classes, freeze_backbone, architecture, overrides)
    from zoo.tasks.causal_lm import PretrainedCausalLM

    if num_classes is not None:
        raise ValueError(
            f"num_classes={num_classes!r} does not apply to the Hugging Face language model {str(source)!r}: it keeps "
            "its vocabulary (fine-tune the whole model, its head with freeze_backbone=True, or LoRA adapters)"
        )
    _expect_architecture(source, "a Hugging Face language model", PretrainedCausalLM.zoo_name, architecture)
    return PretrainedCausalLM(str(source), pretrained=True, freeze_backbone=freeze_backbone, **overrides)


def _expect_architecture(source: str | Path, kind: str, loads_as: str, architecture: str | None) -> None:
    """Refuse a source of ``kind``, which loads as ``loads_as``, where the caller expected another ``architecture``."""
    if architecture is not None and architecture != loads_as:
        raise ValueError(f"{str(source)!r} is {kind}, which loads as {loads_as!r}, not the expected {architecture!r}")


def _load_hf_translation(
    source: str | Path, num_classes: int | None, freeze_backbone: bool, architecture: str | None, overrides: Any
) -> ZooModule:
    from zoo.tasks.pretrained_translation import PretrainedTranslator

    for key, value in (("num_classes", num_classes), ("freeze_backbone", freeze_backbone or None)):
        if value is not None:
            raise ValueError(
                f"{key}={value!r} does not apply to the Hugging Face translation model {str(source)!r}: a translation "
                "model keeps its vocabulary and trains every weight (its output projection is the shared embedding)"
            )
    _expect_architecture(source, "a Hugging Face model", PretrainedTranslator.zoo_name, architecture)
    return PretrainedTranslator(str(source), pretrained=True, **overrides)
