"""A GPT written as one ``nn.Sequential`` for ``GPipeStrategy``: the embedding, the blocks, and a head tied to it.

A GPT is usually written with its blocks in an ``nn.ModuleList`` that ``forward`` loops over, and an output head
that shares the embedding's weight. A pipeline cuts one sequence of layers into stages, so here the same model is
that sequence: ``Embedding``, ``Block`` x 4, ``Head``. The head's weight stays the embedding's: on two stages the
first holds the embedding, the last the head, each keeps a copy of the shared weight, and the strategy sums the
copies' gradients, so training is the plain model's. Shapes: B batch, T tokens, D width, H heads, V vocabulary.

    OMP_NUM_THREADS=1 python examples/gpt_sequence.py   # K = 2 stages on 2 CPU processes, a few seconds
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gpipe  # noqa: F401  (registers strategy="gpipe")

VOCAB, LENGTH, WIDTH, HEADS, DEPTH = 16, 16, 32, 2, 4


class Embedding(nn.Module):
    """Token and position embeddings: (B, T) token ids -> (B, T, D)."""

    def __init__(self, vocab: int, length: int, width: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(length, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions.weight[: ids.shape[1]]


class Block(nn.Module):
    """Causal self-attention, then an MLP, each added to the residual stream: (B, T, D) -> (B, T, D)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.projection = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        qkv = self.qkv(self.attention_norm(x)).view(B, T, 3, self.heads, D // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, H, T, D / H)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.projection(attended.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.mlp_norm(x))


class Head(nn.Module):
    """The final norm and the projection onto the vocabulary: (B, T, D) -> (B, T, V) logits."""

    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.projection = nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(self.norm(x))


def gpt(
    vocab: int = VOCAB, length: int = LENGTH, width: int = WIDTH, heads: int = HEADS, depth: int = DEPTH
) -> nn.Sequential:
    """The whole GPT as one sequence, where the usual code has ``self.blocks = nn.ModuleList(...)``."""
    embedding, head = Embedding(vocab, length, width), Head(width, vocab)
    head.projection.weight = embedding.tokens.weight  # tied, as in GPT-2
    return nn.Sequential(embedding, *(Block(width, heads) for _ in range(depth)), head)


class GPT(L.LightningModule):
    """Next-token prediction with the GPT of :func:`gpt` in ``self.layers``."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.layers = gpt()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch  # (B, T) each: the targets are the ids shifted by one
        logits = self.layers(ids)
        # Every sequence has T tokens, so each micro-batch's mean is over as many tokens: a plain mean is exact.
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def dataset(samples: int = 512, seed: int = 0) -> TensorDataset:
    """Sequences that count modulo V from a random start by a random stride of 1 to 3: ids and next ids."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (samples, 1), generator=generator)
    stride = torch.randint(1, 4, (samples, 1), generator=generator)
    counts = (start + stride * torch.arange(LENGTH + 1)) % VOCAB
    return TensorDataset(counts[:, :-1], counts[:, 1:])


if __name__ == "__main__":
    L.seed_everything(0)
    model = GPT()
    trainer = L.Trainer(strategy="gpipe", accelerator="cpu", devices=2, max_epochs=3, logger=False)
    trainer.fit(model, DataLoader(dataset(), batch_size=32, shuffle=True, drop_last=True))
    # Each rank kept its stage; on every rank, put the whole model back on global rank 0 (None elsewhere).
    whole = trainer.strategy.gather_module()  # type: ignore[attr-defined]
    if whole is not None:
        print(f"final loss {trainer.callback_metrics['train_loss']:.3f}")
        embedding, head = model.layers[0], model.layers[-1]
        assert isinstance(embedding, Embedding)
        assert isinstance(head, Head)
        print(f"head still tied to the embedding: {head.projection.weight is embedding.tokens.weight}")
