"""Layer cost sources: exact analytic counts, measurements that leave the model untouched, and the dispatch errors."""

from __future__ import annotations

import math
import time

import pytest
import torch
from helpers.runif import RunIf
from torch import Tensor, nn

from lightning_gpipe.profile.cost import COST_SOURCES, flops_cost, layer_costs, memory_cost, param_cost, time_cost

FLOAT32 = 4  # bytes


class Sleep(nn.Module):
    """A parameter-free layer whose forward takes at least ``seconds``."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(self.seconds)
        return x * 1.0


class RepeatTanh(nn.Module):
    """tanh of the input repeated ``times`` along the features: autograd saves the ``times``-wide output."""

    def __init__(self, times: int) -> None:
        super().__init__()
        self.times = times

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x.repeat(1, self.times))


class Pair(nn.Module):
    """Returns a tuple, as layers handing several tensors down a pipeline do."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x.relu(), x.sigmoid()


class Join(nn.Module):
    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        return pair[0] * pair[1]


def small_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 3))


def tied_model() -> nn.Sequential:
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight
    return nn.Sequential(first, second)


def test_param_cost_counts_each_layer() -> None:
    # Linear(4, 8): 32 + 8; BatchNorm1d(8): weight and bias, running stats are buffers; Linear(8, 3): 24 + 3.
    assert param_cost(small_model()) == [40.0, 0.0, 16.0, 0.0, 27.0]
    assert param_cost([nn.Linear(4, 8, bias=False)]) == [32.0]


def test_param_cost_counts_a_shared_parameter_once_in_the_first_layer() -> None:
    assert param_cost(tied_model()) == [20.0, 4.0]


def test_param_cost_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = small_model()
    assert param_cost(model) == [40.0, 0.0, 16.0, 0.0, 27.0]


def test_flops_cost_of_linear_layers_is_two_flops_per_multiply_add() -> None:
    batch = 5
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    # Each layer sees the previous layer's output: the second Linear gets 8 features.
    assert flops_cost(model, torch.randn(batch, 4)) == [2 * batch * 4 * 8, 0.0, 2 * batch * 8 * 3]


def test_flops_cost_of_a_convolution() -> None:
    conv = nn.Conv2d(3, 5, kernel_size=3, padding=1)
    # Every one of the 2·5·6·6 outputs takes 3·3·3 multiply-adds.
    assert flops_cost([conv], torch.randn(2, 3, 6, 6)) == [2 * (2 * 5 * 6 * 6) * (3 * 3 * 3)]


def test_flops_cost_on_the_meta_device_matches_cpu() -> None:
    with torch.device("meta"):
        model = small_model()
        sample = torch.empty(2, 4)
    assert (
        flops_cost(model, sample)
        == flops_cost(small_model(), torch.randn(2, 4))
        == [2 * 2 * 4 * 8, 0.0, 0.0, 0.0, 2 * 2 * 8 * 3]
    )


def test_flops_cost_leaves_the_sample_and_running_statistics_alone() -> None:
    bn = nn.BatchNorm1d(4)
    sample = torch.randn(3, 4)
    original = sample.clone()
    flops_cost(nn.Sequential(nn.ReLU(inplace=True), bn), sample)
    assert torch.equal(sample, original)
    assert bn.running_mean is not None
    assert torch.equal(bn.running_mean, torch.zeros(4))
    assert bn.num_batches_tracked == 0


def test_time_cost_ranks_a_slow_layer_above_a_cheap_one() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Sleep(0.02), nn.Linear(4, 4))
    costs = time_cost(model, torch.randn(2, 4), repeats=3, warmup=1)
    assert len(costs) == 3
    assert all(cost > 0 for cost in costs)
    assert costs[1] >= 0.02
    assert costs[1] > costs[0]
    assert costs[1] > costs[2]


def test_time_cost_ignores_a_single_delayed_run() -> None:
    class DelayedOnce(nn.Module):
        """Stalls once, in the first timed run, as a preempted process does.

        time_cost calls each layer once untimed to collect the next layer's input, then ``warmup`` untimed runs.
        """

        def __init__(self, stall_on_call: int) -> None:
            super().__init__()
            self.calls = 0
            self.stall_on_call = stall_on_call

        def forward(self, x: Tensor) -> Tensor:
            self.calls += 1
            if self.calls == self.stall_on_call:
                time.sleep(0.6)
            return x * 1.0

    layer = DelayedOnce(stall_on_call=3)
    (cost,) = time_cost([layer], torch.randn(2, 2), repeats=3, warmup=1)
    assert layer.calls == 5
    # The mean would be at least 0.2 s.
    assert cost < 0.1


