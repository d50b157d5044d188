"""``python -m zoo export``: a checkpoint of a Hugging Face zoo model written as a Hugging Face directory, at size.

The checkpoint is a file written by ``Trainer.save_checkpoint`` or a sharded checkpoint directory (Lightning's layout,
as ``GPipeStrategy(state_dict_type="sharded")`` writes it). Its weights are never all in memory: the model is built on
the meta device (:func:`zoo.load_pretrained`) and :mod:`zoo.hf.export` reads and writes one group of layers (at most
``--max-shard-size``) at a time::

    python -m zoo export checkpoints/last DIRECTORY [--max-shard-size 5GB]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from zoo.finetune import load_pretrained
from zoo.hf.export import DEFAULT_SHARD_SIZE

__all__ = ["export_checkpoint", "main"]


def export_checkpoint(
    checkpoint: str | Path, directory: str | Path, max_shard_size: int | str = DEFAULT_SHARD_SIZE
) -> Path:
    """Write the Hugging Face model of ``checkpoint`` (a zoo language model's or translator's) to ``directory``,
    holding at most ``max_shard_size`` bytes of weights at a time; returns ``directory``."""
    model = load_pretrained(checkpoint)
    export = getattr(model, "export_pretrained", None)
    if not callable(export):
        raise ValueError(
            f"{str(checkpoint)!r} holds a {model.zoo_name!r} model, which has no Hugging Face format to export to; "
            "export works for checkpoints of zoo.PretrainedCausalLM and zoo.PretrainedTranslator"
        )
    return Path(export(directory, max_shard_size=max_shard_size))


def main(args: Sequence[str] | None = None) -> Path:
    """``python -m zoo export CHECKPOINT DIRECTORY [--max-shard-size SIZE]``."""
    parser = argparse.ArgumentParser(prog="python -m zoo export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a .ckpt file or a sharded checkpoint directory of a zoo model")
    parser.add_argument("directory", help="where to write the Hugging Face directory (replaced if it holds one)")
    parser.add_argument(
        "--max-shard-size",
        default=DEFAULT_SHARD_SIZE,
        type=lambda size: int(size) if size.isdigit() else size,  # bytes, or with a unit: "500MB", "5GB"
        help=f"the largest shard, and the most weight bytes held at once (default {DEFAULT_SHARD_SIZE})",
    )
    options = parser.parse_args(args)
    out = export_checkpoint(options.checkpoint, options.directory, options.max_shard_size)
    print(f"wrote {out}")
    return out
