"""AmoebaNet-D/-B: the paper's parameter counts, the layer layout and boundary protocol, TF padding, and drop path."""

from __future__ import annotations

import math

import pytest
import torch
from timm.layers import DropPath
from torch import Tensor, nn

from zoo.amoebanet import (
    AMOEBANET_B,
    AMOEBANET_D,
    AuxHead,
    Cell,
    CellGenotype,
    Classifier,
    Genotype,
    Stem,
    amoebanet_layers,
    head_indices,
    set_drop_path_progress,
)
from zoo.amoebanet.operations import FactorizedReduction, Pool2dSame, build_operation, conv2d_same, same_padding

TINY = {"num_layers": 3, "num_filters": 8, "num_classes": 10, "image_size": 32}


def num_params(module: nn.Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


def meta_layers(genotype: Genotype, **kwargs: object) -> nn.Sequential:
    with torch.device("meta"):
        return amoebanet_layers(genotype, **kwargs)  # type: ignore[arg-type]


def tiny(genotype: Genotype = AMOEBANET_D, **kwargs: object) -> nn.Sequential:
    return amoebanet_layers(genotype, **{**TINY, **kwargs})  # type: ignore[arg-type]


# --- genotypes ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cell", "concat"),
    [
        (AMOEBANET_D.normal, (0, 3, 4, 6)),
        (AMOEBANET_D.reduction, (4, 5, 6)),
        (AMOEBANET_B.normal, (0, 3, 4, 6)),
        (AMOEBANET_B.reduction, (5, 6)),
    ],
)
def test_concat_follows_tf_used_hiddenstates(cell: CellGenotype, concat: tuple[int, ...]) -> None:
    assert cell.concat == concat


def test_cell_genotype_validation() -> None:
    ops = ("1x1",) * 10
    with pytest.raises(ValueError, match=r"needs 10 operations and 10 inputs .* got 9 operations"):
        CellGenotype(ops[:9], (0,) * 10, (2,))
    with pytest.raises(ValueError, match=r"inputs\[2\]=3: combination 1 can only read states 0..2"):
        CellGenotype(ops, (0, 0, 3, 0, 0, 0, 0, 0, 0, 0), (2,))
    with pytest.raises(ValueError, match=r"concat=\(7,\)"):
        CellGenotype(ops, (0,) * 10, (7,))
    with pytest.raises(ValueError, match="used_hiddenstates has 6 flags"):
        CellGenotype.from_tf(ops, (0,) * 10, (0,) * 6)


# --- parameter counts (meta device) ------------------------------------------------------------------------------

PAPER_D = [
    # (L, D), exact TF count with aux head, paper figure, relative tolerance
    ((18, 208), 81_781_529, 82e6, 0.01),
    ((18, 416), 318_270_652, 318e6, 0.01),
    ((18, 544), 540_977_420, 542e6, 0.01),
    ((36, 544), 1_054_074_956, 1.05e9, 0.01),
    ((72, 512), 1_843_378_372, 1.8e9, 0.03),
]


@pytest.mark.parametrize(("config", "exact", "paper", "tolerance"), PAPER_D, ids=[str(c[0]) for c in PAPER_D])
def test_amoebanet_d_parameter_counts(config: tuple[int, int], exact: int, paper: float, tolerance: float) -> None:
    layers = meta_layers(AMOEBANET_D, num_layers=config[0], num_filters=config[1], num_classes=1000)
    count = num_params(layers)
    assert count == exact
    assert abs(count - paper) / paper <= tolerance


def test_amoebanet_d_without_aux_head() -> None:
    layers = meta_layers(AMOEBANET_D, num_layers=18, num_filters=208, num_classes=1000, aux_head=False)
    assert num_params(layers) == 81_137_437
    assert not any(isinstance(layer, AuxHead) for layer in layers)


def test_amoebanet_b_parameter_count() -> None:
    layers = meta_layers(AMOEBANET_B, num_layers=18, num_filters=512, num_classes=1000, image_size=480, aux_head=False)
    count = num_params(layers)
    assert count == 557_277_864
    assert abs(count - 557e6) / 557e6 <= 0.01


