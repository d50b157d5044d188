"""Sharded checkpoints: a ``torch.distributed.checkpoint`` directory in Lightning's layout, each rank its own stage.

The layout is Lightning's ``FSDPStrategy(state_dict_type="sharded")``: ``torch.distributed.checkpoint`` (DCP) files
(``__<rank>_0.distcp`` and ``.metadata``) holding ``{"model": ..., "optimizer_0": ..., ...}``, and ``meta.pt``, written
by global rank 0, with the rest of Lightning's checkpoint (loops, callbacks, schedulers, hyper-parameters). So
``python -m lightning.pytorch.utilities.consolidate_checkpoint DIR`` turns it into one file that the plain module and
plain Lightning load.

Every rank writes only its own stage: its state dict and its optimizers' state, keyed by the whole model's names
(:mod:`lightning_gpipe.partition.state_dict`). A tensor that several ranks hold (a data-parallel replica's, a tied
copy) is written once: DCP keeps one rank's entry per key. A stage sharded over its replicas (``data_parallel="fsdp"``)
holds its tensors as ``DTensor`` shards, which DCP writes as they are: each replica its own rows, nothing gathered,
the index recording each whole tensor's size and where each replica's rows lie in it. DCP also keeps one rank's copy
of each value that is not a tensor, so those must be alike on every rank: each parameter group lists the whole
model's parameter names, gathered over the pipeline. An optimizer without any tensor state (plain SGD, or Adam before
its first step) leaves DCP nothing to write; it goes whole into ``meta.pt``, where the consolidation tool finds it too.

Reading, each rank asks DCP for its own keys only (the targets sized from the directory's metadata: an optimizer's
state may not exist yet), whatever K, replica count, schedule or ``data_parallel`` wrote the directory; a sharded
target (a sharded parameter, and its optimizer state shaped alike) gets only this rank's rows. DCP reads non-tensor
values with ``pickle``; each is first checked to load with ``weights_only=True``, so a value whose unpickling would run
code is refused (the directory's ``.metadata`` index is a pickle that DCP reads as is: load directories you trust).
"""

from __future__ import annotations

import io
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from lightning_gpipe.engine.sharding import sharded_target

__all__ = ["META_FILE", "ShardedDirectory", "is_sharded", "optimizer_indices", "optimizer_key", "write_sharded"]

META_FILE = "meta.pt"
"""The file of everything but the model and optimizers (Lightning's ``_METADATA_FILENAME``)."""
_INDEX_FILE = ".metadata"  # DCP's index of the directory


def optimizer_key(index: int) -> str:
    """The entry of the ``index``-th optimizer, as Lightning names it."""
    return f"optimizer_{index}"


def optimizer_indices(keys: Iterable[Any]) -> set[int]:
    """The optimizers that entries named ``keys`` hold the state of (``optimizer_0`` is the first)."""
    return {int(str(key)[len("optimizer_") :]) for key in keys if re.fullmatch(r"optimizer_\d+", str(key))}


def is_sharded(path: Path) -> bool:
    """Whether ``path`` is a directory written by DCP (its index file is there)."""
    return path.is_dir() and (path / _INDEX_FILE).is_file()


def write_sharded(
    state: dict[str, Any], rest: dict[str, Any] | None, directory: Path, group: dist.ProcessGroup | None
) -> None:
    """Write this rank's ``state`` (``{"model": ..., "optimizer_0": ...}``) into ``directory`` with DCP, a collective
    over ``group`` (every rank of the job); then ``rest`` into ``meta.pt`` where it is given (global rank 0 only)."""
    dcp.save(state, storage_writer=FileSystemWriter(directory), process_group=group)
    if rest is not None:
        torch.save(rest, directory / META_FILE)


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's reading, with every value that is not a tensor checked to load with ``weights_only=True`` first."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        torch.load(value, weights_only=True)  # raises on a value whose unpickling would run code
        value.seek(0)
        super().load_bytes(read_item, value)


