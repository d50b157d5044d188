"""First contact with a model that is not one sequence: the message says so, why, and where the rewrite is shown.

The models are written as a newcomer brings them: a GPT whose blocks are an ``nn.ModuleList`` with a head tied to the
embedding, and a U-Net whose encoder and decoder stages are small ``nn.Sequential`` attributes joined in ``forward``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gpipe.partition.discovery import find_sequence

NOT_ONE_SEQUENCE = (
    r"layers are not one sequence: .*; rewrite them as one nn.Sequential: "
    r"docs/getting_started.md#models-that-are-not-one-sequence$"
)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class GPT(nn.Module):
    def __init__(self, depth: int, vocab: int = 50, width: int = 32) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embedding.weight


def stage(channels_in: int, channels_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(channels_in, channels_out, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(channels_out, channels_out, 3, padding=1),
    )


class UNet(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.enc1, self.enc2 = stage(1, width), stage(width, 2 * width)
        self.bottleneck = stage(2 * width, 4 * width)
        self.up2, self.up1 = nn.ConvTranspose2d(4 * width, 2 * width, 2, 2), nn.ConvTranspose2d(2 * width, width, 2, 2)
        self.dec2, self.dec1 = stage(4 * width, 2 * width), stage(2 * width, width)
        self.out = nn.Conv2d(width, 1, 1)


@pytest.mark.parametrize("depth", [1, 4])
def test_a_gpt_with_a_module_list_is_told_to_rewrite_its_layers_as_one_sequence(depth: int) -> None:
    # C1 of issue 29: the only nn.Sequential was each block's MLP, so the hint read module_name='blocks.0.mlp' (four
    # blocks) or the MLP was taken silently (one block, where it holds most parameters), and setup then refused
    # "trainable parameters outside the pipelined sequence": advice that could not be followed.
    with pytest.raises(TypeError, match=NOT_ONE_SEQUENCE) as error:
        find_sequence(GPT(depth))
    message = str(error.value)
    assert "nn.ModuleList ('blocks')" in message
    assert "module_name=" not in message


def test_a_unet_of_small_sequential_stages_is_told_to_rewrite_its_layers_as_one_sequence() -> None:
    # C1 of issue 29: its encoder and decoder stages are nn.Sequential attributes, so the hint read module_name='enc1'.
    with pytest.raises(TypeError, match=NOT_ONE_SEQUENCE) as error:
        find_sequence(UNet())
    message = str(error.value)
    assert "spread over 5 nn.Sequential ('enc1', 'enc2', 'bottleneck', 'dec2', ...)" in message
    assert "module_name=" not in message


def test_two_trainable_sequences_are_not_one_sequence() -> None:
    # Naming either with module_name would leave the other's trainable layers outside the pipelined sequence.
    module = nn.Module()
    module.encoder, module.decoder = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"spread over 2 nn.Sequential \('encoder', 'decoder'\)"):
        find_sequence(module)


def test_a_lone_block_of_a_larger_block_is_not_the_sequence() -> None:
    class OneBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block(32)

    with pytest.raises(TypeError, match=r"'block.mlp' holds \d+% .* part of a larger block, 'block'"):
        find_sequence(OneBlock())


def test_a_sequence_with_a_small_head_outside_keeps_the_usual_path() -> None:
    # Most of the trainable parameters are in the sequence: setup's message (move the head into it) is the right one.
    module = nn.Module()
    module.layers = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    module.head = nn.Linear(64, 2)
    assert find_sequence(module)[0] == "layers"


def test_frozen_layers_outside_the_sequence_do_not_count() -> None:
    module = nn.Module()
    module.encoders = nn.ModuleList(nn.Linear(32, 32) for _ in range(4)).requires_grad_(False)
    module.probe = nn.Sequential(nn.Linear(32, 2))  # the only trainable layers: a probe on frozen encoders
    assert find_sequence(module)[0] == "probe"


def test_the_several_sequences_hint_names_the_one_that_holds_the_trainable_layers() -> None:
    module = nn.Module()
    module.frozen = nn.Sequential(nn.Linear(4, 4)).requires_grad_(False)
    module.trained = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"several nn.Sequential attributes \('frozen', 'trained'\).*'trained'"):
        find_sequence(module)
