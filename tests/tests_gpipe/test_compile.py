"""Compiled stages (``compile=True``): the setting checked where given; layers compiled in place train like eager.

Both stages of a K = 2 pipeline are assembled in one process (as in ``test_assembly.py``), once eager and once
compiled, and trained with re-materialization of every micro-batch, uneven micro-batches, deferred BatchNorm, a tied
weight and a model built on the meta device. Compiling is slow on a CPU, so one module-scoped fixture trains both and
the tests read it. The strategy's multi-process run is in ``test_tied.py`` (its 2-rank job).
"""

from __future__ import annotations

import copy
import datetime
import pathlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_assembly import train_in_threads
from torch import nn
from torch._dynamo.utils import counters

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.engine.batchnorm import DeferredBatchNorm, commit_running_stats
from lightning_gpipe.engine.pipeline import run_in_threads
from lightning_gpipe.engine.rematerialization import CheckpointMode
from lightning_gpipe.engine.thread_transport import ThreadTransport
from lightning_gpipe.engine.torch_compat import compile_in_place, restore_compiled_call
from lightning_gpipe.partition.assembly import AssembledStage, assemble_stage
from lightning_gpipe.partition.compile import DEFAULT_OPTIONS, compile_layers, replayed_by_engine
from lightning_gpipe.partition.config import BuildConfig

WIDTH, OUT, BATCH, STEPS = 6, 3, 33, 2  # 33 rows in 8 micro-batches: 5, 4, ..., 4


class Block(nn.Module):
    """A user's layer (its forward is ours, so ``nn.Module.compile`` traces it) with a BatchNorm inside."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.linear(x)))


class Net(nn.Module):
    """torch's own layers and user blocks; layers 1 and 3 (both on stage 0) share one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(WIDTH, WIDTH), Block(), nn.Tanh(), nn.Linear(WIDTH, WIDTH), Block())
        self.layers[3].weight = self.layers[1].linear.weight  # type: ignore[union-attr]
        self.head = nn.Identity()


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH, generator=generator)


def _loss(output: torch.Tensor, microbatch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(output, microbatch[1])


@dataclass
class Trained:
    """One pipeline's stages after training, the whole module put back, and what compiling counted."""

    stages: list[AssembledStage]
    whole: nn.Module
    graphs: int
    compiled_before_reassembly: list[bool]


def _train(model: Net, compile: Any, checkpoint: CheckpointMode = "always") -> Trained:
    config = BuildConfig(
        pipe_size=2, chunks=8, balance=[4, 1], checkpoint=checkpoint, deferred_batch_norm=True, compile=compile
    )
    transports = ThreadTransport.create(2, timeout=datetime.timedelta(seconds=300))
    stages = [
        assemble_stage(copy.deepcopy(model), config.resolve(2, 1 - j), torch.device("cpu"), transports[j])
        for j in range(2)
    ]
    counters.clear()
    optimizers = [torch.optim.SGD(stage.partition.module.parameters(), lr=0.1) for stage in stages]
    for step in range(STEPS):
        train_in_threads(stages, _data(step))
        for stage, optimizer in zip(stages, optimizers, strict=True):
            stage.ties.sum_gradients()
            optimizer.step()
            optimizer.zero_grad()
            commit_running_stats(stage.partition.stand_in)
    graphs = counters["stats"]["unique_graphs"]
    compiled = [layer._compiled_call_impl is not None for stage in stages for layer in stage.stage.cell.children()]
    parts = [stage.partition.stage_state() for stage in stages]
    for stage in stages:
        stage.compiled.restore()  # what AssembledStage.reassemble does first; its gather needs a process group
    stages[0].partition.reassemble(parts, stages[0].ties.values())
    return Trained(stages, stages[0].partition.module, graphs, compiled)


@pytest.fixture(scope="module")
def trained() -> dict[str, Trained]:
    """The same model trained eager and compiled, built in place and on the meta device."""
    torch.manual_seed(0)
    model = Net()
    with torch.device("meta"):
        meta = Net()
    return {
        "eager": _train(model, False),
        "compiled": _train(model, True),
        "meta eager": _train(meta, False),
        "meta compiled": _train(meta, {"dynamic": False, "fullgraph": False}),
        # Compiled selective: each layer re-materializes itself inside its graph (the Blocks, holding BatchNorm,
        # under the engine's wrapper on their own), on every micro-batch, and trains alike.
        "selective compiled": _train(model, True, "selective"),
    }


def _assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)
    for key, value in expected.items():
        difference = (actual[key].double() - value.double()).abs().max().item()
        assert difference <= 1e-5, f"{key}: max abs difference {difference:.2e}"


