"""Deferred BatchNorm: running statistics over the whole mini-batch, per-micro-batch normalization."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.runif import RunIf
from torch import Tensor, nn
from torch.utils.checkpoint import set_checkpoint_early_stop

from lightning_gpipe.engine.batchnorm import DeferredBatchNorm, commit_running_stats
from lightning_gpipe.engine.rematerialization import checkpointed

C = 3
# (BatchNorm class, input shape) for every input rank BatchNorm accepts; N=10 splits unevenly into 3 or 4 chunks.
SHAPES = [
    pytest.param(nn.BatchNorm1d, (10, C), id="1d-NC"),
    pytest.param(nn.BatchNorm1d, (10, C, 5), id="1d-NCL"),
    pytest.param(nn.BatchNorm2d, (10, C, 4, 3), id="2d"),
    pytest.param(nn.BatchNorm3d, (10, C, 2, 3, 2), id="3d"),
]


def make_input(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Tensor:
    # A per-channel offset and scale so that mean and variance both move the running statistics visibly.
    view = (1, C) + (1,) * (len(shape) - 2)
    offset = torch.tensor([1.0, -2.0, 5.0], dtype=dtype).view(view)
    scale = torch.tensor([0.5, 2.0, 3.0], dtype=dtype).view(view)
    return torch.randn(shape, dtype=dtype) * scale + offset


def assert_same_running_stats(actual: nn.Module, expected: nn.Module, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual.running_mean, expected.running_mean, rtol=0, atol=atol)
    torch.testing.assert_close(actual.running_var, expected.running_var, rtol=0, atol=atol)
    assert actual.num_batches_tracked.item() == expected.num_batches_tracked.item()


def run_microbatches(module: nn.Module, x: Tensor, chunks: int) -> None:
    for micro in torch.tensor_split(x, chunks):
        module(micro)


@pytest.mark.parametrize(("bn_cls", "shape"), SHAPES)
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("chunks", [1, 3, 4])
def test_running_stats_equal_full_batch(bn_cls: type[nn.Module], shape: tuple[int, ...], momentum, chunks: int) -> None:
    plain = bn_cls(C, momentum=momentum)
    deferred = DeferredBatchNorm.convert(copy.deepcopy(plain))
    for _ in range(3):
        x = make_input(shape)
        plain(x)
        run_microbatches(deferred, x, chunks)
        deferred.commit()
        assert_same_running_stats(deferred, plain)


def test_running_stats_move_once_per_commit() -> None:
    deferred = DeferredBatchNorm(C)
    run_microbatches(deferred, make_input((10, C)), 4)
    # Until the commit the micro-batches have touched nothing.
    assert deferred.num_batches_tracked.item() == 0
    torch.testing.assert_close(deferred.running_mean, torch.zeros(C), rtol=0, atol=0)
    torch.testing.assert_close(deferred.running_var, torch.ones(C), rtol=0, atol=0)
    deferred.commit()
    assert deferred.num_batches_tracked.item() == 1


@pytest.mark.parametrize(("bn_cls", "shape"), SHAPES)
def test_microbatch_outputs_and_grads_equal_plain(bn_cls: type[nn.Module], shape: tuple[int, ...]) -> None:
    plain = bn_cls(C)
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
        plain.bias.uniform_(-1.0, 1.0)
    deferred = DeferredBatchNorm.convert(copy.deepcopy(plain))
    x = make_input(shape)
    for micro in torch.tensor_split(x, 4):
        grad_output = torch.randn_like(micro)
        results = []
        for module in (plain, deferred):
            module.zero_grad()
            micro_in = micro.clone().requires_grad_()
            output = module(micro_in)
            output.backward(grad_output)
            results.append((output, micro_in.grad, module.weight.grad, module.bias.grad))
        for actual, expected in zip(results[1], results[0], strict=True):
            torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_eval_output_equals_plain_with_same_running_stats() -> None:
    plain = nn.BatchNorm2d(C)
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
        plain.bias.uniform_(-1.0, 1.0)
    deferred = DeferredBatchNorm.convert(copy.deepcopy(plain))
    run_microbatches(deferred, make_input((10, C, 4, 4)), 3)
    deferred.commit()
    plain.load_state_dict(deferred.state_dict())
    plain.eval()
    deferred.eval()
    y = make_input((6, C, 4, 4))
    torch.testing.assert_close(deferred(y), plain(y), rtol=0, atol=0)
    # Eval forwards gather nothing: a commit after them leaves the running statistics alone.
    before = copy.deepcopy(deferred.state_dict())
    deferred.commit()
    torch.testing.assert_close(deferred.state_dict(), before, rtol=0, atol=0)


@pytest.mark.parametrize("early_stop", [False, True])
def test_recomputation_does_not_count_twice(early_stop: bool) -> None:
    plain = nn.BatchNorm2d(C)
    deferred = DeferredBatchNorm.convert(copy.deepcopy(plain))
    calls = []
    deferred.register_forward_pre_hook(lambda module, args: calls.append(1))
    x = make_input((10, C, 4, 4))
    plain(x)
    # With early stop (torch's default) the recomputation of a lone BatchNorm is cut short inside F.batch_norm, once
    # the tensors backward needs exist; without it the whole forward, gathering included, runs again.
    with set_checkpoint_early_stop(early_stop):
        for micro in torch.tensor_split(x, 4):
            checkpointed(deferred, micro.clone().requires_grad_()).sum().backward()
    # Each micro-batch ran twice (forward, then recomputation in backward), yet counts once.
    assert len(calls) == 8
    deferred.commit()
    assert_same_running_stats(deferred, plain)


def test_conv_bn_relu_stack_inside_checkpoint_counts_once() -> None:
    plain = nn.Sequential(nn.Conv2d(C, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
    deferred = DeferredBatchNorm.convert(copy.deepcopy(plain))
    x = torch.randn(10, C, 5, 5)
    # The convolution is per sample, so its BatchNorm sees the same full-batch inputs in both stacks.
    plain(x)
    for micro in torch.tensor_split(x, 4):
        checkpointed(deferred, micro).sum().backward()
    commit_running_stats(deferred)
    assert_same_running_stats(deferred[1], plain[1], atol=1e-5)


def test_deep_stack_checkpointed_equals_not_checkpointed() -> None:
    def block(channels_in: int, channels_out: int) -> list[nn.Module]:
        return [nn.Conv2d(channels_in, channels_out, 3, padding=1), nn.BatchNorm2d(channels_out), nn.ReLU()]

    # The second BatchNorm sees inputs normalized per micro-batch, so the reference is the same stack run without
    # re-materialization rather than a plain full-batch one.
    kept = DeferredBatchNorm.convert(nn.Sequential(*block(C, 4), *block(4, 4)))
    recomputed = copy.deepcopy(kept)
    x = torch.randn(10, C, 5, 5)
    for micro in torch.tensor_split(x, 4):
        kept(micro).square().sum().backward()
        checkpointed(recomputed, micro).square().sum().backward()
    commit_running_stats(kept)
    commit_running_stats(recomputed)
    for actual, expected in zip(recomputed.modules(), kept.modules(), strict=True):
        if isinstance(actual, DeferredBatchNorm):
            assert_same_running_stats(actual, expected)
    for actual, expected in zip(recomputed.parameters(), kept.parameters(), strict=True):
        torch.testing.assert_close(actual.grad, expected.grad)


def test_large_mean_small_variance_stays_accurate() -> None:
    # Values 1e4 +- 1e-1 in float32: E[x^2] - E[x]^2 cancels every significant digit of the variance (float32
    # resolves ~1e-3 near 1e4, ~6 near 1e8), so a naive sum of squares fails here by orders of magnitude.
    x = 1e4 + 1e-1 * torch.randn(64, C, 32)
    deferred = DeferredBatchNorm(C, momentum=None)
    run_microbatches(deferred, x, 4)
    deferred.commit()
    # momentum=None on the first commit takes the batch statistics as they are.
    x64 = x.double().transpose(0, 1).reshape(C, -1)
    torch.testing.assert_close(deferred.running_mean.double(), x64.mean(dim=1), rtol=1e-6, atol=0)
    torch.testing.assert_close(deferred.running_var.double(), x64.var(dim=1), rtol=1e-4, atol=0)


def test_gathers_under_no_grad_in_training() -> None:
    plain = nn.BatchNorm1d(C)
    deferred = DeferredBatchNorm.convert(copy.deepcopy(plain))
    x = make_input((10, C))
    with torch.no_grad():
        plain(x)
        run_microbatches(deferred, x, 3)
    deferred.commit()
    assert_same_running_stats(deferred, plain)


def test_microbatch_of_one_sample_is_rejected_without_gathering() -> None:
    deferred = DeferredBatchNorm(C)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        deferred(torch.randn(1, C))
    deferred.commit()
    assert deferred.num_batches_tracked.item() == 0


def test_bad_input_rank_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"expected 2D, 3D, 4D or 5D input \(got 1D input\)"):
        DeferredBatchNorm(C)(torch.randn(C))


def test_commit_with_nothing_gathered_is_noop() -> None:
    deferred = DeferredBatchNorm(C, momentum=None)
    before = copy.deepcopy(deferred.state_dict())
    deferred.commit()
    commit_running_stats(nn.Sequential(deferred))
    torch.testing.assert_close(deferred.state_dict(), before, rtol=0, atol=0)
    # A second commit right after a real one has nothing left to fold in.
    run_microbatches(deferred, make_input((10, C)), 2)
    deferred.commit()
    after_first = copy.deepcopy(deferred.state_dict())
    deferred.commit()
    torch.testing.assert_close(deferred.state_dict(), after_first, rtol=0, atol=0)


def test_convert_preserves_parameters_buffers_and_settings() -> None:
    bn = nn.BatchNorm2d(4, eps=1e-3, momentum=0.3, dtype=torch.float64)
    bn.running_mean.fill_(2.0)
    bn.num_batches_tracked.fill_(7)
    bn.eval()
    untracked = nn.BatchNorm1d(4, track_running_stats=False)
    no_bias = nn.BatchNorm1d(4, bias=False)
    model = nn.Sequential(nn.Conv2d(4, 4, 1), bn, nn.Sequential(untracked, no_bias))
    keys = list(model.state_dict())
    parameters = list(model.parameters())

    assert DeferredBatchNorm.convert(model) is model
    converted = model[1]
    assert type(converted) is DeferredBatchNorm
    assert (converted.eps, converted.momentum, converted.affine, converted.training) == (1e-3, 0.3, True, False)
    assert converted.weight is bn.weight
    assert converted.bias is bn.bias
    assert converted.running_mean is bn.running_mean
    assert converted.num_batches_tracked is bn.num_batches_tracked
    assert converted._gathered_mean.dtype == torch.float64
    assert model[2][0] is untracked
    assert type(model[2][1]) is DeferredBatchNorm
    assert model[2][1].bias is None
    assert list(model.state_dict()) == keys
    assert list(model.parameters()) == parameters


def test_convert_works_with_a_batchnorm_that_predates_the_bias_keyword(monkeypatch: pytest.MonkeyPatch) -> None:
    # Found on a GPU machine with torch 2.11: BatchNorm's ``bias`` keyword arrived in torch 2.13, and passing it always
    # made every conversion fail there. Give _BatchNorm the older signature and convert an ordinary BatchNorm.
    from torch.nn.modules.batchnorm import _BatchNorm

    newer_init = _BatchNorm.__init__

    def older_init(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True, device=None,
                   dtype=None):  # type: ignore[no-untyped-def]  # fmt: skip
        newer_init(self, num_features, eps, momentum, affine, track_running_stats, device, dtype)

    plain = nn.BatchNorm2d(C)
    monkeypatch.setattr(_BatchNorm, "__init__", older_init)
    deferred = DeferredBatchNorm.convert(copy.deepcopy(plain))
    assert type(deferred) is DeferredBatchNorm
    torch.testing.assert_close(deferred.state_dict(), plain.state_dict(), rtol=0, atol=0)


def test_convert_leaves_subclasses_and_sync_batchnorm_alone() -> None:
    class BatchNormAct(nn.BatchNorm2d):
        def forward(self, input: Tensor) -> Tensor:
            return super().forward(input).relu()

    model = nn.Sequential(BatchNormAct(C), nn.SyncBatchNorm(C), nn.LazyBatchNorm1d())
    children = list(model)
    DeferredBatchNorm.convert(model)
    assert list(model) == children


def test_convert_returns_replacement_for_a_batchnorm_and_is_idempotent() -> None:
    bn = nn.BatchNorm1d(C)
    converted = DeferredBatchNorm.convert(bn)
    assert isinstance(converted, DeferredBatchNorm)
    assert DeferredBatchNorm.convert(converted) is converted

    shared = nn.BatchNorm1d(C)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    DeferredBatchNorm.convert(model)
    assert model[0] is model[2]
    assert isinstance(model[0], DeferredBatchNorm)
    children = list(model)
    DeferredBatchNorm.convert(model)
    assert list(model) == children


def test_convert_works_on_meta_device() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    DeferredBatchNorm.convert(model)
    assert all(buffer.is_meta for buffer in model[1].buffers())


def test_state_dict_round_trips_strictly_both_ways() -> None:
    plain = nn.BatchNorm2d(C)
    run_microbatches(plain, make_input((10, C, 2, 2)), 2)
    deferred = DeferredBatchNorm(C)
    deferred.load_state_dict(plain.state_dict(), strict=True)
    assert list(deferred.state_dict()) == list(plain.state_dict())
    torch.testing.assert_close(deferred.state_dict(), plain.state_dict(), rtol=0, atol=0)

    run_microbatches(deferred, make_input((10, C, 2, 2)), 2)
    deferred.commit()
    fresh = nn.BatchNorm2d(C)
    fresh.load_state_dict(deferred.state_dict(), strict=True)
    torch.testing.assert_close(fresh.state_dict(), deferred.state_dict(), rtol=0, atol=0)


def test_to_moves_accumulators_and_gathers_in_new_dtype() -> None:
    plain = nn.BatchNorm1d(C).double()
    deferred = DeferredBatchNorm(C).to(torch.float64)
    accumulators = [buffer for name, buffer in deferred.named_buffers() if name not in deferred.state_dict()]
    assert len(accumulators) == 2
    assert all(buffer.dtype == torch.float64 for buffer in accumulators)
    x = make_input((10, C, 4), dtype=torch.float64)
    plain(x)
    run_microbatches(deferred, x, 4)
    deferred.commit()
    assert_same_running_stats(deferred, plain, atol=1e-12)


def test_half_module_gathers_in_float32() -> None:
    deferred = DeferredBatchNorm(C).half()
    x = make_input((10, C, 4)).half()
    run_microbatches(deferred, x, 4)
    # ``.half()`` cast the accumulators; gathering widened them back before summing deviations.
    assert deferred._gathered_mean.dtype == torch.float32
    deferred.commit()
    reference = nn.BatchNorm1d(C)
    reference(x.float())
    assert deferred.running_mean.dtype == torch.float16
    torch.testing.assert_close(deferred.running_mean.float(), reference.running_mean, rtol=1e-3, atol=0)
    torch.testing.assert_close(deferred.running_var.float(), reference.running_var, rtol=1e-3, atol=0)


def test_reset_running_stats_drops_gathered_statistics() -> None:
    deferred = DeferredBatchNorm(C)
    run_microbatches(deferred, make_input((10, C)), 2)
    deferred.reset_running_stats()
    deferred.commit()
    assert deferred.num_batches_tracked.item() == 0


@RunIf(gpu=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_running_stats_equal_full_batch_on_gpu(dtype: torch.dtype) -> None:
    plain = nn.BatchNorm2d(C).cuda()
    deferred = DeferredBatchNorm.convert(copy.deepcopy(plain))
    for _ in range(2):
        x = make_input((10, C, 4, 4)).cuda().to(dtype)
        # The reference sees the very same (possibly half-precision) values, only computed in float32.
        plain(x.float())
        for micro in torch.tensor_split(x, 4):
            checkpointed(deferred, micro.clone().requires_grad_()).sum().backward()
        deferred.commit()
    assert_same_running_stats(deferred, plain, atol=1e-5)
