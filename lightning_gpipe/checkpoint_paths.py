"""Where a checkpoint goes on disk: written beside its target and moved into place, and the paths that are not one.

A save never writes over its target: a file goes to ``.NAME.<pid>.tmp`` and is renamed over it; a directory goes to
``.NAME.partial``, then the previous directory is renamed to ``.NAME.previous``, the new one into place, and the
previous deleted (no single rename replaces a non-empty directory). A crash during a save therefore leaves the previous
checkpoint loadable, and a hidden name is one no checkpoint loader or ``ModelCheckpoint`` picks up. The messages for a
path that holds the other format, or no checkpoint at all, say what is there and what to do.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO

from lightning_gpipe.sharded_checkpoint import is_sharded

__all__ = [
    "format_conflict",
    "is_remote",
    "missing",
    "not_a_checkpoint_directory",
    "read_whole",
    "remove",
    "replace_directory",
    "replacing_file",
    "save_atomically",
    "sibling",
]


def is_remote(filepath: Any) -> bool:
    """Whether ``filepath`` is not a local path (``s3://...``, or an object a checkpoint IO plugin understands)."""
    return not isinstance(filepath, (str, os.PathLike)) or "://" in str(filepath)


def sibling(path: Path, what: str) -> Path:
    """A hidden name beside ``path``: ``.NAME.WHAT``."""
    return path.with_name(f".{path.name}.{what}")


def remove(path: Path) -> None:
    """Delete a file or a directory tree, if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def replace_directory(new: Path, path: Path) -> None:
    """Rename ``new`` to ``path``; an existing ``path`` is moved aside first and deleted after, so between the two
    renames the previous checkpoint is at ``.NAME.previous``."""
    previous = sibling(path, "previous")
    remove(previous)
    if path.exists() or path.is_symlink():
        os.replace(path, previous)
    os.replace(new, path)
    remove(previous)


@contextmanager
def replacing_file(path: Path) -> Iterator[Path]:
    """A temporary file beside ``path`` to write into; it replaces ``path`` when the block ends, or is removed when
    the block raises."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = sibling(path, f"{os.getpid()}.tmp")
    try:
        yield temporary
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    os.replace(temporary, path)


def save_atomically(io: CheckpointIO, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
    """Write ``checkpoint`` with ``io`` beside a local ``filepath``, then rename it there (remote paths: directly)."""
    if is_remote(filepath):
        io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        return
    with replacing_file(Path(filepath)) as temporary:
        io.save_checkpoint(checkpoint, temporary, storage_options=storage_options)


def format_conflict(path: Path, sharded: bool) -> str | None:
    """Why ``path`` cannot take a checkpoint of this format (``sharded``: a directory) without overwriting something
    else, or ``None``."""
    if sharded and path.is_file():
        return (
            f"{path} is a file (a full checkpoint?), and state_dict_type='sharded' writes a directory there: "
            "choose another path or remove the file, or save with state_dict_type='full'. Nothing was written."
        )
    if not sharded and path.is_dir():
        what = "a sharded checkpoint" if is_sharded(path) else "a directory"
        return (
            f"{path} is {what}, and state_dict_type='full' writes one file there: choose another path (a file "
            "name, e.g. ending in .ckpt) or remove the directory, or save with state_dict_type='sharded'. "
            "Nothing was written."
        )
    if sharded and path.is_dir() and not is_sharded(path) and any(path.iterdir()):
        return (
            f"{path} is a directory that is not a sharded checkpoint, and state_dict_type='sharded' would replace "
            "it: choose another path (a name of its own, e.g. ending in .ckpt). Nothing was written."
        )
    return None


def read_whole(path: Path) -> Any:
    """``torch.load(path, weights_only=True)``, or a ``ValueError`` that says what the file may be instead."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as error:
        raise ValueError(
            f"{path} is not a checkpoint file torch.load reads ({error}): pass another, or a sharded one's "
            f"directory, {path.parent}"
        ) from error


def not_a_checkpoint_directory(path: Path) -> str:
    """The message for a directory given as a checkpoint that is not a sharded one."""
    files = sorted(p.name for p in path.iterdir() if p.is_file() and p.suffix == ".ckpt")[:3]
    inside = f" (it holds {', '.join(files)}: pass one of those files)" if files else ""
    return (
        f"{path} is a directory but not a sharded checkpoint: it has no torch.distributed.checkpoint index "
        f"(.metadata){inside}. Pass a checkpoint file, or a directory that trainer.save_checkpoint wrote with "
        "GPipeStrategy(state_dict_type='sharded')."
    )


def missing(path: Path) -> str:
    """The message for a checkpoint path that does not exist (perhaps left beside it by an interrupted save)."""
    previous = sibling(path, "previous")
    if previous.exists():
        return (
            f"{path} does not exist, but {previous} does: a save was interrupted between moving the previous "
            f"checkpoint aside and renaming the new one into place. Rename {previous.name} back to {path.name}."
        )
    return f"{path} does not exist: pass the path of a checkpoint file or of a sharded checkpoint directory"