@pytest.mark.heavy  # compiles about a dozen graphs: tens of seconds on a loaded CPU
@pytest.mark.timeout(600)
def test_compiled_stages_train_like_eager_stages(trained: dict[str, Trained]) -> None:
    assert trained["compiled"].graphs > 0, "nothing was compiled"  # the meta model's run reuses these graphs
    assert trained["eager"].graphs == trained["meta eager"].graphs == 0
    assert all(trained["compiled"].compiled_before_reassembly + trained["meta compiled"].compiled_before_reassembly)
    _assert_close(trained["compiled"].whole.state_dict(), trained["eager"].whole.state_dict())
    _assert_close(trained["meta compiled"].whole.state_dict(), trained["meta eager"].whole.state_dict())
    _assert_close(trained["selective compiled"].whole.state_dict(), trained["eager"].whole.state_dict())
    # Deferred BatchNorm gathered each micro-batch once, not again in the replays: it moved like eager's.
    assert trained["compiled"].whole.state_dict()["layers.1.norm.num_batches_tracked"].item() == STEPS
    assert trained["selective compiled"].whole.state_dict()["layers.1.norm.num_batches_tracked"].item() == STEPS


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_compiled_selective_layers_rematerialize_themselves_and_are_restored(trained: dict[str, Trained]) -> None:
    selective = trained["selective compiled"]
    # The stages wrap nothing: the engine's wrapper would see each compiled layer as one call and replay it whole.
    assert [stage.stage.checkpoint for stage in selective.stages] == ["never", "never"]
    assert all(selective.compiled_before_reassembly)
    layers = list(selective.whole.get_submodule("layers").children())
    assert [replayed_by_engine(layer) for layer in layers] == [False, True, False, False, True]  # the Blocks' norms
    assert list(selective.whole.state_dict()) == list(Net().state_dict())
    Net().load_state_dict(selective.whole.state_dict(), strict=True)
    assert all(layer._compiled_call_impl is None for layer in layers)


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_compiled_layers_keep_their_names_and_load_strictly_into_the_plain_module(
    trained: dict[str, Trained],
) -> None:
    plain = Net()
    compiled = trained["compiled"]
    for stage, eager_stage in zip(compiled.stages, trained["eager"].stages, strict=True):
        assert stage.names.keys == list(plain.state_dict())
        assert [n for n, _ in stage.stage.cell.named_parameters()] == [
            n for n, _ in eager_stage.stage.cell.named_parameters()
        ]
    state = compiled.whole.state_dict()
    assert list(state) == list(plain.state_dict())
    plain.load_state_dict(state, strict=True)
    assert plain.layers[3].weight is plain.layers[1].linear.weight  # type: ignore[union-attr]
    # Reassembly gives the user's module back as it was: no layer stays compiled on one rank only.
    assert isinstance(compiled.whole.layers, nn.Sequential)
    assert all(layer._compiled_call_impl is None for layer in compiled.whole.layers)
    assert not any(isinstance(m, DeferredBatchNorm) for m in compiled.whole.modules())


def test_a_layer_of_torchs_own_classes_is_compiled_too() -> None:
    # Dynamo skips frames in torch's files: nn.Module.compile() alone left an nn.Linear layer running eagerly.
    eager_backend = {"backend": "eager", "dynamic": False}  # traced by dynamo, no inductor: fast
    for layer in (nn.Linear(2, 2), Block()):
        names = list(layer.state_dict())
        counters.clear()
        previous = compile_in_place(layer, eager_backend)
        layer(torch.randn(3, layer.in_features if isinstance(layer, nn.Linear) else WIDTH))
        assert counters["stats"]["unique_graphs"] == 1, type(layer).__name__
        assert list(layer.state_dict()) == names
        restore_compiled_call(layer, previous)
        assert layer._compiled_call_impl is None


@pytest.mark.parametrize("norm", [DeferredBatchNorm, nn.BatchNorm1d])
def test_a_compiled_selective_layer_with_batch_norm_counts_its_statistics_once(norm: type[nn.Module]) -> None:
    # Deferred BatchNorm gathers eagerly, in a graph break: under a checkpoint inside the compiled layer the replay
    # gathered again (torch refused it: "aten.sub.Tensor encountered during backward but not found in storage").
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(WIDTH, WIDTH), norm(WIDTH), nn.GELU())
    eager = copy.deepcopy(layer)
    x, weights = torch.randn(5, WIDTH, requires_grad=True), torch.randn(5, WIDTH)
    compiled = compile_layers([layer], {"backend": "aot_eager", "dynamic": False}, selective=True)
    assert replayed_by_engine(layer)
    (layer(x) * weights).sum().backward()
    expected = x.grad
    x.grad = None
    (eager(x) * weights).sum().backward()
    compiled.restore()
    torch.testing.assert_close(expected, x.grad)
    for module in (layer, eager):
        commit_running_stats(module)
    torch.testing.assert_close(layer.state_dict(), eager.state_dict())
    assert layer.state_dict()["1.num_batches_tracked"].item() == 1


