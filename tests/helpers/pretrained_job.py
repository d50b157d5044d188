"""Every kind of pretrained source of the zoo loaded with ``zoo.load_pretrained`` and trained as a K = 2 pipeline.

``python -m helpers.jobs helpers.pretrained_job ROOT CASE...``, one process per rank; the sources were written under
``ROOT/sources`` by :func:`write_sources`. For each case of :data:`CASES`: seed, load (reading nothing), then under
``GPipeStrategy(pipe_size=2)`` record at the start of training what this rank's stage starts from
(``ROOT/CASE-start-RANK.pt``) and the keys it read (``ROOT/CASE-read-RANK.json``), train :data:`STEPS` steps, export
from the stages at the end of training where the case asks for it (``ROOT/CASE-export``, every rank taking part), and
save a checkpoint (``ROOT/CASE.ckpt``, a collective). :func:`fit` trains the same way under any strategy, for the
plain runs the test compares with.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from benchmarks.trainer import quiet_trainer
from helpers.load_job import _recording_reads
from helpers.zoo_job import Repeated
from helpers.zoo_tiny import tiny_batch, tiny_model

__all__ = ["CASES", "STEPS", "Case", "fit", "load", "main", "write_sources"]

STEPS = 2
TEXTS = ["the cat sat on the mat.", "a dog runs in the park.", "hello world, this is a small test."]


@dataclasses.dataclass(frozen=True)
class Case:
    """A source under ``ROOT/sources`` (``"timm:FILE"``: timm's ResNet with that weights file) and how to load it."""

    source: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    chunks: int = 4
    export: bool = False
    on_meta: bool = False  # loaded under `with torch.device("meta")`
    trains_exactly: bool = True  # float32: the pipelined steps equal the plain ones


TIMM_KWARGS = {"layers": [1, 1, 1, 1], "channels": [8, 16, 32, 64]}
CASES: dict[str, Case] = {
    # A tied Qwen2 saved in bfloat16 shards, read as float32.
    "lm": Case("qwen2", export=True),
    "lm_lora": Case("qwen2", {"lora": {"r": 4, "lora_alpha": 8}}, export=True),
    "lm_frozen": Case("qwen2", {"freeze_backbone": True}),
    "lm_meta": Case("qwen2", on_meta=True),
    "lm_bf16": Case("qwen2", {"dtype": "bfloat16"}, trains_exactly=False),
    "translator": Case("marian", export=True),  # its sinusoidal tables are in no file
    "timm": Case("timm:resnet.safetensors", {"num_classes": 3, "model_kwargs": TIMM_KWARGS}, chunks=1),
    "ckpt": Case("transformer_lm.ckpt"),  # a zoo checkpoint: its softmax (the head) new
    "sharded": Case("transformer_lm-sharded"),  # the same checkpoint as a sharded directory
}


def write_sources(root: Path) -> None:
    """Every case's source, in its real on-disk format, under ``root/sources``."""
    import timm
    import torch.distributed.checkpoint as dcp
    import transformers
    from safetensors.torch import save_file

    from zoo.hf.causal_lm_tiny import save_tiny_causal_lm
    from zoo.hf.tiny import save_tiny_translation_model

    sources = root / "sources"
    qwen2 = save_tiny_causal_lm(sources / "qwen2", "qwen2", TEXTS, init_std=0.3)
    library = transformers.AutoModelForCausalLM.from_pretrained(qwen2)
    library.to(torch.bfloat16).save_pretrained(qwen2, max_shard_size="40KB")
    (qwen2 / "model.safetensors").unlink(missing_ok=True)  # the shards and their index only
    save_tiny_translation_model(sources / "marian", TEXTS, "marian", seed=1)
    torch.manual_seed(2)
    resnet = timm.create_model("resnet18", pretrained=False, num_classes=7, **TIMM_KWARGS)
    save_file({key: value.contiguous() for key, value in resnet.state_dict().items()}, sources / "resnet.safetensors")
    torch.manual_seed(3)
    model = tiny_model("transformer_lm")
    trainer = quiet_trainer(accelerator="cpu", max_steps=0)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(sources / "transformer_lm.ckpt")
    checkpoint = torch.load(sources / "transformer_lm.ckpt", weights_only=True)
    sharded = sources / "transformer_lm-sharded"  # as Lightning lays a sharded checkpoint out
    dcp.save({"model": checkpoint.pop("state_dict")}, checkpoint_id=sharded, no_dist=True)
    torch.save(checkpoint, sharded / "meta.pt")


def load(root: Path, case: Case) -> L.LightningModule:
    """The case's model from its source, seeded alike in every process."""
    import zoo

    L.seed_everything(0, verbose=False)
    source = case.source
    with torch.device("meta") if case.on_meta else torch.device("cpu"):
        if source.startswith("timm:"):
            return zoo.load_pretrained("timm/resnet18", weights=str(root / "sources" / source[5:]), **case.options)
        return zoo.load_pretrained(root / "sources" / source, **case.options)


def batch(root: Path, case: Case) -> Any:
    """A batch in the model's own format, the same in every process."""
    generator = torch.Generator().manual_seed(0)
    if case.source == "qwen2":  # rows of 4 to 10 tokens, right-padded, their first two tokens a prompt
        ids = torch.randint(3, 96, (8, 10), generator=generator)
        mask = (torch.arange(10) < torch.tensor([10, 4, 7, 10, 5, 9, 6, 8])[:, None]).long()
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :2] = -100
        return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask, "labels": labels}
    if case.source == "marian":
        config = json.loads((root / "sources" / "marian" / "config.json").read_text())
        source = torch.randint(3, config["vocab_size"] - 1, (8, 7), generator=generator)
        target = torch.randint(3, config["vocab_size"] - 1, (8, 6), generator=generator)
        source[:, -1] = target[:, -1] = config["eos_token_id"]
        target[:, 0] = config["decoder_start_token_id"]
        return source, target
    if case.source.startswith("timm:"):
        return torch.randn(8, 3, 32, 32, generator=generator), torch.randint(0, 3, (8,), generator=generator)
    return tiny_batch("transformer_lm")