def test_amoebanet_d_parameter_split() -> None:
    """The per-part split of D(18, 208) from zoo-facts 1.3, read off the layer indices."""
    layers = meta_layers(AMOEBANET_D, num_layers=18, num_filters=208, num_classes=1000)
    counts = [num_params(layer) for layer in layers]
    parts = {
        "stem conv": sum(counts[0:1]),
        "stem cells": sum(counts[1:3]),
        "stack 1": sum(counts[3:9]),
        "reduction 1": sum(counts[9:10]),
        "stack 2": sum(counts[10:16]),
        "aux head": sum(counts[16:17]),
        "reduction 2": sum(counts[17:18]),
        "stack 3": sum(counts[18:24]),
        "fc": sum(counts[24:25]),
    }
    assert parts == {
        "stem conv": 928,
        "stem cells": 71_045,
        "stack 1": 3_233_568,
        "reduction 1": 1_292_304,
        "stack 2": 13_627_328,
        "aux head": 644_092,
        "reduction 2": 5_158_816,
        "stack 3": 54_424_448,
        "fc": 3_329_000,
    }


# --- layout -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_layers", [3, 6, 18])
def test_layout(num_layers: int) -> None:
    layers = meta_layers(AMOEBANET_D, num_layers=num_layers, num_filters=8, num_classes=10)
    third = num_layers // 3
    kinds = ["stem", "cell", "cell", *["normal"] * third, "reduction", *["normal"] * third, "aux", "reduction"]
    kinds += ["normal"] * third + ["classifier"]

    def kind(layer: nn.Module) -> str:
        if isinstance(layer, Cell):
            return "reduction" if layer.stride == 2 else "normal"
        return {Stem: "stem", AuxHead: "aux", Classifier: "classifier"}[type(layer)]

    observed = [kind(layer) for layer in layers]
    assert observed[:1] + ["cell", "cell"] + observed[3:] == kinds
    assert observed[1:3] == ["reduction", "reduction"]  # the stem cells are reduction cells
    aux, classifier = len(layers) - 2 - third - 1, len(layers) - 1
    assert head_indices(layers) == (aux, classifier)
    assert isinstance(layers[aux].fc, nn.Linear)
    assert isinstance(layers[classifier].fc, nn.Linear)
    filters = [layer.filters for layer in layers if isinstance(layer, Cell)]
    assert filters == [2, 4, *[8] * third, 16, *[16] * third, 32, *[32] * third]


def test_head_indices_without_aux_and_on_foreign_layers() -> None:
    layers = meta_layers(AMOEBANET_D, num_layers=3, num_filters=8, num_classes=10, aux_head=False)
    assert head_indices(layers) == (len(layers) - 1,)
    with pytest.raises(ValueError, match="no AuxHead or Classifier entry"):
        head_indices(nn.Sequential(nn.Linear(2, 2)))


def test_channels_of_d_18_208() -> None:
    layers = meta_layers(AMOEBANET_D, num_layers=18, num_filters=208, num_classes=1000)
    outputs = [layer.out_channels for layer in layers if isinstance(layer, Cell)]
    assert outputs[:2] == [156, 312]  # stem cells: 3 x 52, 3 x 104
    assert outputs[2] == 832
    assert outputs[8] == 1248
    assert outputs[9] == 1664
    assert outputs[15] == 2496
    assert outputs[-1] == 3328 == layers[-1].fc.in_features  # 16 D


@pytest.mark.parametrize(
    ("image_size", "stem", "stacks", "aux_kernel"),
    [(224, 111, (56, 28, 28, 14, 7), 4), (480, 239, (120, 60, 60, 30, 15), 9), (32, 15, (8, 4, 4, 2, 1), 1)],
)
def test_spatial_sizes(image_size: int, stem: int, stacks: tuple[int, ...], aux_kernel: int) -> None:
    layers = meta_layers(AMOEBANET_D, num_layers=3, num_filters=8, num_classes=10, image_size=image_size).eval()
    sizes = []
    x: object = torch.empty(1, 3, image_size, image_size, device="meta")
    for layer in layers[:-1]:
        x = layer(x)
        cur = x if isinstance(x, Tensor) else x[1]
        sizes.append(cur.shape[-1])
    # stem, stem cell 1, stem cell 2, stack 1, reduction 1, stack 2, (aux), reduction 2, stack 3
    assert sizes[0] == stem
    assert (sizes[1], sizes[2], sizes[3], sizes[5], sizes[8]) == stacks
    aux = layers[head_indices(layers)[0]]
    assert aux.conv.kernel_size == (aux_kernel, aux_kernel)


