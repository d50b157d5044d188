"""Export at size: a zoo model's layers written as a Hugging Face directory, one group of layers at a time.

:func:`export_directory` writes what ``save_pretrained`` writes (safetensors shards under the library's names and
their index, ``config.json``, the generation config, the tokenizer) without the whole model in one process:

- a model whose ``layers`` hold one pipeline stage (after ``fit`` under ``GPipeStrategy``, or in a callback during
  it) exports as a collective: every process calls it, each stage's first replica writes the shard of the layers it
  holds, and once every shard is written global rank 0 writes the index and the rest;
- a whole model (global rank 0 writes it, whichever ranks call) writes groups of consecutive layers of at most
  ``max_shard_size`` bytes, a shard per group, each group's tensors read from the pending weights when they wait
  (:mod:`zoo.deferred`) and released once written:
  ``zoo.load_pretrained(checkpoint).export_pretrained(directory)`` streams a checkpoint (a sharded one included) to
  the Hugging Face format holding one group at a time;
- LoRA adapters are merged into their base weights layer by layer; a tied tensor is written once, under the name
  ``save_pretrained`` keeps.

Everything is written into a staging directory beside ``directory`` that replaces it at the end, so an export that
fails leaves the previous one whole.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import PreTrainedModel

__all__ = ["DEFAULT_SHARD_SIZE", "export_directory", "saved_names"]

DEFAULT_SHARD_SIZE = "5GB"
"""The largest shard (and group of layers held at once) an export writes, unless told otherwise."""

_SAFETENSORS_INDEX = "model.safetensors.index.json"


def saved_names(library: PreTrainedModel) -> set[str]:
    """The state-dict keys ``save_pretrained`` writes for ``library`` (built on any device, meta included): its
    state dict less the keys it never saves and the second names of tied tensors."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = nn.Module.state_dict(library)
    for key in library._keys_to_ignore_on_save or ():
        state.pop(key, None)
    return set(remove_tied_weights_from_state_dict(state, library))


@dataclass(frozen=True)
class _Shard:
    """One shard file: the library keys it holds and their bytes."""

    file: str
    keys: tuple[str, ...]
    size: int


def export_directory(
    model: Any,
    directory: str | Path,
    library: PreTrainedModel,
    library_keys: Mapping[str, str],
    *,
    write_rest: Callable[[Path], None],
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
) -> Path:
    """Write ``model.layers`` under ``library``'s names (``library_keys``: zoo state-dict key -> library key, before
    any LoRA renaming) into ``directory``, and ``write_rest(staging)`` the configs and the tokenizer once the shards
    are written (on global rank 0 only, for a pipeline stage). ``library`` (built on the meta device) gives the keys
    and the config; returns ``directory``."""
    from transformers.utils.hub import convert_file_size_to_int

    out = Path(directory)
    _check_replaceable(out)
    saved = saved_names(library)
    produced = set(library_keys.values())
    missing = sorted(saved - produced)
    if missing:
        raise ValueError(
            f"the model holds no tensor for {missing[:4]}: it was not converted from this Hugging Face architecture"
        )

    def finish(staging: Path, shards: Sequence[_Shard]) -> None:
        _write_index(staging, shards)
        _write_config(staging, library, model)
        write_rest(staging)
        _replace(out, staging)

    limit = convert_file_size_to_int(max_shard_size)
    if not getattr(model.layers, "holds_all_layers", True):
        _write_stage(model, out, library_keys, saved, finish)
    elif _rank() == 0:  # a whole model on every rank (data parallel, a pipeline put back together): one writer
        staging = _staging(out, os.getpid())
        try:
            finish(staging, _write_whole(model, staging, library_keys, saved, limit))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return out


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _check_replaceable(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir()) and not (out / "config.json").is_file()):
        raise ValueError(
            f"{str(out)!r} exists and is not a model directory (no config.json): an export replaces its directory "
            "whole; give a new or empty directory, or one an export wrote"
        )


def _staging(out: Path, tag: int) -> Path:
    staging = out.parent / f".{out.name}.exporting-{tag}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _replace(out: Path, staging: Path) -> None:
    """Put ``staging`` in ``out``'s place: the old directory, if any, is moved aside first and deleted last."""
    old = out.parent / f".{out.name}.replaced-{os.getpid()}"
    if out.exists():
        out.rename(old)
    staging.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _layer_state(layer: nn.Module) -> dict[str, Tensor]:
    """``layer``'s state dict with every LoRA adapter merged into its base layer, under the base layer's names."""
    from peft.tuners.lora import LoraLayer

    state = layer.state_dict()
    for name, module in layer.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        merged = copy.deepcopy(module)  # merging in place would change the model that keeps training
        merged.merge()
        prefix = f"{name}." if name else ""
        for key in [key for key in state if key.startswith(prefix)]:
            del state[key]
        state.update({f"{prefix}{key}": value for key, value in merged.get_base_layer().state_dict().items()})
    return state


def _library_tensors(
    model: Any, indices: Sequence[int], library_keys: Mapping[str, str], wanted: Callable[[str], bool]
) -> dict[str, Tensor]:
    """The tensors of layers ``indices`` under their library names, those ``wanted`` only (each once)."""
    tensors: dict[str, Tensor] = {}
    for index in indices:
        for key, value in _layer_state(model.layers[index]).items():
            library = library_keys.get(f"layers.{index}.{key}")
            if library is not None and library not in tensors and wanted(library):
                tensors[library] = value
    return tensors


