"""Fits of two pipelines of two stages under ``data_parallel="ddp"`` and ``"fsdp"``, one process per rank.

``python -m helpers.jobs helpers.fsdp_job CONFIG.json`` runs every fit of the config (the runs of
:mod:`helpers.lightning_job`, with ``"data_parallel"``, ``"optimizer"`` and ``"model"`` among their keys) and writes,
per fit and rank, what the rank holds, each stage kept where it is after ``fit``:

- ``held-N-rankR.pt``: the rank's parameters gathered whole (``DTensor.full_tensor()``, stage by stage) at the start
  and at the end of training, how many elements of parameters, gradients and optimizer state the rank itself holds,
  its stage's state-dict keys and those it read from a pretrained checkpoint (``zoo.load_pretrained``);
- ``result-N.pt`` (rank 0): the whole model's state dict, gathered with ``trainer.strategy.gather_module()`` after
  ``fit`` (and the predictions, which run on the stages kept);
- ``predictions-N.pt`` (rank 0, with ``"predict"``): ``trainer.predict`` on the training data after ``fit``; with
  ``"decode"``: the language model's greedy continuations of :func:`helpers.zoo_job.prompts`.

``"measure_setup"`` records how much the peak RSS grew during setup (where the stage is allocated);
``"measure_steps": [N, ...]`` what each rank holds through those training steps (:class:`helpers.step_bytes.StepBytes`,
in ``step-I-rankR.json`` with the rank's stage), its gradients zeroed in place between steps as the planner assumes;
``"zoo"`` trains a zoo model's tiny configuration on its tiny batch instead (``"hf_causal_lm"`` or ``"llama_bf16"``: the
Hugging Face language model saved in the config's folder as ``NAME-source``, see :mod:`helpers.zoo_job`).
A run with ``"plan"`` (``AutoPlan``'s arguments) plans at setup; ``settings-N.json`` (rank 0) holds the settings each
fit resolved, ``data_parallel`` included, and ``"settings_of": N`` gives a later fit those of fit N explicitly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, Dataset

from benchmarks.strategy_memory.measure import pin_mmap_threshold, reset_peak, resident
from helpers.lightning_job import BATCH, SAMPLES, SequentialModule, dataset, trainer_for
from helpers.load_job import _recording_reads
from helpers.models import IN, OUT
from helpers.step_bytes import StepBytes, end_after_profiling
from helpers.tied_job import VOCAB, tied_lm, tokens
from helpers.whole import whole_module
from helpers.zoo_job import CAUSAL_LM, GENERATION, PROMPT_LENGTHS, Repeated, causal_lm, prompts
from helpers.zoo_tiny import tiny_batch, tiny_model
from lightning_gpipe.engine.sharding import is_sharded, local_shard, whole

WIDE = 1024  # the wide model's layers: 4 MiB of float32 each, so that a stage's allocation shows in the RSS
MEASURED = 512  # the measured model's width: 1 MiB layers, whose activations at a batch of 256 weigh as much


def wide() -> nn.Sequential:
    """Sixteen layers of 4 MiB (67 MiB of parameters): what setup allocates dwarfs the allocator's noise."""
    return nn.Sequential(nn.Linear(IN, WIDE), *[nn.Linear(WIDE, WIDE) for _ in range(14)], nn.Linear(WIDE, OUT))


def measured() -> nn.Sequential:
    """Two halves of four layers, 512 wide inside, 16 where they meet: a step's activations, gradients and gathered
    parameters all weigh megabytes, far above what Lightning allocates beside them, and what crosses the boundary
    (which the transport buffers) next to nothing."""
    W, narrow = MEASURED, 16
    return nn.Sequential(
        nn.Linear(IN, W), nn.Tanh(), nn.Linear(W, W), nn.Linear(W, narrow),
        nn.Linear(narrow, W), nn.Tanh(), nn.Linear(W, W), nn.Linear(W, OUT),
    )  # fmt: skip


def stack() -> nn.Sequential:
    """Sixteen layers of 1 MiB and next to no activations: where whole replicas' state decides whether a stage fits."""
    W = MEASURED
    return nn.Sequential(nn.Linear(IN, W), *[nn.Linear(W, W) for _ in range(14)], nn.Linear(W, OUT))