def test_the_cifar_stem_keeps_the_resolution_and_has_no_stem_cells() -> None:
    layers = meta_layers(AMOEBANET_D, num_layers=3, num_filters=8, num_classes=10, image_size=32, stem="cifar")
    imagenet = meta_layers(AMOEBANET_D, num_layers=3, num_filters=8, num_classes=10, image_size=32)
    assert len(layers) == len(imagenet) - 2  # the two stem reduction cells are gone
    sizes = []
    x: object = torch.empty(1, 3, 32, 32, device="meta")
    for layer in layers.eval()[:-1]:
        x = layer(x)
        sizes.append((x if isinstance(x, Tensor) else x[1]).shape[-1])
    # stem, stack 1, reduction 1, stack 2, (aux), reduction 2, stack 3: 32 px, then 16 and 8
    assert sizes == [32, 32, 16, 16, 16, 8, 8]
    assert isinstance(layers[0], Stem)
    assert layers[0].conv.stride == (1, 1)
    with pytest.raises(ValueError, match=r"stem='mnist': use one of 'imagenet', 'cifar'"):
        amoebanet_layers(AMOEBANET_D, num_layers=3, num_filters=8, num_classes=10, stem="mnist")


def test_tf_conventions_for_batchnorm_and_convolutions() -> None:
    layers = tiny(AMOEBANET_B)
    norms = [m for m in layers.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert norms
    assert all(type(m) is nn.BatchNorm2d and m.eps == 1e-5 and m.momentum == 0.1 for m in norms)
    convs = [m for m in layers.modules() if isinstance(m, nn.Conv2d)]
    assert convs
    assert all(m.bias is None for m in convs)


def test_meta_build_materializes_with_reset_parameters() -> None:
    layers = meta_layers(AMOEBANET_D, **TINY)
    assert all(parameter.is_meta for parameter in layers.parameters())
    layers = layers.to_empty(device="cpu")
    for module in layers.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert all(torch.isfinite(parameter).all() for parameter in layers.parameters())
    logits = layers.eval()(torch.randn(2, 3, 32, 32))
    assert logits.shape == (2, 10)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_layers": 4}, ValueError, r"num_layers=4: .* multiple of 3"),
        ({"num_filters": 6}, ValueError, r"num_filters=6: .* multiple of 4"),
        ({"num_classes": 0}, ValueError, r"num_classes=0"),
        ({"image_size": 2}, ValueError, r"image_size=2"),
        ({"drop_path": 1.0}, ValueError, r"drop_path=1.0: give a drop probability in \[0, 1\)"),
        ({"dropout": -0.1}, ValueError, r"dropout=-0.1"),
    ],
)
def test_validation(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        meta_layers(AMOEBANET_D, **{**TINY, **kwargs})


def test_genotype_type_is_checked() -> None:
    with pytest.raises(TypeError, match="pass a Genotype such as AMOEBANET_D"):
        amoebanet_layers("amoebanet_d", **TINY)  # type: ignore[arg-type]


def test_unknown_operation() -> None:
    with pytest.raises(ValueError, match=r"unknown AmoebaNet operation 'conv_9x9'; known operations: 'none'"):
        build_operation("conv_9x9", 4, 4, 1)


# --- forward, boundary protocol, backward -------------------------------------------------------------------------


@pytest.mark.parametrize("genotype", [AMOEBANET_D, AMOEBANET_B], ids=["D", "B"])
@pytest.mark.parametrize("aux_head", [True, False], ids=["aux", "no-aux"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_boundary_protocol(genotype: Genotype, aux_head: bool, training: bool) -> None:
    layers = tiny(genotype, aux_head=aux_head).train(training)
    x: object = torch.randn(2, 3, 32, 32)
    with_aux = False
    for index, layer in enumerate(layers):
        x = layer(x)
        if isinstance(layer, Stem):
            assert isinstance(x, Tensor)
            assert x.shape == (2, 32, 15, 15)
        elif isinstance(layer, AuxHead):
            with_aux = training
            assert isinstance(x, tuple)
            assert len(x) == (3 if training else 2)
            if training:
                assert x[2].shape == (2, 10)
        elif isinstance(layer, Cell):
            assert isinstance(x, tuple)
            assert all(isinstance(value, Tensor) for value in x)
            assert len(x) == (3 if with_aux else 2), f"entry {index}"
            assert x[1].shape[1] == layer.out_channels
    if aux_head and training:
        assert isinstance(x, tuple)
        assert [value.shape for value in x] == [(2, 10), (2, 10)]
    else:
        assert isinstance(x, Tensor)
        assert x.shape == (2, 10)


def test_first_cell_takes_a_tensor_and_later_cells_a_tuple() -> None:
    layers = tiny()
    with pytest.raises(TypeError, match="this cell takes a plain tensor, got tuple"):
        layers[1]((torch.randn(2, 32, 15, 15), torch.randn(2, 32, 15, 15)))
    with pytest.raises(TypeError, match=r"this cell takes a \(prev, cur, ...\) tuple, got Tensor"):
        layers[2](torch.randn(2, 6, 8, 8))


@pytest.mark.parametrize("genotype", [AMOEBANET_D, AMOEBANET_B], ids=["D", "B"])
def test_backward_reaches_every_parameter(genotype: Genotype) -> None:
    layers = tiny(genotype, drop_path=0.3)
    set_drop_path_progress(layers, 0.5)
    logits, aux_logits = layers(torch.randn(2, 3, 32, 32))
    (logits.square().mean() + aux_logits.square().mean()).backward()
    missing = [name for name, parameter in layers.named_parameters() if parameter.grad is None]
    assert not missing
    assert all(torch.isfinite(parameter.grad).all() for parameter in layers.parameters())  # type: ignore[arg-type]


def test_concatenated_state_of_another_shape_is_reduced_as_tf_does() -> None:
    # A reduction cell that concatenates its input state 0 (full size) with state 6 (half size): TF reduces state 0.
    ops = ("1x1",) * 10
    genotype = CellGenotype(ops, (0, 1, 0, 1, 0, 1, 0, 1, 0, 1), (0, 6))
    cell = Cell(genotype, in_channels=12, prev_channels=12, size=8, prev_size=8, filters=4, stride=2)
    assert isinstance(cell.concat_fix[0], FactorizedReduction)
    _, out = cell((torch.randn(2, 12, 8, 8), torch.randn(2, 12, 8, 8)))
    assert out.shape == (2, 8, 4, 4)


# --- TF SAME padding ----------------------------------------------------------------------------------------------


def tf_pool_reference(x: Tensor, kind: str, kernel: int, stride: int) -> Tensor:
    """TF SAME pooling by its definition: each window clipped to the input, the odd padding cell at the end."""
    height, width = x.shape[-2:]
    top, _ = same_padding(height, kernel, stride)
    left, _ = same_padding(width, kernel, stride)
    rows = []
    for i in range(math.ceil(height / stride)):
        row = []
        for j in range(math.ceil(width / stride)):
            r0, c0 = i * stride - top, j * stride - left
            window = x[..., max(r0, 0) : r0 + kernel, max(c0, 0) : c0 + kernel].flatten(-2)
            row.append(window.amax(-1) if kind == "max" else window.mean(-1))
        rows.append(torch.stack(row, -1))
    return torch.stack(rows, -2)


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize(("kernel", "stride"), [(3, 1), (3, 2), (2, 2), (2, 1), (5, 3)])
@pytest.mark.parametrize("size", [4, 5, 7, 8])
def test_pooling_matches_tf_same(kind: str, kernel: int, stride: int, size: int) -> None:
    x = torch.randn(2, 3, size, size + 1)
    out = Pool2dSame(kind, kernel, stride)(x)
    assert out.shape[-2:] == (math.ceil(size / stride), math.ceil((size + 1) / stride))
    torch.testing.assert_close(out, tf_pool_reference(x, kind, kernel, stride))


@pytest.mark.parametrize("stride", [1, 2])
def test_max_pool_never_selects_padding(stride: int) -> None:
    x = -1.0 - torch.rand(1, 2, 6, 6)  # all negative: a zero pad would win every border window
    out = Pool2dSame("max", 3, stride)(x)
    assert (out < 0).all()


@pytest.mark.parametrize("stride", [1, 2])
def test_avg_pool_excludes_padding(stride: int) -> None:
    x = torch.full((1, 2, 6, 6), 3.0)
    torch.testing.assert_close(Pool2dSame("avg", 3, stride)(x), torch.full_like(x[..., ::stride, ::stride], 3.0))


def test_stride_two_padding_goes_bottom_right() -> None:
    assert same_padding(8, 3, 2) == (0, 1)
    assert same_padding(7, 3, 2) == (1, 1)
    assert same_padding(111, 3, 2) == (1, 1)
    # A 3x3 stride-2 sum over an 8x8 map of ones: the first windows sit fully inside, the last ones hang off the end.
    conv = conv2d_same(1, 1, 3, 2)
    with torch.no_grad():
        for parameter in conv.parameters():
            parameter.fill_(1.0)
    out = conv(torch.ones(1, 1, 8, 8))[0, 0]
    assert out.shape == (4, 4)
    assert out[0, 0] == 9
    assert out[0, -1] == 6
    assert out[-1, -1] == 4


def test_factorized_reduction_reads_even_and_shifted_odd_cells() -> None:
    reduction = FactorizedReduction(1, 2).eval()
    with torch.no_grad():
        reduction.conv1.weight.fill_(1.0)
        reduction.conv2.weight.fill_(1.0)
    x = torch.arange(25.0).view(1, 1, 5, 5)
    out = reduction(x) * math.sqrt(1 + reduction.bn.eps)  # undo the fresh BatchNorm's eval scaling
    torch.testing.assert_close(out[0, 0], x[0, 0, ::2, ::2])
    odd = torch.zeros(3, 3)
    odd[:2, :2] = x[0, 0, 1::2, 1::2]  # past the border the shifted path reads zeros
    torch.testing.assert_close(out[0, 1], odd)


# --- drop path ----------------------------------------------------------------------------------------------------


def drop_probs(layers: nn.Module) -> list[float]:
    return [module.drop_prob for module in layers.modules() if isinstance(module, DropPath)]


def test_drop_path_schedule_v1() -> None:
    layers = tiny(drop_path=0.4)
    assert set(drop_probs(layers)) == {0.0}  # TF starts training with nothing dropped
    set_drop_path_progress(layers, 0.5)
    assert drop_probs(layers) == pytest.approx([0.2] * len(drop_probs(layers)))
    set_drop_path_progress(layers, 3.0)  # past the end counts as the end
    assert drop_probs(layers) == pytest.approx([0.4] * len(drop_probs(layers)))
    # Every operation but `none` is followed by a drop path: 10 per cell minus the cell's `none` operations.
    cells = [layer for layer in layers if isinstance(layer, Cell)]
    assert len(drop_probs(layers)) == sum(10 - cell.genotype.operations.count("none") for cell in cells)


def test_drop_path_schedule_scaled_by_depth() -> None:
    layers = tiny(drop_path=0.4)
    set_drop_path_progress(layers, 1.0, scale_by_depth=True)
    cells = [layer for layer in layers if isinstance(layer, Cell)]
    per_cell = [drop_probs(cell)[0] for cell in cells]
    total = 3 + 2 + 2  # L normal cells, 2 reduction cells, 2 stem cells
    assert per_cell == pytest.approx([0.4 * (n + 1) / total for n in range(total)])


def test_drop_path_progress_is_validated() -> None:
    with pytest.raises(ValueError, match=r"progress=-0.1: pass the fraction of training done"):
        set_drop_path_progress(tiny(), -0.1)


def test_drop_path_is_identity_at_zero_progress_and_in_eval() -> None:
    layers = tiny(drop_path=0.5, dropout=0.0, aux_head=False)
    x = torch.randn(4, 3, 32, 32)
    set_drop_path_progress(layers, 0.0)
    torch.manual_seed(1)
    first = layers(x)
    torch.manual_seed(2)
    assert torch.equal(layers(x), first)  # no randomness left in training mode
    set_drop_path_progress(layers, 1.0)
    torch.manual_seed(1)
    assert not torch.equal(layers(x), first)  # now paths are dropped
    layers.eval()
    torch.manual_seed(1)
    evaluated = layers(x)
    torch.manual_seed(2)
    assert torch.equal(layers(x), evaluated)


def test_drop_path_drops_whole_examples_and_keeps_the_expectation() -> None:
    layers = tiny(drop_path=0.25)
    set_drop_path_progress(layers, 1.0)
    drop = next(module for module in layers.modules() if isinstance(module, DropPath))
    x = torch.ones(20_000, 2, 2, 2)
    out = drop(x)
    per_example = out.flatten(1)
    assert (per_example == per_example[:, :1]).all()  # one decision per example
    assert per_example[:, 0].unique().tolist() == [0.0, pytest.approx(1 / 0.75)]
    assert (per_example[:, 0] == 0).float().mean().item() == pytest.approx(0.25, abs=0.02)
    assert out.mean().item() == pytest.approx(1.0, abs=0.03)