class ShardedDirectory:
    """A sharded checkpoint directory as read from its index, before any tensor: what it holds, of which shapes.

    Raises:
        ValueError: ``directory`` misses ``meta.pt``, or misses (or has a truncated copy of) one of the files its
            index names.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        if not (directory / META_FILE).is_file():
            raise ValueError(
                f"{directory} holds a torch.distributed.checkpoint index but no {META_FILE}: resume from another "
                "checkpoint"
            )
        self.metadata: Metadata = FileSystemReader(directory).read_metadata()
        self._check_files()
        self.paths: dict[tuple[Any, ...], str] = {path: fqn for fqn, path in self.metadata.planner_data.items()}

    def _check_files(self) -> None:
        ends: dict[str, int] = {}
        for info in self.metadata.storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        for name, end in sorted(ends.items()):
            file = self.directory / name
            size = file.stat().st_size if file.is_file() else None
            if size is None or size < end:
                what = "is missing" if size is None else f"is truncated ({size} of at least {end} bytes)"
                raise ValueError(
                    f"{file} {what}: this sharded checkpoint is incomplete; copy the whole directory again, or "
                    "resume another"
                )

    def model_shapes(self) -> dict[str, torch.Tensor]:
        """The model's state dict as meta tensors of the saved shapes and dtypes (nothing read)."""
        return {
            path[1]: _meta_tensor(self.metadata.state_dict_metadata[fqn])
            for path, fqn in self.paths.items()
            if len(path) == 2 and path[0] == "model"
        }

    def optimizers(self) -> set[int]:
        """The indices of the optimizers whose state the directory's shards hold."""
        return optimizer_indices(path[0] for path in self.paths)

    def param_groups(self, indices: Collection[int], group: dist.ProcessGroup | None) -> dict[int, list[Any]]:
        """The parameter groups of the optimizers ``indices`` whose state the shards hold (a few names and numbers,
        read before anything else to check them); a collective over ``group``."""
        target: dict[str, Any] = {}
        for path, fqn in self.paths.items():
            if _optimizer_of(path) in indices and path[1] == "param_groups":
                _place(target, path, _empty(self.metadata.state_dict_metadata[fqn]))
        reader = FileSystemReader(self.directory)
        dcp.load(target, storage_reader=reader, planner=_WeightsOnlyPlanner(), process_group=group)
        return {int(key[len("optimizer_") :]): value["param_groups"] for key, value in target.items()}

    def read(
        self,
        model: Mapping[str, torch.Tensor],
        parameters: Sequence[Mapping[str, torch.Tensor]],
        group: dist.ProcessGroup | None,
    ) -> dict[str, Any]:
        """This rank's part, a collective over ``group`` (every rank of the job): the model's entries read straight
        into the tensors of ``model`` (this stage's state dict), and the state of optimizer ``i``'s parameters
        (``parameters[i]``, by the names their state is saved under) with its parameter groups: on the CPU, or sharded
        as a sharded parameter is for tensors of its shape. Returns ``{"model": ..., "optimizer_0": ...}``."""
        target: dict[str, Any] = {"model": {}}
        for path, fqn in self.paths.items():
            entry = self.metadata.state_dict_metadata[fqn]
            index = _optimizer_of(path)
            if index is None:  # the model's, or something else beside it
                if path[0] == "model" and path[1] in model:
                    target["model"][path[1]] = model[path[1]]
                continue
            if index >= len(parameters) or (path[1] == "state" and len(path) > 2 and path[2] not in parameters[index]):
                continue
            like = parameters[index].get(path[2]) if path[1] == "state" and len(path) > 3 else None
            _place(target, path, _empty(entry, like))
        reader = FileSystemReader(self.directory)
        dcp.load(target, storage_reader=reader, planner=_WeightsOnlyPlanner(), process_group=group)
        return target


def _optimizer_of(path: tuple[Any, ...]) -> int | None:
    """The index of the optimizer whose state an entry at ``path`` holds, ``None`` for the model's."""
    found = optimizer_indices(path[:1])
    return found.pop() if found else None


def _meta_tensor(entry: Any) -> torch.Tensor:
    return torch.empty(tuple(entry.size), dtype=entry.properties.dtype, device="meta")


def _empty(entry: Any, like: torch.Tensor | None = None) -> Any:
    """A target DCP reads an entry into: a CPU tensor of its size (this rank's rows only, sharded as ``like`` is, when
    ``like`` is a sharded tensor of that size), or a placeholder for a value that is not one."""
    if not isinstance(entry, TensorStorageMetadata):
        return None
    size, dtype = tuple(entry.size), entry.properties.dtype
    shard = sharded_target(size, dtype, like) if like is not None else None
    return shard if shard is not None else torch.empty(size, dtype=dtype)


def _place(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """Set ``value`` at ``path`` in ``root``, making dicts for names and lists for indices on the way."""
    container: Any = root
    for key, following in zip(path[:-1], path[1:], strict=True):
        fresh: Any = [] if isinstance(following, int) else {}
        if isinstance(container, list):
            while len(container) <= key:
                container.append(None)
            if container[key] is None:
                container[key] = fresh
        else:
            container.setdefault(key, fresh)
        container = container[key]
    last = path[-1]
    if isinstance(container, list):
        while len(container) <= last:
            container.append(None)
    container[last] = value
