"""The GPipe paper's Transformers: exact parameter counts, masking, the depth stabilisers, training, and GPipe."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import zoo
from lightning_gpipe.partition.sequence import materialize
from zoo.transformer.layers import Softmax, XavierLinear, sinusoidal_positions
from zoo.transformer.network import decoder_slice, encoder_slice, transformer_layers, transformer_lm_layers
from zoo.transformer.objective import sequence_cross_entropy
from zoo.transformer.optimization import inverse_sqrt_warmup

TINY = {"num_layers": 2, "ff_dim": 64, "num_heads": 2, "d_model": 32, "vocab_size": 50, "dropout": 0.0}


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ---- parameter counts (meta device) ----------------------------------------------------------------------------

# (L, H, A): exact count of lingvo's 3-matrix GPipeTransformerStack with 64·A attention channels, the paper's figure,
# and the tolerance against it (T(6, 8192, 16) is the documented +18.4 % residual).
T_MODELS = [
    ((6, 8192, 16), 473_745_920, 400e6, 0.185),
    ((24, 8192, 16), 1_304_955_392, 1.3e9, 0.06),
    ((12, 16384, 32), 1_304_771_072, 1.3e9, 0.06),
    ((32, 16384, 32), 3_151_596_032, 3e9, 0.06),
    ((64, 16384, 32), 6_106_515_968, 6e9, 0.06),
]
LM_PAPER = {3: 282.2e6, 13: 785.8e6, 103: 5.3e9, 415: 21.0e9, 1663: 83.9e9}


@pytest.mark.parametrize(("config", "exact", "paper", "tolerance"), T_MODELS, ids=lambda v: str(v))
def test_t_model_parameter_counts_match_the_lingvo_structure_and_the_paper(
    config: tuple[int, int, int], exact: int, paper: float, tolerance: float
) -> None:
    num_layers, ff_dim, num_heads = config
    with torch.device("meta"):
        model = zoo.create_model("transformer", num_layers=num_layers, ff_dim=ff_dim, num_heads=num_heads)
    assert count(model) == exact
    assert abs(count(model) - paper) / paper <= tolerance
    assert len(model.layers) == 2 * num_layers + 5


@pytest.mark.parametrize("num_layers", [3, 13, 103, 415, pytest.param(1663, marks=pytest.mark.slow)])
def test_transformer_l_parameter_counts_are_exact_and_within_half_a_percent_of_the_paper(num_layers: int) -> None:
    with torch.device("meta"):
        model = zoo.create_model("transformer_lm", num_layers=num_layers)
    assert count(model) == 50_358_336 * num_layers + 131_104_000
    assert abs(count(model) - LM_PAPER[num_layers]) / LM_PAPER[num_layers] <= 0.005


def test_per_layer_counts_follow_the_documented_formulas() -> None:
    d, h, a, e, v = 32, 64, 2, 16, 50
    with torch.device("meta"):
        layers = transformer_layers(3, h, a, d_model=d, vocab_size=v, head_dim=e)
    attention = 4 * d * a * e + 3 * a * e + d + 2 * d
    feed_forward = 2 * d * h + h + d + 2 * d
    assert count(layers[1]) == attention + feed_forward  # encoder layer
    assert count(layers[6]) == 2 * attention + feed_forward  # decoder layer
    assert count(layers[0]) == count(layers[5]) == v * d  # sinusoidal positions add nothing
    assert count(layers[-1]) == d * v + v


def test_sinusoidal_positions_have_no_parameters_or_buffers_and_the_usual_values() -> None:
    embedding = transformer_lm_layers(1, d_model=8, ff_dim=8, num_heads=2, vocab_size=10)[0]
    assert count(embedding) == 10 * 8
    assert list(embedding.buffers()) == []
    positions = sinusoidal_positions(5, 8)
    assert positions.shape == (5, 8)
    torch.testing.assert_close(positions[0], torch.tensor([0.0] * 4 + [1.0] * 4))
    torch.testing.assert_close(positions[3, 0], torch.tensor(math.sin(3.0)))  # timescale 1 for the first channel
    torch.testing.assert_close(positions[3, 7], torch.tensor(math.cos(3.0 * 1e-4)))  # the longest timescale


# ---- tiny models: shapes and masking ------------------------------------------------------------------------------


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(4, 50, (3, 7), generator=generator)
    source[:, -1] = 2
    source[0, 4:] = 0  # row 0 is shorter: three padding tokens
    target = torch.randint(4, 50, (3, 6), generator=generator)
    target[:, 0], target[:, -1] = 1, 2
    return source, target


def test_forward_shapes_and_the_encoder_decoder_split() -> None:
    model = zoo.create_model("transformer", **TINY, head_dim=16).eval()
    source, target = batch()
    logits = model(source, target[:, :-1])
    assert logits.shape == (3, 5, 50)
    memory, mask = model.encode(source)
    assert memory.shape == (3, 7, 32)
    assert mask.dtype == torch.bool
    assert mask[0].tolist() == [True] * 4 + [False] * 3
    torch.testing.assert_close(model.decode(memory, mask, target[:, :-1]), logits)
    assert encoder_slice(2) == slice(0, 4)
    assert decoder_slice(2) == slice(4, 9)
    lm = zoo.create_model("transformer_lm", **TINY)
    assert lm(target).shape == (3, 6, 50)


def test_changing_a_future_target_token_leaves_earlier_logits_alone() -> None:
    model = zoo.create_model("transformer", **TINY, head_dim=16).eval()
    source, target = batch()
    changed = target.clone()
    changed[:, 3] = (changed[:, 3] + 1 - 4) % 46 + 4
    before, after = model(source, target), model(source, changed)
    torch.testing.assert_close(before[:, :3], after[:, :3])
    assert not torch.allclose(before[:, 3:], after[:, 3:])
    lm = zoo.create_model("transformer_lm", **TINY).eval()
    before, after = lm(target), lm(changed)
    torch.testing.assert_close(before[:, :3], after[:, :3])
    assert not torch.allclose(before[:, 3:], after[:, 3:])


def test_padded_source_positions_do_not_change_the_outputs() -> None:
    model = zoo.create_model("transformer", **TINY, head_dim=16).eval()
    source, target = batch()
    logits = model(source, target)
    # More padding columns, and a different embedding for the padding token: the real positions see none of it.
    longer = torch.cat([source, torch.zeros(3, 4, dtype=torch.long)], dim=1)
    with torch.no_grad():
        model.layers[0].token.weight[0].normal_()
    torch.testing.assert_close(model(longer, target), logits)
    # Whereas a real source token does change them (the check above can fail).
    other = source.clone()
    other[0, 1] = (other[0, 1] + 1 - 4) % 46 + 4
    assert not torch.allclose(model(other, target)[0], logits[0])


# ---- depth stabilisers and the loss ----------------------------------------------------------------------------------


def test_logit_clipping_bounds_training_logits_and_zeroes_their_gradient_outside() -> None:
    softmax = Softmax(8, 20, logits_abs_max=0.5)
    x = torch.randn(4, 3, 8) * 3
    raw: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
        output.retain_grad()
        raw.append(output)

    softmax.projection.register_forward_hook(keep)
    logits = softmax(x)
    assert logits.abs().max() <= 0.5
    clipped = raw[0].detach().abs() > 0.5
    assert clipped.any()
    assert (~clipped).any()
    (logits * torch.randn_like(logits)).sum().backward()
    assert (raw[0].grad[clipped] == 0).all()
    assert (raw[0].grad[~clipped] != 0).all()
    softmax.eval()  # evaluation and decoding see the raw logits
    assert softmax(x).abs().max() > 0.5
    with pytest.raises(ValueError, match=r"logits_abs_max=-1.0 must be a positive bound"):
        Softmax(8, 20, logits_abs_max=-1.0)


def test_label_smoothed_loss_matches_its_formula_and_ignores_padding() -> None:
    logits = torch.randn(2, 4, 6)
    targets = torch.tensor([[3, 4, 5, 0], [2, 0, 0, 0]])
    s = 0.1
    log_p = logits.log_softmax(-1)
    real = targets != 0
    per_token = -(1 - s) * log_p.gather(-1, targets[..., None]).squeeze(-1) - s * log_p.mean(-1)
    expected = per_token[real].mean()
    torch.testing.assert_close(sequence_cross_entropy(logits, targets, pad_id=0, label_smoothing=s), expected)
    noisy = logits.clone()
    noisy[~real] = torch.randn_like(noisy[~real]) * 10  # whatever the model says at padded targets
    torch.testing.assert_close(sequence_cross_entropy(noisy, targets, label_smoothing=s), expected)
    assert not torch.allclose(sequence_cross_entropy(logits, targets, label_smoothing=0.0), expected)
    with pytest.raises(ValueError, match=r"label_smoothing=1.5 must be in \[0, 1\)"):
        sequence_cross_entropy(logits, targets, label_smoothing=1.5)


@pytest.mark.parametrize("name", ["transformer", "transformer_lm"])
def test_feed_forward_init_is_scaled_by_depth_after_meta_materialization(name: str) -> None:
    config = {**TINY, "num_layers": 16, "d_model": 64, "ff_dim": 256}
    stds = {}
    for scaling in (True, False):
        with torch.device("meta"):
            model = zoo.create_model(name, **config, ff_init_scaling=scaling)
        # What GPipeStrategy does to a meta-built sequence: to_empty, then reset_parameters of every submodule.
        materialize(list(enumerate(model.layers)), torch.device("cpu"), seed=0)
        feed_forward = [m for n, m in model.layers.named_modules() if n.endswith(("inner", "outer"))]
        attention = [m for n, m in model.layers.named_modules() if n.endswith(".query")]
        assert len(feed_forward) == 2 * 16 * (2 if name == "transformer" else 1)
        xavier = math.sqrt(2 / (64 + 256))  # std of Xavier-uniform for a 64 x 256 matrix
        stds[scaling] = torch.stack([m.weight.detach().std() for m in feed_forward]) / xavier
        for module in attention:  # not scaled
            assert module.weight.std().item() == pytest.approx(math.sqrt(2 / sum(module.weight.shape)), rel=0.1)
        assert all(isinstance(m, XavierLinear) and (m.bias == 0).all() for m in feed_forward)
    assert stds[True].mean().item() == pytest.approx(16**-0.5, rel=0.03)
    assert stds[False].mean().item() == pytest.approx(1.0, rel=0.03)


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")  # a step called without a Trainer
@pytest.mark.parametrize("name", ["transformer", "transformer_lm"])
def test_one_optimizer_step_reduces_the_loss_on_a_fixed_batch(name: str) -> None:
    model = zoo.create_model(name, **TINY, warmup_steps=0, lr=1e-3, logits_abs_max=10.0)
    data = batch() if name == "transformer" else batch()[1]
    optimizer = model.configure_optimizers()["optimizer"]
    losses = []
    for _ in range(2):
        loss = model.training_step(data, 0)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[1] < losses[0]


def test_inverse_sqrt_warmup_rises_linearly_to_the_peak_then_decays() -> None:
    factors = [inverse_sqrt_warmup(step, 4) for step in range(16)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[15] == pytest.approx(0.5)  # sqrt(4 / 16)
    assert inverse_sqrt_warmup(0, 0) == 1.0


def test_validation_logs_loss_accuracy_and_perplexity_from_the_token_mean_nll() -> None:
    model = zoo.create_model("transformer_lm", **TINY, label_smoothing=0.1)
    tokens = batch()[1]
    tokens[0, 3:] = 0  # padding must not count
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.validate(model, DataLoader([tokens[:2], tokens[2:]], batch_size=None), verbose=False)
    model.eval()
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    targets = tokens[:, 1:]
    nll = F.cross_entropy(logits.reshape(-1, 50), targets.reshape(-1), ignore_index=0, reduction="sum")
    expected_ppl = math.exp(nll.item() / (targets != 0).sum().item())
    metrics = trainer.callback_metrics
    assert metrics["val_ppl"].item() == pytest.approx(expected_ppl, rel=1e-5)
    accuracy = (logits.argmax(-1) == targets)[targets != 0].float().mean()
    assert metrics["val_acc"].item() == pytest.approx(accuracy.item())
    assert metrics["val_loss"].item() > 0


def test_head_prefixes_name_the_softmax() -> None:
    model = zoo.create_model("transformer", **TINY)
    (prefix,) = model.head_prefixes()
    assert isinstance(model.get_submodule(prefix), Softmax)
    lm = zoo.create_model("transformer_lm", **TINY, final_norm=True)
    assert isinstance(lm.get_submodule(lm.head_prefixes()[0]), Softmax)
    assert isinstance(lm.layers[-2], torch.nn.LayerNorm)


def test_bad_arguments_name_the_value_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"optimizer='sgd' is not supported; use one of 'adam', 'adafactor'"):
        zoo.create_model("transformer", **TINY, optimizer="sgd")
    with pytest.raises(ValueError, match=r"num_layers=0 must be at least 1"):
        zoo.create_model("transformer_lm", **{**TINY, "num_layers": 0})
    with pytest.raises(ValueError, match=r"d_model=30 is not divisible by num_heads=4; pass head_dim"):
        transformer_lm_layers(1, d_model=30, num_heads=4)
    with pytest.raises(ValueError, match=r"dropout=1.0 must be a probability in \[0, 1\)"):
        transformer_layers(1, 8, 2, d_model=8, vocab_size=10, dropout=1.0)
