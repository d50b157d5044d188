"""A Hugging Face model read per tensor: the library model built on the meta device, and where each tensor is stored.

:func:`checkpoint_files` finds the weight files of a hub id or ``save_pretrained`` directory (``model.safetensors``
or the shards its index lists; else ``pytorch_model.bin`` and its shards, memory-mapped). :func:`build_on_meta` builds
the ``transformers`` model from its config with every tensor a checkpoint holds on the meta device, reading nothing.
:func:`stored_names` maps each of its tensors to the name the files hold it under, by the library's own renaming of
legacy names and of the base-model prefix (``from_pretrained``'s), a tied tensor to whichever of its names the files
hold; :func:`initialize_unstored` gives the tensors the files lack the library's own initialization, as
``from_pretrained`` does (Marian's sinusoidal position tables, which ``save_pretrained`` leaves out).
:class:`LibraryWeights` then reads a zoo module's keys through the library tensors they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from zoo.deferred import initialize_unread, parameters_on_meta
from zoo.weights import CheckpointReader, SafetensorsFiles, TensorFiles, TorchFile

__all__ = [
    "LibraryWeights",
    "build_on_meta",
    "checkpoint_files",
    "initialize_unstored",
    "resolve_dtype",
    "stored_names",
]


def checkpoint_files(source: str) -> TensorFiles:
    """The weight files of ``source`` (a hub id, downloaded as ``from_pretrained`` would, or a directory)."""
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME
    from transformers.utils.hub import cached_file, get_checkpoint_shard_files

    for name in (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME):
        path = cached_file(source, name, _raise_exceptions_for_missing_entries=False)
        if path is None:
            continue
        if name.endswith(".index.json"):
            shards, _ = get_checkpoint_shard_files(source, path)
            return SafetensorsFiles(path, shards) if name == SAFE_WEIGHTS_INDEX_NAME else TorchFile(path, files=shards)
        return SafetensorsFiles(path) if name == SAFE_WEIGHTS_NAME else TorchFile(path)
    raise FileNotFoundError(
        f"{source!r} has no weights: none of {SAFE_WEIGHTS_NAME}, {SAFE_WEIGHTS_INDEX_NAME}, {WEIGHTS_NAME} or "
        f"{WEIGHTS_INDEX_NAME}; give a directory written by save_pretrained or a hub id with its weights"
    )


def resolve_dtype(dtype: str, config: PretrainedConfig, source: str | None = None) -> torch.dtype:
    """``dtype`` (a torch dtype's name, or ``"auto"``: the checkpoint's, as its config, else the files of ``source``,
    say)."""
    if dtype != "auto":
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
            raise ValueError(
                f"dtype={dtype!r} is not a floating-point torch dtype; use 'float32', 'bfloat16' or 'auto'"
            )
        return resolved
    stated = getattr(config, "dtype", None)
    if isinstance(stated, str):
        stated = getattr(torch, stated, None)
    if isinstance(stated, torch.dtype):
        return stated
    files = checkpoint_files(source) if source is not None else None
    stored = [entry.dtype for entry in files.entries.values() if entry.dtype.is_floating_point] if files else []
    return stored[0] if stored else torch.get_default_dtype()


def build_on_meta(auto_class: Any, config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """``auto_class.from_config(config)`` in ``dtype``, with every tensor a checkpoint holds on the meta device."""
    with parameters_on_meta():
        model = auto_class.from_config(config, dtype=dtype)
    assert isinstance(model, PreTrainedModel), type(model)
    return model


def stored_names(library: PreTrainedModel, files: TensorFiles) -> dict[str, str]:
    """For each state-dict key of ``library`` whose tensor ``files`` hold, the name they hold it under."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(library)
    if any(isinstance(transform, WeightConverter) for transform in transforms):
        raise ValueError(
            f"a {library.config.model_type!r} checkpoint stores tensors that from_pretrained combines into others; "
            "the zoo reads a model's tensors one by one and cannot load it"
        )
    renamings = [transform for transform in transforms if isinstance(transform, WeightRenaming)]
    state = nn.Module.state_dict(library, keep_vars=True)
    to_library: dict[str, str] = {}
    for name in files.entries:
        key, _ = rename_source_key(name, renamings, [], library.base_model_prefix, state)
        if key in state:
            to_library.setdefault(key, name)
    by_tensor: dict[int, list[str]] = {}
    for key, tensor in state.items():
        by_tensor.setdefault(id(tensor), []).append(key)
    names: dict[str, str] = {}
    for keys in by_tensor.values():  # a tied tensor: any of its names the files hold serves all
        stored = next((to_library[key] for key in keys if key in to_library), None)
        if stored is not None:
            names.update(dict.fromkeys(keys, stored))
    return names


def initialize_unstored(library: PreTrainedModel, names: Mapping[str, str]) -> None:
    """Give the tensors of ``library`` that no file holds the library's own initialization, on the CPU."""
    missing = [key for key in nn.Module.state_dict(library, keep_vars=True) if key not in names]
    initialize_unread(library, missing, library._init_weights)


@dataclasses.dataclass
class LibraryWeights:
    """Where the tensors of a library model built on the meta device are stored: ``files``, and the stored name of
    each tensor by ``id`` (taken before any wrapper, such as LoRA's, renames the modules holding them)."""

    files: TensorFiles
    by_tensor: dict[int, str]

    @classmethod
    def of(cls, library: PreTrainedModel, source: str) -> LibraryWeights:
        """The weights of ``source`` for ``library`` (built by :func:`build_on_meta`), whose tensors the files lack
        are initialized here (:func:`initialize_unstored`)."""
        files = checkpoint_files(source)
        names = stored_names(library, files)
        initialize_unstored(library, names)
        state = nn.Module.state_dict(library, keep_vars=True)
        return cls(files, {id(state[key]): stored for key, stored in names.items()})

    def reader(self, module: nn.Module) -> CheckpointReader:
        """The reader of ``module``'s state-dict keys whose tensors are stored here, checked against their shapes."""
        state = nn.Module.state_dict(module, keep_vars=True)
        names = {key: self.by_tensor[id(tensor)] for key, tensor in state.items() if id(tensor) in self.by_tensor}
        reader = CheckpointReader(self.files, names)
        reader.check_shapes({key: tuple(tensor.shape) for key, tensor in state.items()})
        return reader