def test_a_compiled_selective_layer_starting_in_place_replays_from_its_input_as_it_was() -> None:
    # Inside the compiled checkpoint the replay found its input changed by the layer's ReLU(inplace=True): torch
    # raised "one of the variables needed for gradient computation has been modified by an inplace operation".
    torch.manual_seed(0)
    layer = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(WIDTH, WIDTH), nn.GELU())
    eager = copy.deepcopy(layer)
    x, weights = torch.randn(5, WIDTH, requires_grad=True), torch.randn(5, WIDTH)
    compiled = compile_layers([layer], {"backend": "aot_eager", "dynamic": False}, selective=True)
    (layer(x * 1) * weights).sum().backward()
    expected = x.grad
    x.grad = None
    (eager(x * 1) * weights).sum().backward()
    compiled.restore()
    torch.testing.assert_close(expected, x.grad)


def test_the_compile_setting_is_checked_where_given_with_the_fix() -> None:
    assert BuildConfig().compile is False
    assert BuildConfig().resolve(1, 0).compile is None
    assert BuildConfig(compile=True).resolve(1, 0).compile == DEFAULT_OPTIONS
    given = {"mode": "max-autotune-no-cudagraphs"}
    config = BuildConfig(compile=given)
    given["mode"] = "changed later"
    assert config.resolve(1, 0).compile == {"dynamic": False, "mode": "max-autotune-no-cudagraphs"}
    assert BuildConfig(compile={"dynamic": True}).resolve(1, 0).compile == {"dynamic": True}
    with pytest.raises(TypeError, match=r"compile='yes' must be True, False or a dict of torch.compile's keyword"):
        BuildConfig(compile="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'fullgrph' is not a keyword argument of torch.compile; use some of fullgr"):
        BuildConfig(compile={"fullgrph": True})
    with pytest.raises(ValueError, match=r"compile=\{'mode': 'fastest'\} is refused by torch.compile: Unrecognized"):
        BuildConfig(compile={"mode": "fastest"})
    with pytest.raises(ValueError, match=r"is refused by torch.compile: Invalid backend: 'nope'"):
        GPipeStrategy(compile={"backend": "nope"})  # the strategy's argument, refused when it is built
    assert GPipeStrategy(compile=True).config.compile is True


def test_compiled_layers_keep_their_saved_tensors_until_restored_and_only_then() -> None:
    # compile_layers turned torch's donated buffers off for the rest of the process, whatever ran after the stage.
    with torch._functorch.config.patch(donated_buffer=True):
        first = compile_layers([nn.Linear(2, 2)], {"dynamic": False})
        second = compile_layers([nn.Linear(2, 2)], {"dynamic": False})
        assert torch._functorch.config.donated_buffer is False
        first.restore()
        first.restore()  # a second restore gives back nothing more
        assert torch._functorch.config.donated_buffer is False  # the second stage's layers still run compiled
        second.restore()
        assert torch._functorch.config.donated_buffer is True
        compile_layers([nn.Linear(2, 2)], None).restore()  # nothing compiled: the setting is left alone
        assert torch._functorch.config.donated_buffer is True


@pytest.mark.heavy  # compiles a Transformer layer twice: about a minute on a loaded CPU
@pytest.mark.timeout(600)
def test_compiled_layers_train_under_a_split_backward(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # zero_bubble's input pass keeps the graph for the weight pass. A compiled layer whose backward was first compiled
    # by a backward that did not keep it (the first stage's, here another process's run) reused its saved buffers,
    # torch's compile cache handed that backward to the next process, and torch refused the kept-graph backward there
    # ("compiled with non-empty donated buffers"): make bench-schedules' compiled zero-bubble step failed so.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a cache of this test's own

    def layers() -> list[nn.Module]:
        torch.manual_seed(0)
        return [nn.TransformerEncoderLayer(16, 2, 64, dropout=0.0, batch_first=True) for _ in range(2)]

    x, y = torch.randn(8, 8, 16), torch.randn(8, 8, 16)
    # torch's default, which compile_layers turns off while its layers are compiled; patched, so that it is put back.
    with torch._functorch.config.patch(donated_buffer=True):
        first = layers()
        first_compiled = compile_layers(first, {"dynamic": False})
        # A plain backward compiles and caches each layer's backward, for a micro-batch that needs its input's gradient.
        nn.Sequential(*first)(x[:2].clone().requires_grad_(True)).sum().backward()
        torch._dynamo.reset()  # as a fresh process: compiled again, from the cache
        compiled, reference = layers(), nn.Sequential(*layers())
        compiled_layers = compile_layers(compiled, {"dynamic": False})
        cells = [nn.Identity(), nn.Sequential(*compiled)]  # compiled on the stage whose input needs a gradient
        x.requires_grad_(True)
        loss = lambda out, mb: F.mse_loss(out, mb[1])  # noqa: E731
        run_in_threads(cells, (x, y), loss, chunks=4, checkpoint="never", schedule="zero_bubble")
        first_compiled.restore()
        compiled_layers.restore()
        assert torch._functorch.config.donated_buffer is True
    F.mse_loss(reference(x), y).backward()
    for (name, got), want in zip(cells[1].named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6, msg=name)
