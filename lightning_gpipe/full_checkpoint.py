"""Full checkpoints: one ``torch.save`` file of the whole model, written by one rank as each stage's tensors arrive.

The writing rank (global rank 0, the first pipeline's last stage) receives from every other stage of its pipeline only
the shapes and dtypes of its tensors first, builds the whole checkpoint with placeholders for them (state dicts merged,
optimizer state keyed by name: :mod:`lightning_gpipe.partition.state_dict`) and writes the file's layout
(:func:`~lightning_gpipe.torch_file.write_layout`). Then each stage sends its tensors in buckets
(:func:`~lightning_gpipe.engine.collectives.send_tensors`), which go straight into their place in the file: the writer
holds its own stage and one bucket, never the whole model, and nothing is pickled. The result is the file a plain
``torch.save`` of the whole checkpoint would be, loadable by ``torch.load`` anywhere.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_gpipe.engine.collectives import TensorSpec
from lightning_gpipe.engine.tree import flatten, map_tensors, unflatten
from lightning_gpipe.partition.state_dict import ModelNames, merge_optimizer_states, merge_state_dicts
from lightning_gpipe.torch_file import TensorFile, placeholder, tensor_leaves, write_layout

__all__ = ["Receive", "WholeCheckpoint", "stage_part", "stage_specs"]

Receive = Callable[[int, Sequence[TensorSpec]], Iterable[tuple[int, Tensor]]]
"""``receive(process, specs)``: the tensors of ``specs`` that process ``process`` of the pipeline sends, by index."""


def stage_part(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a checkpoint that a stage holds alone: its state dict and its optimizers' state."""
    return {"state_dict": checkpoint["state_dict"], "optimizer_states": checkpoint.get("optimizer_states", [])}


def stage_specs(checkpoint: Mapping[str, Any]) -> Any:
    """:func:`stage_part` with each tensor replaced by its :class:`TensorSpec`: what the writing rank needs first."""
    return map_tensors(TensorSpec.of, stage_part(checkpoint))


def _is_spec(value: Any) -> bool:
    return isinstance(value, TensorSpec)


class WholeCheckpoint:
    """The whole model's checkpoint on the writing rank: the rest of ``checkpoint`` and its own stage's tensors as they
    are, the other stages' as placeholders until they arrive.

    Args:
        checkpoint: this rank's checkpoint (Lightning's, with this stage's part).
        parts: per process of the pipeline, its :func:`stage_specs` (the entry at ``own`` is not read).
        own: this rank's position in the pipeline.
        names: the whole model's names, which order the merged state.
    """

    def __init__(self, checkpoint: Mapping[str, Any], parts: Sequence[Any], own: int, names: ModelNames) -> None:
        self.placeholders: dict[int, list[Tensor]] = {}  # per other process, in the order it sends its tensors
        if len(parts) == 1:  # one process holds every stage: its checkpoint is the whole one, as it is
            self.value = _replace_tensors(dict(checkpoint), _contiguous)
            return
        stages = []
        for process, part in enumerate(parts):
            if process == own:
                stages.append(_replace_tensors(stage_part(checkpoint), _contiguous))
                continue
            leaves, structure = flatten(part, is_leaf=_is_spec)
            values = [placeholder(leaf) if _is_spec(leaf) else leaf for leaf in leaves]
            self.placeholders[process] = [value for value, leaf in zip(values, leaves, strict=True) if _is_spec(leaf)]
            stages.append(unflatten(values, structure))
        optimizers = len(stages[0]["optimizer_states"])
        part = ("state_dict", "optimizer_states")
        rest = {key: _replace_tensors(value, _contiguous) for key, value in checkpoint.items() if key not in part}
        self.value = {
            **rest,
            "state_dict": merge_state_dicts([stage["state_dict"] for stage in stages], names.keys),
        }
        if "optimizer_states" in checkpoint:
            self.value["optimizer_states"] = [
                merge_optimizer_states([stage["optimizer_states"][i] for stage in stages], names.parameter_order)
                for i in range(optimizers)
            ]

    def write(self, path: Path, receive: Receive) -> None:
        """Write the file at ``path``: its layout, this rank's tensors, then each other process's as they arrive."""
        waiting = {id(value) for values in self.placeholders.values() for value in values}
        write_layout(self.value, path)
        with TensorFile(path, writable=True) as file:
            places: dict[int, list[Tensor]] = {}  # a placeholder's places in the file (a tied tensor's state: one)
            for leaf, mapped in zip(tensor_leaves(self.value), tensor_leaves(file.value), strict=True):
                if id(leaf) in waiting:
                    places.setdefault(id(leaf), []).append(mapped)
                else:
                    file.write(mapped, leaf)
            for process, values in self.placeholders.items():
                specs = [TensorSpec.of(value) for value in values]
                for index, tensor in receive(process, specs):
                    for mapped in places.get(id(values[index]), []):
                        file.write(mapped, tensor)
            file.close(sync=True)

    def materialize(self, receive: Receive) -> dict[str, Any]:
        """The whole checkpoint in memory, each placeholder replaced by the tensor received for it (for a checkpoint
        IO plugin, which takes a value to save rather than a place to write)."""
        received: dict[int, Tensor] = {}
        for process, values in self.placeholders.items():
            specs = [TensorSpec.of(value) for value in values]
            for index, tensor in receive(process, specs):
                received[id(values[index])] = tensor.clone()
        return _replace_tensors(self.value, lambda tensor: received.get(id(tensor), tensor))


def _replace_tensors(value: Any, function: Callable[[Tensor], Tensor]) -> Any:
    """``value`` with ``function`` of each tensor, the containers' types kept: a checkpoint holds any a user's hook or
    hyper-parameters put there (a ``defaultdict`` keeps its factory, which a rebuild from items would lose)."""
    if isinstance(value, Tensor):
        return function(value)
    if isinstance(value, dict):
        copied = copy.copy(value)
        for key, item in copied.items():
            copied[key] = _replace_tensors(item, function)
        return copied
    if type(value) in (list, tuple):
        return type(value)(_replace_tensors(item, function) for item in value)
    return value


def _contiguous(tensor: Tensor) -> Tensor:
    """A tensor whose bytes are its storage's, as the file's layout places them (a view is saved whole otherwise)."""
    whole = tensor.is_contiguous() and tensor.storage_offset() == 0
    if whole and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor.detach()
    return tensor.detach().clone(memory_format=torch.contiguous_format)
