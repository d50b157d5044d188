"""The memory of a decoding call: the planner's bytes per token per layer against the caches a decoding really fills."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zoo
from lightning_gpipe.plan.decoding import decoding_memory
from zoo.transformer.decoding import PAD_ID

transformers = pytest.importorskip("transformers")

from zoo.hf.causal_lm_generation import CausalLMDecoding  # noqa: E402
from zoo.hf.causal_lm_tiny import save_tiny_causal_lm  # noqa: E402
from zoo.transformer.search import Seq2SeqDecoding  # noqa: E402


def decode_by_hand(layers: torch.nn.Module, decoding: object) -> object:
    """One part over every row, in rounds on the whole model; the part (with its cache) at the end."""
    part = decoding.part(slice(0, decoding.rows))  # type: ignore[attr-defined]
    value = part.first()
    with torch.no_grad():
        while True:
            control, finished = part.choose(part.run(layers, value))
            part.follow(control)
            if finished:
                return part
            value = part.next()


def held_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_a_causal_lms_cache_holds_its_bytes_per_token_per_layer(tmp_path: Path) -> None:
    model = zoo.load_pretrained(save_tiny_causal_lm(tmp_path / "llama", "llama", layers=3)).eval()
    rows, prompt, new = 3, 7, 5
    ids = torch.randint(3, 96, (rows, prompt), generator=torch.Generator().manual_seed(0))
    decoding = CausalLMDecoding(ids, torch.ones_like(ids), max_new_tokens=new)
    part = decode_by_hand(model.layers, decoding)
    cache = part.cache  # type: ignore[attr-defined]
    fed = prompt + new - 1  # the last token chosen is never fed back
    stages = decoding_memory(model.layers, [2, 4], sequences=rows, tokens=fed)
    # 2 key/value heads of 8 channels, float32, keys and values: 128 bytes per token per layer.
    assert [stage.per_token for stage in stages] == [128, 256]
    held = held_bytes([t for layer in cache.layers for t in (layer.keys, layer.values)])
    assert held == sum(stage.cache for stage in stages) == 3 * 128 * rows * fed
    # What the engine checks before the first round: the call's end, one token more than is fed.
    assert decoding.cache_bytes(model.layers, rows) == 3 * 128 * rows * (prompt + new)
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert sum(stage.weights for stage in stages) == pytest.approx(weights, rel=0.2)  # a tied head counts twice


def test_an_encoder_decoders_cache_counts_source_and_target_tokens() -> None:
    torch.manual_seed(0)
    model = zoo.create_model(
        "transformer", num_layers=2, ff_dim=32, num_heads=2, d_model=16, head_dim=8, dropout=0.0, vocab_size=12
    ).eval()
    source = torch.randint(4, 12, (2, 5))
    beams, new = 3, 4
    decoding = Seq2SeqDecoding(source, (1,), 2, PAD_ID, new, banned=(0, 1), beam_size=beams)
    part = decode_by_hand(model.layers, decoding)
    rounds = part.tokens.shape[1] - 1  # type: ignore[attr-defined]
    cache = part.cache  # type: ignore[attr-defined]
    held = held_bytes([t for own, cross in cache._layers.values() for entry in (own, cross) for t in entry.kept()])
    per_token = 2 * 2 * 8 * 4  # keys and values of 2 heads of 8 channels, float32
    assert held == 2 * per_token * 2 * beams * (5 + rounds)  # 2 layers, 2 sources x 3 beams, source + fed tokens
    stages = decoding_memory(model.layers, [4, 5], sequences=2 * beams, tokens=5 + rounds)
    assert [stage.cache for stage in stages] == [0, held]
    assert decoding.cache_bytes(model.layers, 2) >= held


def test_a_balance_that_does_not_cut_the_layers_is_refused() -> None:
    layers = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"balance=\[3\] must give each stage at least one of the 2 layers"):
        decoding_memory(layers, [3], sequences=1, tokens=1)
