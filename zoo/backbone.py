"""A checkpoint's backbone loaded into a model of the same architecture, its task heads left fresh.

A checkpoint is a file written by ``Trainer.save_checkpoint`` or a sharded checkpoint directory in Lightning's layout
(``torch.distributed.checkpoint`` tensors under ``model.<key>``, the rest in ``meta.pt``). Files are read with
``weights_only=True`` (a file whose unpickling would run code is refused) and memory-mapped: :func:`load_backbone`
checks a checkpoint's names and shapes against the model and leaves the backbone's tensors to be read on first use,
or per pipeline stage (:mod:`zoo.deferred`). :func:`zoo.load_pretrained` builds on this for every source; a model's
``pretrained`` argument uses it directly.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zoo.tasks.base import ZooModule
from zoo.weights import (
    LIGHTNING_METADATA,
    CheckpointReader,
    DistributedCheckpoint,
    TensorFiles,
    TorchFile,
    is_distributed_checkpoint,
    load_torch_file,
)

__all__ = ["LoadReport", "load_backbone", "read_checkpoint"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What :func:`load_backbone` did: state-dict keys loaded from the checkpoint, and those it left fresh."""

    loaded: tuple[str, ...]
    fresh: tuple[str, ...]  # the heads' keys: newly initialized
    skipped: tuple[str, ...]  # the checkpoint's head keys, not used
    source: str = ""  # where the loaded tensors are read from

    def summary(self) -> str:
        """One line for logs: how many tensors are loaded, from where and when, which heads are new, what was
        skipped."""
        source = f" from {self.source!r}, read on first use (or per stage under GPipeStrategy)" if self.source else ""
        return (
            f"loaded {len(self.loaded)} backbone tensors{source}; new heads: {', '.join(self.fresh) or 'none'}; "
            f"skipped from the checkpoint: {', '.join(self.skipped) or 'none'}"
        )


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint at ``path`` with ``weights_only=True``, from a zoo model: a file memory-mapped (its tensors are
    read only when used), or a sharded checkpoint directory's ``meta.pt`` (everything but the tensors)."""
    path = Path(path)
    sharded = is_distributed_checkpoint(path)
    if not (path.is_file() or sharded):
        raise FileNotFoundError(
            f"no checkpoint at {str(path)!r}: pass a file written by Trainer.save_checkpoint, or a sharded "
            f"checkpoint directory (with {LIGHTNING_METADATA} and torch.distributed.checkpoint's .metadata)"
        )
    file = path / LIGHTNING_METADATA if sharded else path
    try:
        checkpoint = load_torch_file(file)
    except Exception as error:  # the unpickler's refusal comes in several exception types
        raise ValueError(
            f"refusing to load {str(file)!r}: it is not a checkpoint that loads with weights_only=True ({error}). "
            "Zoo checkpoints hold tensors and plain values only; never load an untrusted file with weights_only=False."
        ) from error
    if not isinstance(checkpoint, dict) or not (sharded or "state_dict" in checkpoint):
        raise ValueError(f"{str(path)!r} is not a Lightning checkpoint: it has no 'state_dict'")
    if not checkpoint.get("zoo_model"):
        raise ValueError(
            f"{str(path)!r} was not written by a zoo model (no 'zoo_model' entry): load_pretrained needs a checkpoint "
            "of a model created with zoo.create_model or a zoo model class"
        )
    return checkpoint


def _checkpoint_tensors(path: str | Path, content: Mapping[str, Any]) -> TensorFiles:
    """The state dict's tensors of the checkpoint at ``path`` (a file's ``state_dict``, a directory's ``model.*``);
    ``content``: what :func:`read_checkpoint` read of it."""
    if is_distributed_checkpoint(path):
        return DistributedCheckpoint(path)
    return TorchFile(path, "state_dict", loaded=content)


def load_backbone(
    model: ZooModule, checkpoint: str | Path | Mapping[str, Any], content: Mapping[str, Any] | None = None
) -> LoadReport:
    """Load every backbone tensor of ``checkpoint`` into ``model``; the heads (``model.head_prefixes()``) stay fresh.

    A checkpoint given by its path (a file or a sharded directory) is checked, then left to be read on first use or
    per pipeline stage: the backbone's tensors move to the meta device (if they are not there) and wait in a reader
    (:meth:`~zoo.deferred.DeferredWeights.defer_weights`). A checkpoint already in memory is copied at once. Raises
    ``ValueError``, leaving ``model`` untouched, when the checkpoint is of another architecture: another registry
    name, or backbone keys or shapes that differ from ``model``'s. ``content``: what :func:`read_checkpoint` read of the
    checkpoint at that path already.
    """
    path = None if isinstance(checkpoint, Mapping) else checkpoint
    if content is None:
        content = checkpoint if isinstance(checkpoint, Mapping) else read_checkpoint(checkpoint)
    saved_name = content.get("zoo_model")
    if saved_name != model.zoo_name:
        raise ValueError(
            f"the checkpoint holds a {saved_name!r} model, not {model.zoo_name!r}: load it with "
            f"zoo.load_pretrained(path, ...), which rebuilds the checkpoint's own architecture"
        )
    stored: Mapping[str, Any]
    if path is not None:
        files = _checkpoint_tensors(path, content)
        stored = files.entries
    else:
        stored = {key: value for key, value in content["state_dict"].items() if isinstance(value, torch.Tensor)}
    own = nn.Module.state_dict(model, keep_vars=True)
    backbone = [key for key in own if not model.is_head(key)]
    _check_fits(model, own, backbone, stored)
    report = LoadReport(
        loaded=tuple(backbone),
        fresh=tuple(key for key in own if model.is_head(key)),
        skipped=tuple(key for key in stored if model.is_head(key)),
        source="" if path is None else str(path),
    )
    if path is None:
        with torch.no_grad():
            for key in backbone:
                own[key].copy_(stored[key])
    else:
        model.defer_weights(CheckpointReader(files, {key: key for key in backbone}))
    log.info("%s", report.summary())
    return report


def _check_fits(model: ZooModule, own: Mapping[str, Any], backbone: list[str], stored: Mapping[str, Any]) -> None:
    missing = [key for key in backbone if key not in stored]
    unexpected = [key for key in stored if key not in own and not model.is_head(key)]
    mismatched = [
        f"{key} {tuple(stored[key].shape)} vs {tuple(own[key].shape)}"
        for key in backbone
        if key in stored and tuple(stored[key].shape) != tuple(own[key].shape)
    ]
    if missing or unexpected or mismatched:
        details = "; ".join(
            f"{label}: {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}"
            for label, keys in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("shape (checkpoint vs model)", mismatched),
            )
            if keys
        )
        raise ValueError(
            f"the checkpoint's backbone does not fit this {model.zoo_name!r} model ({details}); it was written with "
            f"other architecture arguments: use zoo.load_pretrained(path, num_classes=...), which rebuilds the model "
            f"from the checkpoint's own hyper-parameters"
        )
