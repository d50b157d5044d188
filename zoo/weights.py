"""Checkpoint readers: a model's named tensors read from files on demand, any subset, without reading the rest.

A :class:`CheckpointReader` maps a model's state-dict keys to tensors stored in files (:class:`TensorFiles`):
safetensors files (one, or the shards a ``*.safetensors.index.json`` lists; memory-mapped), a torch file (a
Lightning ``.ckpt``, a ``.pth`` or ``.bin``; memory-mapped) or a ``torch.distributed.checkpoint`` directory
(Lightning's sharded layout: tensors under ``model.<key>``, the rest in ``meta.pt``). It copies any subset of them into
tensors its caller allocated, converting each to their dtype as it is copied, so a bfloat16 checkpoint read into
float32 parameters never holds a second copy of the model. It is the reader a zoo model built on the meta device
hands to ``GPipeStrategy`` (``claim_weights_reader``): each process then reads its own stage's tensors only.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "CheckpointReader",
    "DistributedCheckpoint",
    "SafetensorsFiles",
    "StoredTensor",
    "TensorFiles",
    "TorchFile",
    "is_distributed_checkpoint",
    "load_torch_file",
]

DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's own file in every checkpoint directory
LIGHTNING_METADATA = "meta.pt"  # what Lightning keeps beside a sharded checkpoint's tensors (hyper-parameters, loops)
MODEL_PREFIX = "model."  # a sharded Lightning checkpoint holds the state dict as DCP's "model" entry

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """What the files say of one tensor, before it is read."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class TensorFiles:
    """Tensors stored in files, by their stored names: what each is, and any subset copied into given tensors."""

    path: Path
    entries: dict[str, StoredTensor]

    def read_into(self, targets: Mapping[str, Tensor]) -> None:
        """Copy each stored tensor named by ``targets`` into its target (same shape; any dtype and device)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, {len(self.entries)} tensors)"


class SafetensorsFiles(TensorFiles):
    """``model.safetensors``, or the shards ``model.safetensors.index.json`` names (its ``weight_map``)."""

    def __init__(self, path: str | Path, files: Iterable[str | Path] | None = None) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        self.files: dict[str, Path] = {}  # stored name -> its file
        self.entries = {}
        paths = [Path(file) for file in files] if files is not None else _safetensors_shards(self.path)
        for file in paths:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not a mapping)
                    stored = handle.get_slice(name)
                    self.files[name] = file
                    self.entries[name] = StoredTensor(
                        tuple(stored.get_shape()), _SAFETENSORS_DTYPES[stored.get_dtype()]
                    )

    def read_into(self, targets: Mapping[str, Tensor]) -> None:
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for name in targets:
            by_file.setdefault(self.files[name], []).append(name)
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt") as handle:  # memory-mapped: only these tensors' pages are read
                for name in names:
                    _copy(targets[name], handle.get_tensor(name), name, file)


def _safetensors_shards(path: Path) -> list[Path]:
    if path.suffix == ".json":  # an index: {"weight_map": {name: shard file}}
        weight_map = json.loads(path.read_text(encoding="utf-8"))["weight_map"]
        return [path.parent / file for file in dict.fromkeys(weight_map.values())]
    return [path]


class TorchFile(TensorFiles):
    """Files written by ``torch.save``: a state dict each (the shards of ``pytorch_model.bin.index.json``), or one
    checkpoint holding it under ``entry`` (``"state_dict"`` in a Lightning ``.ckpt``). Memory-mapped, so reading some
    tensors leaves the others (and an optimizer's state) unread; a file in torch's legacy format, which cannot be
    mapped, is read whole at each read."""

    def __init__(
        self,
        path: str | Path,
        entry: str | None = None,
        files: Iterable[str | Path] | None = None,
        loaded: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = Path(path)
        self.entry = entry
        self.files: dict[str, Path] = {}
        self.entries = {}
        for file in [Path(file) for file in files] if files is not None else [self.path]:
            state = self._state(file, loaded if file == self.path else None)  # `loaded`: ``path`` read already
            for name, value in state.items():
                if isinstance(value, Tensor):
                    self.files[name] = file
                    self.entries[name] = StoredTensor(tuple(value.shape), value.dtype)

    def _state(self, file: Path, loaded: Any = None) -> Mapping[str, Any]:
        loaded = load_torch_file(file) if loaded is None else loaded
        state = loaded[self.entry] if self.entry is not None and isinstance(loaded, Mapping) else loaded
        if not isinstance(state, Mapping):
            raise ValueError(f"{str(file)!r} holds no state dict{f' under {self.entry!r}' if self.entry else ''}")
        return state

    def read_into(self, targets: Mapping[str, Tensor]) -> None:
        by_file: dict[Path, list[str]] = {}
        for name in targets:
            by_file.setdefault(self.files[name], []).append(name)
        for file, names in by_file.items():
            state = self._state(file)
            for name in names:
                _copy(targets[name], state[name], name, file)


def load_torch_file(path: str | Path) -> Any:
    """``torch.load`` with ``weights_only=True`` onto the CPU, memory-mapped when the file's format allows it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as error:
        if "mmap" not in str(error):  # only torch's legacy (non-zip) format cannot be mapped
            raise
        return torch.load(path, map_location="cpu", weights_only=True)


def is_distributed_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a ``torch.distributed.checkpoint`` directory (a sharded Lightning checkpoint)."""
    return Path(path).is_dir() and (Path(path) / DCP_METADATA).is_file()


class DistributedCheckpoint(TensorFiles):
    """A ``torch.distributed.checkpoint`` directory's tensors under ``prefix`` (Lightning's sharded checkpoints hold
    the state dict as ``model.<key>``), by their names without it. Each read loads only the requested tensors, in
    this process alone (no collective), whatever the world size that wrote them."""

    def __init__(self, path: str | Path, prefix: str = MODEL_PREFIX) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = Path(path)
        self.prefix = prefix
        metadata = FileSystemReader(str(self.path)).read_metadata()
        self.entries = {
            name[len(prefix) :]: StoredTensor(tuple(item.size), item.properties.dtype)
            for name, item in metadata.state_dict_metadata.items()
            if name.startswith(prefix) and isinstance(item, TensorStorageMetadata)
        }

    def read_into(self, targets: Mapping[str, Tensor]) -> None:
        import torch.distributed.checkpoint as dcp

        for name, target in targets.items():  # DCP would raise its own exception, for every rank, without the fix
            if self.entries[name].shape != tuple(target.shape):
                _copy(target, torch.empty(self.entries[name].shape, device="meta"), name, self.path)
        wanted = {f"{self.prefix}{name}": target for name, target in targets.items()}
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(wanted, storage_reader=dcp.FileSystemReader(str(self.path)), no_dist=True)


def _copy(target: Tensor, stored: Tensor, name: str, file: Path) -> None:
    if tuple(stored.shape) != tuple(target.shape):
        raise ValueError(
            f"{name!r} in {str(file)!r} has shape {tuple(stored.shape)}, the model {tuple(target.shape)}: the file "
            "holds another model's weights"
        )
    target.copy_(stored)


class CheckpointReader:
    """A model's state-dict keys read from :class:`TensorFiles`: the ``names`` map each key to its stored name.

    It has the two methods of the weights reader protocol (``lightning_gpipe.partition.reader.WeightsReader``):
    :meth:`keys` and :meth:`read_into`. Several keys may name one stored tensor (tied weights).
    """

    def __init__(self, files: TensorFiles, names: Mapping[str, str]) -> None:
        unknown = [stored for stored in names.values() if stored not in files.entries]
        assert not unknown, f"{unknown[:3]} are not in {files}"
        self.files = files
        self.names = dict(names)

    @property
    def source(self) -> str:
        """Where the tensors are read from."""
        return str(self.files.path)

    def keys(self) -> Collection[str]:
        """The model's state-dict keys this reader provides."""
        return self.names.keys()

    def stored(self, key: str) -> StoredTensor:
        """The shape and dtype the files hold for ``key``."""
        return self.files.entries[self.names[key]]

    def check_shapes(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Refuse, naming the keys, a checkpoint whose tensors do not have the model's ``shapes`` (before any read)."""
        wrong = [
            f"{key} {self.stored(key).shape} vs {tuple(shapes[key])}"
            for key in self.names
            if key in shapes and self.stored(key).shape != tuple(shapes[key])
        ]
        if wrong:
            raise ValueError(
                f"{self.source!r} does not fit the model: shapes (checkpoint vs model) {'; '.join(wrong[:4])}"
                f"{' ...' if len(wrong) > 4 else ''}. It holds another architecture's weights"
            )

    def read_into(self, tensors: Mapping[str, Tensor]) -> None:
        """Copy each key's stored tensor into ``tensors[key]``, converted to its dtype and device."""
        by_stored: dict[str, list[Tensor]] = {}
        for key, tensor in tensors.items():
            by_stored.setdefault(self.names[key], []).append(tensor)
        firsts = {stored: targets[0] for stored, targets in by_stored.items()}
        self.files.read_into(firsts)
        for targets in by_stored.values():  # a tied tensor read once, copied to its other names
            for other in targets[1:]:
                if other.data_ptr() != targets[0].data_ptr():
                    other.copy_(targets[0])

    def __repr__(self) -> str:
        return f"CheckpointReader({len(self.names)} tensors of {self.files})"
