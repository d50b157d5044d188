"""Greedy and beam-search decoding of the encoder-decoder Transformer, checked against exhaustive search."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import zoo
from zoo.tasks.translation import Transformer
from zoo.transformer.decoding import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    beam_search,
    gnmt_length_penalty,
    greedy_decode,
    sequence_log_prob,
)

TINY = {"num_layers": 2, "ff_dim": 32, "num_heads": 2, "d_model": 16, "head_dim": 8, "dropout": 0.0}


def translator(seed: int, vocab_size: int = 12) -> Transformer:
    """A random tiny model made decisive: sharper logits, and </s> likely enough to end some hypotheses early."""
    torch.manual_seed(seed)
    model = zoo.create_model("transformer", **TINY, vocab_size=vocab_size)
    assert isinstance(model, Transformer)
    softmax = model.layers[-1].projection
    with torch.no_grad():
        softmax.weight.mul_(6.0)
        softmax.bias[EOS_ID] += 1.5
    return model


def sources(seed: int, vocab_size: int = 12, batch: int = 4) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(4, vocab_size, (batch, 5), generator=generator)
    source[:, -1] = EOS_ID
    source[0, 3:] = PAD_ID
    source[0, 2] = EOS_ID
    return source


def penalized(model: Transformer, source: torch.Tensor, tokens: torch.Tensor, alpha: float) -> torch.Tensor:
    lengths = ((tokens != PAD_ID).cumsum(1) * (tokens != PAD_ID)).max(1).values  # tokens up to and with </s>
    return sequence_log_prob(model, source, tokens) / gnmt_length_penalty(lengths, alpha)


def assert_well_formed(tokens: torch.Tensor, max_len: int) -> None:
    assert tokens.shape[1] <= max_len
    assert not (tokens == BOS_ID).any()
    for row in tokens.tolist():
        if EOS_ID in row:
            end = row.index(EOS_ID)
            assert all(token == PAD_ID for token in row[end + 1 :])
            assert PAD_ID not in row[:end]
        else:  # no </s>: it ran to max_len
            assert len(row) == max_len
            assert PAD_ID not in row


@pytest.mark.parametrize("seed", range(4))
def test_beam_of_one_without_length_penalty_is_greedy_decoding(seed: int) -> None:
    model, source = translator(seed), sources(seed)
    greedy = greedy_decode(model, source, max_len=8)
    beam = beam_search(model, source, beam_size=1, max_len=8, length_penalty=0.0)
    assert torch.equal(beam.tokens, greedy)
    torch.testing.assert_close(beam.scores, sequence_log_prob(model, source, greedy))
    assert_well_formed(greedy, 8)


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_beam_search_never_scores_below_greedy_and_sometimes_above(alpha: float) -> None:
    # Not a theorem (a beam can prune the greedy path), but what a working beam search does on these fixed models.
    gains = []
    for seed in range(6):
        model, source = translator(seed), sources(seed)
        greedy = greedy_decode(model, source, max_len=8)
        beam = beam_search(model, source, beam_size=4, max_len=8, length_penalty=alpha)
        assert_well_formed(beam.tokens, 8)
        # The reported score is the penalized log-probability of the returned tokens.
        torch.testing.assert_close(beam.scores, penalized(model, source, beam.tokens, alpha))
        gains.append(beam.scores - penalized(model, source, greedy, alpha))
    gain = torch.cat(gains)
    assert (gain >= -1e-5).all(), gain
    assert (gain > 1e-3).any()  # the beam does find better hypotheses than greedy


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_a_wide_enough_beam_finds_the_exhaustive_optimum(seed: int, alpha: float) -> None:
    vocab, max_len = 6, 3  # generable tokens: </s>, unk and 2 more; 1 + 3 + 9 + 27 = 40 hypotheses
    model, source = translator(seed, vocab), sources(seed, vocab, batch=3)
    words = [token for token in range(vocab) if token not in (PAD_ID, BOS_ID, EOS_ID)]
    hypotheses = [[*prefix, EOS_ID] for n in range(max_len) for prefix in itertools.product(words, repeat=n)]
    hypotheses += [list(prefix) for prefix in itertools.product(words, repeat=max_len)]
    padded = torch.tensor([h + [PAD_ID] * (max_len - len(h)) for h in hypotheses])  # [40, max_len]
    best = torch.stack([penalized(model, row.expand(len(padded), -1), padded, alpha).max() for row in source])  # [B]
    beam = beam_search(model, source, beam_size=len(hypotheses), max_len=max_len, length_penalty=alpha)
    torch.testing.assert_close(beam.scores, best)


def test_the_encoder_runs_once_and_the_model_keeps_its_mode() -> None:
    model, source = translator(0), sources(0)
    calls = []
    model.layers[0].register_forward_hook(lambda module, inputs, output: calls.append(1))
    model.train()
    beam_search(model, source, beam_size=3, max_len=6)
    assert len(calls) == 1
    assert model.training
    greedy_decode(model, source, max_len=6)
    assert len(calls) == 2


def test_decoding_is_deterministic_in_training_mode_because_it_switches_to_eval() -> None:
    model = zoo.create_model("transformer", num_layers=1, ff_dim=16, num_heads=2, d_model=8, head_dim=4, vocab_size=12)
    model.train()  # dropout 0.1 would make two decodings differ
    source = sources(1)
    assert torch.equal(greedy_decode(model, source, 6), greedy_decode(model, source, 6))


def test_bad_inputs_are_refused_with_the_fix() -> None:
    model, source = translator(0), sources(0)
    with pytest.raises(ValueError, match=r"beam_size=0 must be at least 1"):
        beam_search(model, source, beam_size=0, max_len=4)
    with pytest.raises(ValueError, match=r"max_len=0 must be at least 1"):
        greedy_decode(model, source, max_len=0)
    with pytest.raises(ValueError, match=r"source must be a LongTensor \[B, S\]"):
        greedy_decode(model, source.float(), max_len=4)
    with pytest.raises(ValueError, match=r"built with pad_id=5; build it with pad_id=0"):
        greedy_decode(zoo.create_model("transformer", **TINY, vocab_size=12, pad_id=5), source, max_len=4)
    model.layers = nn.ModuleList(model.layers)  # type: ignore[assignment]  # like a partitioned stand-in
    with pytest.raises(TypeError, match=r"decoding needs the whole model, but model.layers is a ModuleList"):
        greedy_decode(model, source, max_len=4)


@pytest.mark.parametrize(("balance", "chunks"), [([2, 7], 2), ([4, 5], 1), ([5, 2, 2], 3), ([3, 3, 3], 2)])
def test_decoding_on_the_stages_with_caches_equals_the_whole_model(balance: list[int], chunks: int) -> None:
    # Inside a GPipeStrategy step the layers are the stand-in: every stage decodes with its own layers and caches (the
    # encoder once, then one token per hypothesis and round), beams reordered on every stage.
    from helpers.decoding import pipelined

    model, source = translator(3), sources(3)
    greedy, beam = greedy_decode(model, source, 7), beam_search(model, source, 3, 7)
    assert not torch.equal(beam.tokens, nn.functional.pad(greedy, (0, beam.tokens.shape[1] - greedy.shape[1])))
    model.layers = pipelined(model.layers, balance, chunks)  # type: ignore[assignment]
    assert torch.equal(greedy_decode(model, source, 7), greedy)
    pipelined_beam = beam_search(model, source, 3, 7)
    assert torch.equal(pipelined_beam.tokens, beam.tokens)
    torch.testing.assert_close(pipelined_beam.scores, beam.scores)  # micro-batches of other sizes: other round-off


def test_a_decoding_round_feeds_one_token_per_hypothesis_and_the_encoder_runs_once() -> None:
    model, source = translator(4), sources(4)
    seen: dict[str, list[tuple[int, ...]]] = {"encoder": [], "decoder": []}
    model.layers[1].register_forward_hook(lambda m, i, o: seen["encoder"].append(tuple(i[0][0].shape)))
    model.layers[5].register_forward_hook(lambda m, i, o: seen["decoder"].append(tuple(i[0][2].shape)))
    tokens = beam_search(model, source, 3, 6).tokens
    assert seen["encoder"] == [(4, 5, 16)]  # one run, before the beams are made
    assert seen["decoder"][0] == (12, 1, 16)  # <s> for 4 sources x 3 beams
    assert all(shape == (12, 1, 16) for shape in seen["decoder"][1:])
    assert len(seen["decoder"]) >= tokens.shape[1]
