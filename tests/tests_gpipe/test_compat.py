"""The private Lightning, torchmetrics and torch things the package relies on exist and behave as assumed.

Every such use sits in ``lightning_gpipe/compat.py`` (Lightning layer) or ``lightning_gpipe/engine/torch_compat.py``
(engine). An upgrade that changes one of them fails here first, naming the supported versions.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
from typing import Any

import lightning as L
import lightning.pytorch.trainer.connectors.logger_connector.result as lightning_result
import pytest
import torch
import torchmetrics
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from packaging.version import Version

from lightning_gpipe import compat
from lightning_gpipe.engine import torch_compat

HINT = f"lightning_gpipe.compat supports {compat.SUPPORTED}: update compat.py for this version"


def test_the_installed_versions_are_the_supported_ones() -> None:
    lightning, metrics = Version(L.__version__), Version(torchmetrics.__version__)
    assert Version("2.5") <= lightning < Version("2.7"), f"lightning {lightning}: {HINT}"
    assert Version("1.4") <= metrics < Version("2.0"), f"torchmetrics {metrics}: {HINT}"


def test_lightnings_private_names_have_the_signatures_used() -> None:
    assert callable(compat.StrategyRegistry().register), HINT
    connect = inspect.signature(compat.init_dist_connection).parameters
    assert list(connect)[:2] == ["cluster_environment", "torch_distributed_backend"], HINT
    assert any(p.kind is p.VAR_KEYWORD for p in connect.values()), HINT  # timeout, device_id: init_process_group
    assert "reduce_op" in inspect.signature(compat.sync_ddp_if_available).parameters, HINT
    assert list(inspect.signature(compat.optimizers_to_device).parameters)[:2] == ["optimizers", "device"], HINT
    assert "start_method" in inspect.signature(compat.MultiProcessingLauncher).parameters, HINT
    # The fork and spawn launcher overrides these two (lightning_gpipe/launcher.py) and builds what a worker returns.
    collect = inspect.signature(compat.MultiProcessingLauncher._collect_rank_zero_results).parameters
    assert list(collect) == ["self", "trainer", "results"], HINT
    recover = inspect.signature(compat.MultiProcessingLauncher._recover_results_in_main_process).parameters
    assert list(recover) == ["self", "worker_output", "trainer"], HINT
    output = compat.worker_output("best", None, "state", "results", {"extra": 1})
    assert (output.best_model_path, output.weights_path, output.trainer_results) == ("best", None, "results"), HINT
    assert compat.default_process_group_backend(torch.device("cpu")) == "gloo", HINT
    assert not compat.distributed_is_initialized(), HINT
    plain = torch.ones(2)
    assert compat.sync_ddp_if_available(plain, None, reduce_op="mean") is plain, HINT  # no process group: as is


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_running_loader_is_the_one_fit_reads() -> None:
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2)
    seen: list[Any] = []

    class Probe(L.Callback):
        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            seen.append(compat.running_loader(trainer))

    trainer = L.Trainer(
        max_steps=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Probe()],
    )
    trainer.fit(_Tiny(), loader)
    assert seen == [loader], HINT


def test_a_recorded_log_calls_the_recorder_and_restores_the_method() -> None:
    module = L.LightningModule()
    calls: list[tuple[Any, ...]] = []
    with compat.recording_log(module, lambda *args, **kwargs: calls.append((args, kwargs))):
        module.log("loss", 1.0, batch_size=3)
        module.log_dict({"other": 2.0})  # log_dict goes through self.log
    assert calls[0] == (("loss", 1.0), {"batch_size": 3}), HINT
    assert calls[1][1]["name"] == "other", HINT  # log_dict calls self.log(name=..., value=..., ...)
    assert "log" not in module.__dict__, HINT
    assert {"batch_size", "sync_dist", "on_step"} <= set(inspect.signature(L.LightningModule.log).parameters), HINT


def test_replaced_clipping_is_what_norm_clipping_runs() -> None:
    plugin = Precision()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    calls: list[tuple[Any, float]] = []
    compat.replace_clipping(plugin, lambda opt, value: calls.append((opt, value)))
    plugin.clip_gradients(optimizer, 0.5, GradClipAlgorithmType.NORM)
    assert calls == [(optimizer, 0.5)], HINT


def test_a_metrics_step_value_and_state_can_be_read_and_restored() -> None:
    source, target = torchmetrics.MeanMetric(), torchmetrics.MeanMetric()
    assert compat.metric_step_value(source) is None, HINT
    source(torch.tensor([1.0, 3.0]))
    assert compat.metric_step_value(source).item() == 2.0, HINT  # the call's own value
    source(torch.tensor([5.0]))
    assert source.update_count == 2, HINT  # public since torchmetrics 1.x; read without the private name
    target(torch.tensor([100.0]))
    target.compute()  # a cached result, which loading must drop
    compat.load_metric_state(target, dict(source.metric_state), source.update_count, torch.tensor(7.0))
    assert target.compute().item() == pytest.approx(3.0), HINT
    assert target.update_count == 2, HINT
    assert compat.metric_step_value(target).item() == 7.0, HINT
    compat.set_metric_step_value(target, torch.tensor(8.0))
    assert compat.metric_step_value(target).item() == 8.0, HINT
    # Lightning logs a Metric's step value from the same attribute.
    assert "_forward_cache" in inspect.getsource(lightning_result), HINT


def test_torch_private_helpers_behave_as_assumed() -> None:
    hint = f"torch {torch.__version__}: update lightning_gpipe/engine/torch_compat.py"
    tensors = [torch.arange(3.0), torch.ones(2, 2)]
    flat = torch_compat.flatten_dense_tensors(tensors)
    assert flat.shape == (7,), hint
    back = torch_compat.unflatten_dense_tensors(flat, tensors)
    assert all(torch.equal(a, b) for a, b in zip(back, tensors, strict=True)), hint
    base = torch.ones(4)
    assert torch_compat.storage_key(base) == torch_compat.storage_key(base[1:]), hint
    assert torch_compat.storage_key(base) != torch_compat.storage_key(torch.ones(4)), hint
    assert callable(torch.distributed.distributed_c10d._abort_process_group), hint
    meta = torch.empty(4, device="meta")
    assert torch_compat.storage_key(meta) == torch_compat.storage_key(meta[1:]), hint
    assert torch_compat.storage_key(meta) != torch_compat.storage_key(torch.empty(4, device="meta")), hint
    fake = torch_compat.memoryless_tensor((2, 3), torch.bfloat16)
    assert (fake.shape, fake.dtype, fake.device.type) == ((2, 3), torch.bfloat16, "cpu"), hint


def test_a_fused_optimizers_infs_reach_the_scalers_agreement() -> None:
    # A fused optimizer unscales inside its own step; its found infs are checked by the private method the scaler
    # overrides, which must still run on that path.
    seen: list[dict[Any, torch.Tensor]] = []

    class Recording(torch_compat.InfAgreeingScaler):
        def agree(self, found: dict[Any, torch.Tensor]) -> None:
            seen.append(dict(found))

    parameter = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([parameter], lr=0.1, fused=True)
    scaler = Recording(device="cpu", init_scale=2.0)
    scaler.scale(parameter.sum()).backward()
    scaler.step(optimizer)
    assert len(seen) == 1, f"torch {torch.__version__}: update lightning_gpipe/engine/torch_compat.py"
    assert torch.allclose(parameter.detach(), torch.full((3,), 0.9))


def test_torch_private_classes_are_what_the_package_subclasses_and_checks() -> None:
    hint = f"torch {torch.__version__}: update lightning_gpipe/engine/torch_compat.py"
    nn = torch.nn
    for layer in (nn.BatchNorm1d(2), nn.BatchNorm2d(2), nn.BatchNorm3d(2), nn.SyncBatchNorm(2)):
        assert isinstance(layer, torch_compat.BatchNormBase), hint
        assert layer.track_running_stats, hint
        assert layer.running_mean is not None, hint
    assert not isinstance(nn.LayerNorm(2), torch_compat.BatchNormBase), hint
    assert not isinstance(nn.GroupNorm(1, 2), torch_compat.BatchNormBase), hint

    seen: list[str] = []

    class Ops(torch_compat.TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Ops():
        torch.ones(2) + 1
    assert any("add" in op for op in seen), hint


def _private_torch_names(path: pathlib.Path) -> list[str]:
    """The private torch names ``path`` imports or reads: a module or name with a leading underscore under torch."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names = [*node.module.split("."), *(alias.name for alias in node.names)]  # type: ignore[union-attr]
            found += [f"{node.module}: {name}" for name in names if name.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("torch._") or "._" in alias.name]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            chain = ast.unparse(node)
            if chain.split(".")[0] in ("torch", "nn", "dist", "F") and "(" not in chain:
                found.append(chain)
    return found


def test_torch_private_names_are_used_in_torch_compat_only() -> None:
    # Four modules of the engine, partition and plan layers used _BatchNorm and the profile imported
    # torch.utils._python_dispatch themselves, unchecked here; a torch upgrade could break them unnoticed.
    package = pathlib.Path(torch_compat.__file__).resolve().parents[1]
    uses = {
        str(path.relative_to(package)): names
        for path in sorted(package.rglob("*.py"))
        if path.name != "torch_compat.py" and (names := _private_torch_names(path))
    }
    assert not uses, f"private torch names outside engine/torch_compat.py: {uses}; import them from torch_compat"


def test_a_module_shows_the_device_mesh_it_is_given() -> None:
    module, mesh = L.LightningModule(), object()
    compat.set_device_mesh(module, mesh)  # type: ignore[arg-type]
    assert module.device_mesh is mesh, HINT