BUILDERS = {"tied": tied_lm, "wide": wide, "measured": measured, "stack": stack}
PRETRAINED = (CAUSAL_LM, "llama_bf16")  # language models read from a checkpoint saved in the config's folder


class Module(SequentialModule):
    """The strategy tests' module, with Adam (or SGD), on the mlp, a tied language model or the wide model."""

    def __init__(self, job: dict[str, Any]) -> None:
        model = job.get("model", "mlp")
        special = model in BUILDERS
        super().__init__("mlp" if special else model, job.get("batch_norm", False), job.get("meta", False) or special)
        self.model_name, self.job = model, job
        if special and not job.get("meta"):
            torch.manual_seed(0)
            self.layers = BUILDERS[model]()
        self.setup_growth = 0  # bytes of peak RSS that setup (the stage's allocation) added, for "measure_setup"
        self.gathered_dtypes: set[torch.dtype] = set()  # of the parameters the last stage's first layer computed with

    def configure_model(self) -> None:
        if self.layers is None and self.model_name in BUILDERS:
            self.layers = BUILDERS[self.model_name]()
        super().configure_model()

    def setup(self, stage: str) -> None:
        if self.job.get("measure_setup"):
            pin_mmap_threshold()  # freed tensors leave the RSS, whatever the fits before this one allocated
            self._rss_before = reset_peak()  # the peak RSS from here on is setup's

    def on_fit_start(self) -> None:
        if self.job.get("measure_setup"):
            self.setup_growth = resident()[1] - self._rss_before

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        output = self.layers(x)  # type: ignore[misc]
        weighted = next(layer for layer in self.layers.children() if any(True for _ in layer.parameters()))  # type: ignore[union-attr]
        self.gathered_dtypes |= {p.dtype for p in weighted.parameters()}  # gathered for the step: as computed with
        if self.model_name == "tied":
            loss = F.cross_entropy(output.reshape(-1, VOCAB), y.reshape(-1))
        else:
            loss = F.mse_loss(output, y)
        self.log("train_loss", loss, sync_dist=self.sync_dist)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.job.get("optimizer", "adam") == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.01)
        return super().configure_optimizers()

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        # A measured step keeps its gradients' memory between steps, as the planner counts them in the state.
        optimizer.zero_grad(set_to_none="measure_steps" not in self.job)


class Holdings(L.Callback):
    """At the start and the end of training: the rank's parameters whole, and the elements it holds itself."""

    def __init__(self, path: Path, read: list[str]) -> None:
        self.path, self.read = path, read
        self.start: dict[str, torch.Tensor] = {}
        self.stage_keys: list[str] = []

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.start = {name: whole(p.detach()).clone() for name, p in module.named_parameters()}
        self.stage_keys = list(module.state_dict())

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        parameters = dict(module.named_parameters())
        optimizer = trainer.optimizers[0]
        state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
        held = {
            "parameters": sum(local_shard(p).numel() for p in parameters.values()),
            "gradients": sum(local_shard(p.grad).numel() for p in parameters.values() if p.grad is not None),
            "optimizer": sum(local_shard(t).numel() for t in state),
        }
        whole_parameters = {name: whole(p.detach()).clone() for name, p in parameters.items()}  # stage by stage
        mesh = getattr(trainer.strategy, "_device_mesh", None)
        extras = {
            "sharded": sorted(name for name, p in parameters.items() if is_sharded(p)),
            "setup_growth": getattr(module, "setup_growth", 0),
            "gathered_dtypes": sorted(map(str, getattr(module, "gathered_dtypes", ()))),
            "mesh": None if mesh is None else (mesh["pipe"].mesh.tolist(), mesh["data"].mesh.tolist()),
            "module_mesh": module.device_mesh is mesh,
            "start": self.start,
            "stage_keys": self.stage_keys,
            "read": list(self.read),
        }
        torch.save({"parameters": whole_parameters, "held": held, **extras}, self.path)


