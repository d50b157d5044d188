"""The benchmark's Llama, built from a ``transformers`` config and saved as a hub checkpoint ships: bfloat16 safetensors
shards with their index, nothing downloaded; and the batches it trains on."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch.utils.data import DataLoader, Dataset

__all__ = ["SIZES", "Size", "loader", "save_llama"]


@dataclass(frozen=True)
class Size:
    """A Llama's shape, and the shard size its checkpoint is cut into."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    vocab: int
    shard: str
    tokens: int = 64  # per sequence
    batch: int = 8

    def config(self) -> transformers.LlamaConfig:
        return transformers.LlamaConfig(
            hidden_size=self.hidden, intermediate_size=self.intermediate, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.heads, vocab_size=self.vocab,
            max_position_embeddings=2 * self.tokens, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip


SIZES = {
    # About 220M parameters (838 MiB in float32): the model. Untied input and output embeddings.
    "full": Size(hidden=1024, intermediate=2816, layers=12, heads=16, vocab=32000, shard="100MB"),
    # About 12M parameters: minutes on a laptop, for development.
    "quick": Size(hidden=256, intermediate=704, layers=8, heads=4, vocab=8000, shard="10MB"),
    # About 0.1M parameters: the smoke test.
    "tiny": Size(hidden=64, intermediate=128, layers=4, heads=4, vocab=256, shard="100KB", tokens=16, batch=4),
}  # fmt: skip


def save_llama(size: Size, directory: Path) -> int:
    """Save a random-initialized Llama of ``size`` in bfloat16 safetensors shards; returns its parameter count."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(size.config())
    model.to(torch.bfloat16).save_pretrained(directory, max_shard_size=size.shard, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


class _Tokens(Dataset):
    """Random token rows as Hugging Face's language-model collator hands them over (labels = inputs)."""

    def __init__(self, size: Size, rows: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, size.vocab, (rows, size.tokens), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.ids[index]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def loader(size: Size, steps: int) -> DataLoader:
    """``steps`` batches of ``size.batch`` rows."""
    return DataLoader(_Tokens(size, steps * size.batch), batch_size=size.batch)