def test_time_cost_leaves_the_model_and_random_state_untouched() -> None:
    model = small_model()
    running_mean = model[2].running_mean
    assert isinstance(running_mean, Tensor)
    running_mean.fill_(0.5)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    sample = torch.randn(6, 4)
    rng = torch.get_rng_state()
    time_cost(model, sample, repeats=2, warmup=1)
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.state_dict().keys() == state.keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    assert all(param.grad is None for param in model.parameters())
    assert model.training


def test_time_cost_restores_a_buffer_the_layer_replaces() -> None:
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls: Tensor
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x: Tensor) -> Tensor:
            self.calls = self.calls + 1  # a new tensor, not an in-place update
            return x * 1.0

    counter = Counter()
    original = counter.calls
    time_cost([counter], torch.randn(2, 2), repeats=1, warmup=0)
    assert counter.calls is original
    assert counter.calls.item() == 0


def test_time_cost_handles_in_place_layers_integer_inputs_and_tuples() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.ReLU(inplace=True), Pair(), Join())
    sample = torch.tensor([[1, 2, 3]])
    costs = time_cost(model, sample, repeats=1, warmup=0)
    assert len(costs) == 4
    assert torch.equal(sample, torch.tensor([[1, 2, 3]]))


def test_time_cost_refuses_the_meta_device() -> None:
    with torch.device("meta"):
        meta_model = small_model()
        meta_sample = torch.empty(2, 4)
    with pytest.raises(ValueError, match=r"^time_cost runs the layers, but layer 0 \(Linear\) is on the meta device; "):
        time_cost(meta_model, torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"^time_cost runs the layers, but the sample is on the meta device"):
        time_cost(small_model(), meta_sample)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"repeats": 0}, r"^repeats=0 must be an int >= 1"),
        ({"repeats": 2.5}, r"^repeats=2\.5 must be an int >= 1"),
        ({"warmup": -1}, r"^warmup=-1 must be an int >= 0"),
    ],
)
def test_time_cost_rejects_bad_repetitions(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        time_cost([nn.ReLU()], torch.randn(1), **kwargs)  # type: ignore[arg-type]


def test_memory_cost_of_a_linear_layer_is_exact() -> None:
    params = (4 * 8 + 8) * FLOAT32
    saved_input = 2 * 4 * FLOAT32  # for the weight's gradient; the weight it also saves is a parameter, not counted
    sample = torch.randn(2, 4)
    # parameters + gradients + Adam's two moments
    assert memory_cost([nn.Linear(4, 8)], sample) == [saved_input + 4 * params]
    assert memory_cost([nn.Linear(4, 8)], sample, optimizer_slots=1) == [saved_input + 3 * params]
    assert memory_cost([nn.Linear(4, 8)], sample, optimizer_slots=0) == [saved_input + 2 * params]
    # Frozen: no gradient, no optimizer state, and autograd keeps no input for a weight gradient nobody needs.
    frozen = nn.Linear(4, 8).requires_grad_(False)
    assert memory_cost([frozen], sample) == [params]


def test_memory_cost_grows_with_the_saved_activation() -> None:
    sample = torch.randn(2, 8)
    narrow, wide = memory_cost([RepeatTanh(1)], sample), memory_cost([RepeatTanh(4)], sample)
    assert narrow == [2 * 8 * FLOAT32]
    assert wide == [2 * 32 * FLOAT32]


def test_memory_cost_counts_buffers_and_running_statistics_once() -> None:
    # BatchNorm1d(8): 16 trainable parameters (x4 with gradient and Adam), running mean, var (8 floats each) and the
    # int64 batch counter; it saves its input and the per-feature mean and inverse std for backward.
    bn = nn.BatchNorm1d(8)
    expected = 16 * FLOAT32 * 4 + (8 + 8) * FLOAT32 + 8 + (2 * 8 + 8 + 8) * FLOAT32
    assert memory_cost([bn], torch.randn(2, 8)) == [expected]
    assert bn.num_batches_tracked == 0


def test_memory_cost_counts_a_shared_parameter_once() -> None:
    sample = torch.randn(3, 4)
    saved_input = 3 * 4 * FLOAT32
    assert memory_cost(tied_model(), sample) == [saved_input + 20 * FLOAT32 * 4, saved_input + 4 * FLOAT32 * 4]


def test_memory_cost_on_the_meta_device_matches_cpu() -> None:
    with torch.device("meta"):
        model = small_model()
        sample = torch.empty(2, 4)
    assert memory_cost(model, sample) == memory_cost(small_model(), torch.randn(2, 4))


def test_memory_cost_rejects_negative_optimizer_slots() -> None:
    with pytest.raises(ValueError, match=r"^optimizer_slots=-1 must be a non-negative number, e.g. 2 for Adam"):
        memory_cost([nn.Linear(1, 1)], torch.randn(1, 1), optimizer_slots=-1)


def test_layer_costs_default_is_analytic() -> None:
    model = small_model()
    sample = torch.randn(2, 4)
    assert layer_costs(model) == param_cost(model)
    assert layer_costs(model, sample=sample) == flops_cost(model, sample)


def test_layer_costs_dispatch() -> None:
    model = small_model()
    sample = torch.randn(2, 4)
    assert layer_costs(model, "params") == param_cost(model)
    assert layer_costs(model, "flops", sample) == flops_cost(model, sample)
    assert layer_costs(model, "memory", sample) == memory_cost(model, sample)
    assert len(layer_costs(model, "time", sample)) == len(model)
    assert layer_costs(model, lambda layer: len(list(layer.parameters()))) == [2.0, 0.0, 2.0, 0.0, 2.0]
    assert COST_SOURCES == ("params", "flops", "time", "memory")


def test_layer_costs_rejects_an_unknown_source() -> None:
    with pytest.raises(
        ValueError,
        match=r"^unknown cost source 'parameters'; use one of 'params', 'flops', 'time', 'memory', or a callable",
    ):
        layer_costs(small_model(), "parameters")
    with pytest.raises(TypeError, match=r"^the cost source must be a name or a callable cost\(layer\), got 3 \(int\)$"):
        layer_costs(small_model(), 3)  # type: ignore[arg-type]


@pytest.mark.parametrize("how", ["flops", "time", "memory"])
def test_layer_costs_needs_a_sample_to_run_the_layers(how: str) -> None:
    with pytest.raises(
        ValueError, match=rf"^cost source '{how}' runs the layers, so it needs a sample input; pass one micro-batch"
    ):
        layer_costs(small_model(), how)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_layer_costs_rejects_a_bad_cost_from_a_callable(bad: float) -> None:
    def cost(layer: nn.Module) -> float:
        return bad if isinstance(layer, nn.BatchNorm1d) else 1.0

    with pytest.raises(
        ValueError,
        match=rf"^the cost function returned {bad!r} for layer 2 \(BatchNorm1d\); costs must be non-negative and fin",
    ):
        layer_costs(small_model(), cost)


def test_layer_costs_rejects_a_non_number_from_a_callable() -> None:
    with pytest.raises(
        TypeError, match=r"^the cost function returned 'x' \(str\) for layer 0 \(Linear\), not a number$"
    ):
        layer_costs(small_model(), lambda layer: "x")  # type: ignore[arg-type,return-value]


@RunIf(gpu=True)
def test_cost_sources_on_cuda() -> None:
    model = small_model().cuda()
    sample = torch.randn(4, 4, device="cuda")
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    cuda_rng = torch.cuda.get_rng_state()
    # Only the analytic part is compared: CUDA's dropout and cuDNN's BatchNorm save other tensors than the CPU kernels.
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    assert memory_cost(mlp.cuda(), sample) == memory_cost(mlp.cpu(), sample.cpu())
    assert len(memory_cost(model, sample)) == len(model)
    assert flops_cost(model, sample) == flops_cost(small_model(), sample.cpu())
    costs = time_cost(model, sample, repeats=2, warmup=1)
    assert len(costs) == len(model)
    assert all(cost > 0 for cost in costs)
    assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name


class _DeviceProbe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.seen: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.device.type)
        return self.linear(x)


def test_strategy_measures_costs_on_the_stages_device() -> None:
    # R19: balance="time"/"memory" measured the CPU copy of the model before it moved to the GPU. The meta device
    # stands in for the GPU here (memory_cost runs there): the measurement must see it, the model must stay put.
    from lightning_gpipe.partition.assembly import measured_costs

    sequence = nn.Sequential(_DeviceProbe(), nn.Tanh(), nn.Linear(4, 2))
    on_device = measured_costs(sequence, "memory", torch.randn(3, 4), torch.device("meta"))
    assert sequence[0].seen == []  # the user's layers are untouched; a copy was measured
    assert next(sequence.parameters()).device.type == "cpu"
    assert on_device == measured_costs(sequence, "memory", torch.randn(3, 4), torch.device("cpu"))
    assert sequence[0].seen == ["cpu", "cpu"]  # the CPU run does use the layers themselves