def fit(run: dict[str, Any], root: Path, index: int) -> L.LightningModule:
    L.seed_everything(0, verbose=False)
    read = _recording_reads() if run.get("zoo") in PRETRAINED else []  # what this rank reads from a checkpoint
    module, data = _module_and_data(run, root)
    if "plan" in run:  # plan="auto" profiles the sequence on a few rows of its input
        module.example_input_array = torch.randn(2, IN, generator=torch.Generator().manual_seed(1))
    options = {**run.get("options", {}), "data_parallel": run.get("data_parallel", "ddp")}
    # "16-mixed" on the CPU: Lightning would make it bf16, so the plugin is given with the GradScaler of a GPU's run.
    precision: dict[str, Any] = {"precision": run.get("precision", "32-true")}
    if precision["precision"] == "16-mixed":
        precision = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}
    trainer = trainer_for({**run, "options": options}, root, **precision)
    rank = trainer.strategy.global_rank
    trainer.callbacks.append(Holdings(root / f"held-{index}-rank{rank}.pt", read))
    measure = StepBytes(run["measure_steps"]) if "measure_steps" in run else None
    if measure is not None:
        trainer.callbacks.append(measure)
    batch_size = len(data) // run["steps"] if "zoo" in run else run.get("batch", BATCH)
    loader = DataLoader(data, batch_size=batch_size)
    validation = loader if run.get("limit_val_batches") else None
    trainer.fit(module, loader, validation)
    if measure is not None:
        record = {**measure.record(), "stage": trainer.strategy.layout.stage}  # type: ignore[attr-defined]
        (root / f"step-{index}-rank{rank}.json").write_text(json.dumps(record))
    if rank == 0:  # before predict, which clears them
        logged = {key: value.detach().cpu() for key, value in trainer.callback_metrics.items()}
        torch.save(logged, root / f"metrics-{index}.pt")
    if run.get("predict"):  # on the stages fit kept, sharded: each step gathers them and reshards them at its end
        predictions = trainer.predict(module, DataLoader(data, batch_size=BATCH))
        if rank == 0:
            torch.save(torch.cat(predictions), root / f"predictions-{index}.pt")  # type: ignore[arg-type]
    if run.get("decode"):  # greedy decoding: each token a further call of the sequence, relayed through the stages
        module.hparams["generation"] = GENERATION["greedy"]
        (tokens_out,) = trainer.predict(module, DataLoader(Repeated(prompts(), 1), batch_size=len(PROMPT_LENGTHS)))
        if rank == 0:
            torch.save(tokens_out, root / f"predictions-{index}.pt")
    return module


def _module_and_data(run: dict[str, Any], root: Path) -> tuple[L.LightningModule, Dataset]:
    name = run.get("zoo")
    if name is None:
        module = Module(run)
        module.sync_dist = run.get("sync_dist", False)
        return module, tokens() if run.get("model") == "tied" else dataset(run.get("samples", SAMPLES))
    zoo_module, batch = causal_lm(root, name=name) if name in PRETRAINED else (tiny_model(name), tiny_batch(name))
    return zoo_module, Repeated(batch, run["steps"])  # the same batch every step


def main(config_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    root = Path(config_path).parent
    chosen: list[dict[str, Any]] = []  # the settings each fit ran with (what plan="auto" chose)
    for index, run in enumerate(config["runs"]):
        if "settings_of" in run:  # the settings an earlier fit's plan chose, given explicitly
            run = {key: value for key, value in run.items() if key != "settings_of"} | chosen[run["settings_of"]]
        module = fit(run, root, index)
        settings = module.trainer.strategy.settings  # type: ignore[attr-defined]
        names = ("pipe_size", "chunks", "balance", "checkpoint", "schedule", "data_parallel")
        chosen.append({name: getattr(settings, name) for name in names})
        whole_trained = whole_module(module)  # on every rank: the sharded stages gather their shards
        if whole_trained is not None:
            torch.save(whole_trained.state_dict(), root / f"result-{index}.pt")
            (root / f"settings-{index}.json").write_text(json.dumps(chosen[-1]))
    if any("measure_steps" in run for run in config["runs"]):
        end_after_profiling()