class _AtStart(L.Callback):
    """What this rank's stage starts training from, and the keys it read from its checkpoint by then."""

    def __init__(self, path: Path, read: list[str]) -> None:
        self.path, self.read = path, read

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        state = {key: value.detach().clone() for key, value in pl_module.state_dict().items()}
        torch.save(state, self.path.with_suffix(".pt"))
        self.path.with_suffix(".json").write_text(json.dumps(sorted(set(self.read))))


class _ExportAtEnd(L.Callback):
    """``export_pretrained`` (and ``export_adapter`` for a model with LoRA adapters) at the end of training, while each
    rank holds its stage: every rank calls them."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.export_pretrained(self.directory, max_shard_size="60KB")  # type: ignore[operator]
        if getattr(pl_module, "_lora_config", None) is not None:
            pl_module.export_adapter(self.directory.with_name(f"{self.directory.name}-adapter"))  # type: ignore[operator]


def fit(
    model: L.LightningModule, data: Any, strategy: Any, devices: int, root: Path, callbacks: list[Any]
) -> L.Trainer:
    """:data:`STEPS` steps of ``model`` on ``data`` served again each step, on the CPU."""
    size = len(Repeated(data, 1))
    trainer = quiet_trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, default_root_dir=str(root),
        use_distributed_sampler=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(model, DataLoader(Repeated(data, STEPS), batch_size=size))
    return trainer


def main(root: str, *cases: str) -> None:
    from lightning_gpipe import GPipeStrategy

    out = Path(root)
    rank = int(os.environ["RANK"])
    read = _recording_reads()
    for name in cases:
        case = CASES[name]
        read.clear()
        callbacks: list[L.Callback] = [_AtStart(out / f"{name}-start-{rank}", read)]
        if case.export:
            callbacks.append(_ExportAtEnd(out / f"{name}-export"))
        model = load(out, case)
        trainer = fit(model, batch(out, case), GPipeStrategy(pipe_size=2, chunks=case.chunks), 2, out, callbacks)
        trainer.save_checkpoint(out / f"{name}.ckpt")
