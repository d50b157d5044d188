"""A checkpoint's backbone loaded into a model of the same architecture, its task heads left fresh.

Checkpoints are read with ``weights_only=True``: a file whose unpickling would run code is refused.
:func:`zoo.load_pretrained` builds on this for every source; a model's ``pretrained`` argument uses it directly.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from zoo.tasks.base import ZooModule

__all__ = ["LoadReport", "load_backbone", "read_checkpoint"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What :func:`load_backbone` did: state-dict keys loaded from the checkpoint, and those it left fresh."""

    loaded: tuple[str, ...]
    fresh: tuple[str, ...]  # the heads' keys: newly initialized
    skipped: tuple[str, ...]  # the checkpoint's head keys, not used

    def summary(self) -> str:
        """One line for logs: how many tensors were loaded, which heads are new, what was skipped."""
        return (
            f"loaded {len(self.loaded)} backbone tensors; new heads: {', '.join(self.fresh) or 'none'}; "
            f"skipped from the checkpoint: {', '.join(self.skipped) or 'none'}"
        )


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint at ``path``, read with ``weights_only=True`` onto the CPU; it must come from a zoo model."""
    path = Path(path)
    if (path / ".metadata").is_file() and (path / "meta.pt").is_file():  # by file names: the zoo imports no library
        raise ValueError(
            f"{str(path)!r} is a sharded checkpoint directory (GPipeStrategy(state_dict_type='sharded')), and "
            "load_pretrained reads one file: make it one with `python -m "
            f"lightning.pytorch.utilities.consolidate_checkpoint {path} --output_file model.ckpt` and pass that file"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"no checkpoint at {str(path)!r}: pass the path of a file written by Trainer.save_checkpoint"
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # the unpickler's refusal comes in several exception types
        raise ValueError(
            f"refusing to load {str(path)!r}: it is not a checkpoint that loads with weights_only=True ({error}). "
            "Zoo checkpoints hold tensors and plain values only; never load an untrusted file with weights_only=False."
        ) from error
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ValueError(f"{str(path)!r} is not a Lightning checkpoint: it has no 'state_dict'")
    if not checkpoint.get("zoo_model"):
        raise ValueError(
            f"{str(path)!r} was not written by a zoo model (no 'zoo_model' entry): load_pretrained needs a checkpoint "
            "of a model created with zoo.create_model or a zoo model class"
        )
    return checkpoint


def load_backbone(model: ZooModule, checkpoint: str | Path | Mapping[str, Any]) -> LoadReport:
    """Copy every backbone weight of ``checkpoint`` into ``model``; the heads (``model.head_prefixes()``) stay fresh.

    Raises ``ValueError``, leaving ``model`` untouched, when the checkpoint is of another architecture: another
    registry name, or backbone keys or shapes that differ from ``model``'s.
    """
    if not isinstance(checkpoint, Mapping):
        checkpoint = read_checkpoint(checkpoint)
    saved_name = checkpoint.get("zoo_model")
    if saved_name != model.zoo_name:
        raise ValueError(
            f"the checkpoint holds a {saved_name!r} model, not {model.zoo_name!r}: load it with "
            f"zoo.load_pretrained(path, ...), which rebuilds the checkpoint's own architecture"
        )

    saved: Mapping[str, torch.Tensor] = checkpoint["state_dict"]
    own = model.state_dict()
    backbone = [key for key in own if not model.is_head(key)]
    missing = [key for key in backbone if key not in saved]
    unexpected = [key for key in saved if key not in own and not model.is_head(key)]
    mismatched = [
        f"{key} {tuple(saved[key].shape)} vs {tuple(own[key].shape)}"
        for key in backbone
        if key in saved and saved[key].shape != own[key].shape
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
    with torch.no_grad():
        for key in backbone:
            own[key].copy_(saved[key])
    report = LoadReport(
        loaded=tuple(backbone),
        fresh=tuple(key for key in own if model.is_head(key)),
        skipped=tuple(key for key in saved if model.is_head(key)),
    )
    log.info("%s", report.summary())
    return report