def _layer_keys(model: Any, index: int, library_keys: Mapping[str, str], saved: set[str]) -> list[tuple[str, int]]:
    """Each library key layer ``index`` writes and its bytes, read from shapes alone (meta tensors included)."""
    keys = []
    for key, value in _layer_state(model.layers[index]).items():
        library = library_keys.get(f"layers.{index}.{key}")
        if library is not None and library in saved:
            keys.append((library, value.nelement() * value.element_size()))
    return keys


def _shard_name(number: int, count: int) -> str:
    return "model.safetensors" if count == 1 else f"model-{number:05d}-of-{count:05d}.safetensors"


@contextlib.contextmanager
def _held(model: Any, indices: Sequence[int]) -> Iterator[None]:
    """Layers ``indices`` of ``model`` with their pending weights read for the block (released after), if any wait."""
    read: list[tuple[int, list[str]]] = []
    try:
        if getattr(model, "weights_pending", False):
            for index in indices:
                read.append((index, model.read_pending(model.layers[index], f"layers.{index}.")))
        yield
    finally:
        for index, keys in read:
            model.release(model.layers[index], keys, f"layers.{index}.")


def _write_shard(path: Path, tensors: Mapping[str, Tensor]) -> _Shard:
    from safetensors.torch import save_file

    contiguous = {key: value.detach().to("cpu").contiguous() for key, value in tensors.items()}
    save_file(contiguous, str(path), metadata={"format": "pt"})
    size = sum(value.nelement() * value.element_size() for value in contiguous.values())
    return _Shard(path.name, tuple(contiguous), size)


def _write_whole(
    model: Any, staging: Path, library_keys: Mapping[str, str], saved: set[str], limit: int
) -> list[_Shard]:
    """Consecutive layers in groups of at most ``limit`` bytes, a shard each, each group held only while written."""
    groups: list[tuple[list[int], list[str]]] = []
    size, assigned = 0, set[str]()
    for index in range(len(model.layers)):
        new = [(key, nbytes) for key, nbytes in _layer_keys(model, index, library_keys, saved) if key not in assigned]
        if not new:
            continue
        layer_size = sum(nbytes for _, nbytes in new)
        if not groups or size + layer_size > limit:
            groups.append(([], []))
            size = 0
        groups[-1][0].append(index)
        groups[-1][1].extend(key for key, _ in new)
        assigned.update(key for key, _ in new)
        size += layer_size
    shards = []
    for number, (indices, keys) in enumerate(groups, 1):
        with _held(model, indices):
            tensors = _library_tensors(model, indices, library_keys, set(keys).__contains__)
            shards.append(_write_shard(staging / _shard_name(number, len(groups)), tensors))
            del tensors  # the group's memory goes back before the next group is read
    return shards


def _gathered(value: Any) -> list[Any]:
    """``value`` of every process, by global rank (this one's alone without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _write_stage(
    model: Any,
    out: Path,
    library_keys: Mapping[str, str],
    saved: set[str],
    finish: Callable[[Path, Sequence[_Shard]], None],
) -> None:
    """Every process's part of a pipelined model's export: the first replica of each stage writes its layers' shard
    (a tensor tied across stages by the first stage holding it), then global rank 0 the rest."""
    rank = _rank()
    held = sorted(int(name) for name, _ in model.layers.named_children())
    keys = [key for index in held for key, _ in _layer_keys(model, index, library_keys, saved)]
    proposed = str(_staging(out, os.getpid())) if rank == 0 else None
    entries = _gathered((held, keys, proposed))
    staging = Path(entries[0][2])
    writers: dict[tuple[int, ...], int] = {}
    for other, (layers, _, _) in enumerate(entries):
        writers.setdefault(tuple(layers), other)
    assigned: set[str] = set()
    plan: dict[int, list[str]] = {}
    for _, writer in sorted(writers.items(), key=lambda item: min(item[0], default=0)):
        plan[writer] = [key for key in dict.fromkeys(entries[writer][1]) if key not in assigned]
        assigned.update(plan[writer])
    numbered = [writer for writer, writes in plan.items() if writes]
    result: _Shard | str | None = None
    unheld = sorted(saved - assigned)
    if unheld:  # every process sees the same gathered layers: all raise, none writes
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(
            f"no process holds {unheld[:4]}{' ...' if len(unheld) > 4 else ''}: a model whose layers hold one pipeline "
            "stage exports as a collective, so call export_pretrained on every rank of the job"
        )
    if rank in numbered:
        try:
            tensors = _library_tensors(model, held, library_keys, set(plan[rank]).__contains__)
            result = _write_shard(staging / _shard_name(numbered.index(rank) + 1, len(numbered)), tensors)
        except Exception as error:  # reported to every process below, so that none waits for a shard never written
            result = f"{type(error).__name__}: {error}"
    results = _gathered(result)
    failure = "; ".join(f"rank {other}: {error}" for other, error in enumerate(results) if isinstance(error, str))
    if not failure and rank == 0:
        try:
            finish(staging, [results[writer] for writer in numbered])
        except Exception as error:
            failure = f"rank 0: {type(error).__name__}: {error}"
    failure = _gathered(failure)[0] or failure
    if failure:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(
            f"exporting the pipelined model to {str(out)!r} failed ({failure}); {str(out)!r} is unchanged"
        )


def _write_index(staging: Path, shards: Sequence[_Shard]) -> None:
    if len(shards) < 2:
        return
    index = {
        "metadata": {"total_size": sum(shard.size for shard in shards)},
        "weight_map": {key: shard.file for shard in shards for key in sorted(shard.keys)},
    }
    (staging / _SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_config(staging: Path, library: PreTrainedModel, model: Any) -> None:
    """``config.json`` as ``save_pretrained`` writes it: the class that loads it, the dtype of the weights written."""
    config = copy.deepcopy(library.config)
    config.architectures = [type(library).__name__]
    config.dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())
    config.save_pretrained(staging)
