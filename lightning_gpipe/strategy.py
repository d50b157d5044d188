"""GPipeStrategy: Lightning's lifecycle around the GPipe engine, one process per pipeline stage.

Lightning's automatic optimization calls ``training_step``, then ``zero_grad``, then ``backward``. The step's actions
come from the engine's :class:`~lightning_gpipe.engine.step.StepRun`: those up to the schedule's last forward run in
``training_step``, the rest in ``backward``. Under fill-drain that is all M forwards, then all M backwards; under 1F1B
the backward passes among the forwards hold their gradients past ``zero_grad``
(:class:`~lightning_gpipe.engine.step.HeldGradients`). The user's ``training_step`` runs once per micro-batch with the
pipelined sequence standing in for ``self.<layers>``: on a stage that is not the last, the call ends as soon as the
cell's output has been sent on; on the last stage the user's code computes the loss as usual.
Data-parallel gradients are averaged once per optimizer step, inside the optimizer closure.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_gpipe.build.assembly import AssembledStage, assemble_stage
from lightning_gpipe.build.config import Balance, ResolvedPipeline
from lightning_gpipe.build.sequence import Partition, find_sequence
from lightning_gpipe.build.state_dict import (
    ModelNames,
    check_loadable,
    local_optimizer_state,
    merge_optimizer_states,
    merge_state_dicts,
    optimizer_state_by_name,
)
from lightning_gpipe.build.tied import TiedCopies
from lightning_gpipe.config import StartMethod, StrategyConfig
from lightning_gpipe.engine.anomaly import check_finite
from lightning_gpipe.engine.collectives import broadcast_object, portable, to_device
from lightning_gpipe.engine.errors import collective_errors
from lightning_gpipe.engine.fingerprint import batch_fingerprint
from lightning_gpipe.engine.gradients import WorldGradScaler, average_gradients, clip_grad_norm
from lightning_gpipe.engine.layout import ProcessLayout
from lightning_gpipe.engine.microbatch import Microbatch, batch_size, count_weights, gather, loss_weights, step_extras
from lightning_gpipe.engine.pipeline import Pipeline
from lightning_gpipe.engine.relay import CallRelay
from lightning_gpipe.engine.rematerialization import CheckpointMode
from lightning_gpipe.engine.schedule import Phase
from lightning_gpipe.engine.stage import Stage
from lightning_gpipe.engine.step import HeldGradients, StepRun
from lightning_gpipe.engine.timeline import Timeline
from lightning_gpipe.engine.transport import ProcessGroupTransport
from lightning_gpipe.log_mirror import LogRecorder, sync_metrics_over
from lightning_gpipe.plan.auto import (
    AutoPlan,
    agreed_settings,
    auto_plan,
    check_planned_batch,
    plan_for_module,
    planned_batch,
)

__all__ = ["GPipeStrategy"]

log = logging.getLogger(__name__)

_SAVE_ARRIVAL_TIMEOUT = datetime.timedelta(seconds=30)  # how long saving waits for every rank to arrive


class _StageDone(BaseException):
    """Ends the user's step on a stage that is not the last once its cell's output is sent.

    A ``BaseException`` so that a user's ``except Exception`` around the call does not swallow it.
    """


class GPipeStrategy(ParallelStrategy):
    """GPipe pipeline parallelism: the LightningModule's ``nn.Sequential`` split into ``pipe_size`` stages.

    Args:
        pipe_size: K, stages per pipeline; default: every process of the job in one pipeline. ``world_size / K``
            pipelines train as data-parallel replicas.
        chunks: M, micro-batches per mini-batch; default ``4 * K`` (the bubble is small when M >= 4K).
        balance: layers per stage (a list of K ints), or how to find it: ``"params"``, ``"flops"``, ``"time"``,
            ``"memory"`` or a callable ``cost(layer) -> float``. Default: ``"flops"`` when the module has an
            ``example_input_array``, else ``"params"``; both are analytic, so every run partitions the same way.
        checkpoint: re-materialization, ``"always"``, ``"except_last"`` (default) or ``"never"``.
        schedule: ``"gpipe"`` (fill-drain) or ``"1f1b"`` (one forward, one backward: the same gradients, and stage
            ``j`` holds at most ``min(K - j, M)`` micro-batches' activations).
        module_name: attribute (dotted path) of the ``nn.Sequential`` to pipeline; default: found automatically.
        deferred_batch_norm: move BatchNorm running statistics once per mini-batch, from all of its samples.
        timeout: how long a stage waits for a peer before it gives up (default 30 minutes).
        start_method: ``"popen"`` (default: re-run the script per rank, as DDP), or ``"fork"`` / ``"spawn"``;
            use ``"fork"`` in notebooks.
        process_group_backend: the ``torch.distributed`` backend; default ``"nccl"`` on CUDA, ``"gloo"`` on CPU.
        detect_anomalies: check every micro-batch's loss, each stage's outputs and the gradients it sends back for
            NaN and Inf, and stop with an error naming the stage and micro-batch where one first appears. Costs one
            device synchronization per checked tensor; off by default.
        verify_batches: check at every step that all stages of a pipeline read the same batch (shapes and a
            checksum travel with the step header, so it costs no extra message); on by default.
        plan: ``"auto"`` or an :class:`~lightning_gpipe.AutoPlan`: at setup, global rank 0 plans K, M, the
            balance, the checkpoint mode and the schedule with :func:`~lightning_gpipe.plan.plan` (the world size
            as the device count, the device's memory or the plan's budget, ``example_input_array`` as the sample,
            the DataLoader's ``batch_size`` as each pipeline's batch unless ``AutoPlan(batch_size=...)`` says
            another), logs the plan's table, and every rank follows it; a first training batch of another size is
            refused. The five settings it chooses must be left at their defaults; restrict its search with
            ``AutoPlan(pipe_sizes=..., chunks=..., ...)`` instead.
    """

    strategy_name = "gpipe"
    _links_on_world = False  # tests only: P2P on the world group, the wiring that deadlocks under NCCL's stream order

    def __init__(
        self,
        pipe_size: int | None = None,
        chunks: int | None = None,
        balance: Balance = None,
        checkpoint: CheckpointMode = "except_last",
        schedule: str = "gpipe",
        module_name: str | None = None,
        deferred_batch_norm: bool = False,
        *,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: datetime.timedelta = default_pg_timeout,
        start_method: StartMethod = "popen",
        detect_anomalies: bool = False,
        verify_batches: bool = True,
        plan: str | AutoPlan | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.config = StrategyConfig(
            pipe_size=pipe_size,
            chunks=chunks,
            balance=balance,
            checkpoint=checkpoint,
            schedule=schedule,
            module_name=module_name,
            deferred_batch_norm=deferred_batch_norm,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            detect_anomalies=detect_anomalies,
            verify_batches=verify_batches,
        )
        # Settled in setup, by _follow_plan; refused here beside the settings it would choose.
        self._auto_plan = auto_plan(
            plan, pipe_size=pipe_size, chunks=chunks, balance=balance, checkpoint=checkpoint, schedule=schedule
        )
        self._planned: dict[str, Any] = {}  # the settings the plan chose, in place of the config's
        self._settings: ResolvedPipeline | None = None  # the config resolved against the world, by set_world_ranks
        self._process_group_backend = self.config.process_group_backend  # resolved from the device in setup_environment
        self._num_nodes = 1
        self._pipeline_group: dist.ProcessGroup | None = None
        self._replica_group: dist.ProcessGroup | None = None
        self._object_group: dist.ProcessGroup | None = None
        self._links: list[dist.ProcessGroup] = []  # one group per pair of adjacent stages of this pipeline
        self._control_group: dist.ProcessGroup | None = None
        self._assembled: AssembledStage | None = None
        self._partition: Partition | None = None
        self._stage: Stage | None = None
        self._pipeline: Pipeline | None = None
        self._run: StepRun | None = None  # the step in progress
        self._held: HeldGradients | None = None  # what backward passes inside training_step computed
        self._calls: CallRelay | None = None
        self._relay: CallRelay | None = None  # set during evaluation steps, which may call the sequence again
        self._names = ModelNames(keys=[], shapes={}, parameter_order=[], aliases={})
        self._ties: TiedCopies | None = None
        self._losses: dict[int, Tensor] = {}  # the last stage's losses awaiting backward, weighted by then
        self._declared: Tensor | None = None  # the step's micro-batch weights from the module's batch_loss_weight
        self._failed = False
        self._sized: set[str] | None = set()  # the step hooks whose first batch was checked against chunks
        self._example_input: Any = None
        self._planned_batch: int | None = None  # plan="auto"'s batch per pipeline, until the first training batch
        self.timeline = Timeline(enabled=False)

    # ------------------------------------------------------------------ properties

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        """The number of machines (Lightning's ``num_nodes``); every node runs the same number of processes."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes on this node: one per device."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Always true: even one pipeline of one stage runs in a process group."""
        # Lightning reads this to honour `self.log(sync_dist=True)` and to inject the distributed sampler.
        return True

    @property
    def settings(self) -> ResolvedPipeline:
        """The configuration resolved against this run (K, M, this process's place, the plan's choice): what the rest
        reads. Resolved when Lightning sets the ranks, and under ``plan="auto"`` again once the plan is made."""
        if self._settings is None:
            self._settings = self.config.resolve(self.world_size, self.global_rank, self._planned)
        return self._settings

    @property
    def layout(self) -> ProcessLayout:
        """Which stage of which pipeline replica this process runs."""
        return self.settings.layout

    @property
    def pipe_size(self) -> int:
        """K, the number of stages per pipeline (before the Trainer sets the world: the one given)."""
        if self._settings is None:
            return self.config.pipe_size or self.world_size
        return self._settings.pipe_size

    @property
    def chunks(self) -> int:
        """M, the number of micro-batches per mini-batch (before the Trainer sets the world: the one given)."""
        if self._settings is None:
            return self.config.chunks or 4 * self.pipe_size
        return self._settings.chunks

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Data-parallel only: every stage of one pipeline must read the same samples.
        return {"num_replicas": self.layout.num_replicas, "rank": self.layout.replica}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Weights are loaded into the partitioned module, which exists only after setup.
        return True

    @property
    def process_group_backend(self) -> str | None:
        """The ``torch.distributed`` backend: the one given, else NCCL on CUDA and gloo on CPU, known after setup."""
        return self._process_group_backend

    # ------------------------------------------------------------------ launcher and environment

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.config.start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self.config.start_method)

    def set_world_ranks(self) -> None:
        """Tell the cluster environment this process's global rank and the world size; resolve the settings for them."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        self._settings = None
        if self._auto_plan is not None:
            return  # K is known once the plan is made, in setup (_follow_plan resolves the settings then)
        self._settings = self.config.resolve(self.world_size, self.global_rank, self._planned)  # checks the world

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        _check_backend_for_device(backend, self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, backend, timeout=self.config.timeout, device_id=device_id)
        if self._auto_plan is None:
            self._new_groups()

    def _new_groups(self) -> None:
        """The groups of the layout: pipelines, replicas, links, objects and control (collective over the world)."""
        backend = self._process_group_backend
        self._pipeline_group, self._replica_group, self._links = self.layout.new_groups(self.config.timeout)
        self._object_group = self._new_object_group()
        # A gloo group for checks that must give up after a while (monitored_barrier), whatever the backend.
        self._control_group = (
            dist.new_group(backend="gloo", timeout=self.config.timeout) if backend != "gloo" else dist.group.WORLD
        )

    def _new_object_group(self) -> dist.ProcessGroup | None:
        """A gloo group per pipeline for object collectives (the step's logs and loss, checkpoint parts, teardown).

        Objects are pickled to bytes; over NCCL those bytes are staged on the GPU, where gathering a checkpoint would
        hold K stages' parts at once on one device. Over gloo they stay in host memory. Every rank creates every
        pipeline's group, in the same order (``new_group`` is collective over the world).
        """
        if self._process_group_backend == "gloo":
            return self._pipeline_group
        mine = None
        for replica in range(self.layout.num_replicas):
            group = dist.new_group(self.layout.pipeline_ranks(replica), backend="gloo", timeout=self.config.timeout)
            if replica == self.layout.replica:
                mine = group
        return mine

    @contextlib.contextmanager
    @override
    def model_sharded_context(self) -> Iterator[None]:
        # Layers built in `configure_model` start on the meta device: each rank allocates only its own stage's.
        with torch.device("meta"):
            yield

    # ------------------------------------------------------------------ setup: partition, then Lightning's setup

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            raise ValueError(
                "GPipeStrategy supports automatic optimization only: the pipeline runs every micro-batch's forward in "
                "training_step and every backward in Lightning's backward. Set `self.automatic_optimization = True` "
                "(the default) and return the loss from training_step. For several optimizers, use one optimizer "
                "with parameter groups (e.g. torch.optim.AdamW([{'params': self.layers[:-1].parameters()}, "
                "{'params': self.layers[-1].parameters(), 'lr': 1e-3}]))."
            )
        if self._auto_plan is not None:
            self._follow_plan(module)
        self._partition_model(module)
        self.precision_plugin.convert_module(self.model)  # type: ignore[arg-type]
        self.model_to_device()
        self.timeline.device = self.root_device  # on a GPU, spans are timed with CUDA events
        if trainer.state.fn == TrainerFn.FITTING:
            self._setup_stage_optimizers(trainer, module)
        self.setup_precision_plugin()
        self._use_world_synced_scaler()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
            self._use_global_norm_clipping()

    def _follow_plan(self, module: LightningModule) -> None:
        """``plan="auto"``: plan on global rank 0, resolve its choice on every rank, then make the groups it needs."""
        request = self._auto_plan
        assert request is not None
        _, sequence = find_sequence(module, self.config.module_name)
        # Every rank reads the same loader's batch_size, so every rank can hold the first batch to it.
        batch = planned_batch(request, lambda: _run_loader(module.trainer))
        chosen = agreed_settings(
            lambda: plan_for_module(
                request,
                sequence,
                module.example_input_array,
                batch_size=batch,
                devices=self.world_size,
                device=self.root_device,
            ),
            rank=self.global_rank,
            broadcast=self.broadcast,
            report=rank_zero_info,
        )
        self._planned, self._auto_plan = chosen, None
        self._planned_batch = batch if module.trainer.state.fn == TrainerFn.FITTING else None
        self.set_world_ranks()
        self._new_groups()

    def _partition_model(self, module: LightningModule) -> None:
        if self._partition is not None:  # a second fit/validate on the same module
            return
        settings = self.settings
        links = None if self._links_on_world else self._links
        transport = ProcessGroupTransport(self.layout.pipeline_ranks(), self.root_device, settings.timeout, links=links)
        self._assembled = assembled = assemble_stage(
            module,
            settings,
            self.root_device,
            transport,
            sample=module.example_input_array,
            replica_group=self._replica_group,
            timeline=self.timeline,
        )
        if self._replica_group is not None:
            sync_metrics_over(module, self._replica_group)
        self._partition, self._pipeline, self._ties = assembled.partition, assembled.pipeline, assembled.ties
        self._stage = assembled.stage
        self._names = assembled.names
        # Lightning's model summary runs example_input_array through the module on rank 0 alone, outside any step,
        # which a partitioned module cannot do; it is set aside until teardown (the summary then omits sizes).
        self._example_input, module.example_input_array = module.example_input_array, None
        self._calls = CallRelay(self._stage)
        path, num_layers = assembled.partition.path, len(assembled.partition.original)
        self._describe_pipeline(
            path, num_layers, assembled.layers, assembled.stage_parameters, assembled.whole_parameters
        )

    def _describe_pipeline(
        self, path: str, num_layers: int, layers: list[int], parameters: tuple[int, int], whole: tuple[int, int]
    ) -> None:
        """Print, on global rank 0 and through Lightning's logger, which stage holds which layers and parameters.

        ``parameters`` and ``whole`` are (all, trainable) counts of this stage and of the unsplit module. Lightning's
        model summary runs on rank 0 and sees only its own stage; this table shows the whole pipeline.
        """
        layout = self.layout
        rows: list[Any] = [None] * self.world_size
        dist.all_gather_object(rows, (layout.replica, layout.stage, self.global_rank, layers, parameters))
        pipelines = "pipeline" if layout.num_replicas == 1 else "data-parallel pipelines"
        lines = [
            f"GPipe: {layout.num_replicas} {pipelines} of {layout.pipe_size} stages, up to chunks={self.chunks} "
            f"micro-batches per batch (a batch of N < {self.chunks} samples runs N); {path!r} has {num_layers} layers"
        ]
        for _replica, stage, rank, own, (count, trainable) in sorted(row for row in rows if row[0] == 0):
            lines.append(
                f"  stage {stage} (rank {rank}): layers {own[0]}-{own[-1]}, {count:,} parameters ({trainable:,} "
                "trainable)"
            )
        lines.append(
            f"  whole model: {whole[0]:,} parameters ({whole[1]:,} trainable); Lightning's model summary counts only "
            f"stage {layout.stage}, the one on rank {self.global_rank}"
        )
        rank_zero_info("\n".join(lines))

    def _setup_stage_optimizers(self, trainer: Trainer, module: LightningModule) -> None:
        # `configure_optimizers` runs on every stage with that stage's layers only. A stage whose layers are all frozen
        # (a frozen backbone split over several stages) gives an optimizer built from trainable parameters nothing,
        # and torch's error would not say which stage or why.
        assert self._partition is not None
        try:
            self.setup_optimizers(trainer)
        except RuntimeError as error:
            if "multiple optimizers" not in str(error):
                raise
            raise ValueError(
                f"{error} But GPipeStrategy supports automatic optimization only: use one optimizer with parameter "
                "groups instead, one group per set of layers (e.g. torch.optim.AdamW([{'params': "
                f"self.{self._partition.path}[:-1].parameters()}}, {{'params': self.{self._partition.path}[-1]"
                ".parameters(), 'lr': 1e-3}])); a group may be empty on a stage that holds none of its layers."
            ) from error
        except ValueError as error:
            if "empty parameter list" not in str(error):
                raise
            if any(p.requires_grad for p in module.parameters()):
                raise ValueError(
                    f"an optimizer of `configure_optimizers` got no parameters on stage {self.layout.stage} ({error}): "
                    f"each stage builds its optimizers from its own layers of {self._partition.path!r}, and this one's "
                    "layers are all elsewhere. Use one optimizer over all parameters with parameter groups (e.g. "
                    f"[{{'params': self.{self._partition.path}[-1].parameters(), 'lr': 1e-3}}, ...]): a group may be "
                    "empty on a stage."
                ) from error
            layers = self._partition.bounds[self.layout.stage]
            sizes = [len(bound) for bound in self._partition.bounds]
            raise ValueError(
                f"stage {self.layout.stage} (layers {layers[0]}-{layers[-1]} of {self._partition.path!r}) has no "
                f"trainable parameters, so `configure_optimizers` gave its optimizer none ({error}). Give every stage "
                f"a trainable layer with `balance=[...]` (layers per stage; now {sizes}), use fewer stages, or build "
                "the optimizer from all parameters (frozen ones are then simply not updated)."
            ) from error

    def _use_world_synced_scaler(self) -> None:
        """Make every stage skip the same steps and keep the same loss scale under ``precision="16-mixed"``.

        Each stage sees only its own gradients; a plain GradScaler would skip the step on the stage that found an
        inf while the others step, and their scales would drift apart. :class:`WorldGradScaler` agrees on the found
        infs over the world before deciding, with fused optimizers as well.
        """
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is None or isinstance(scaler, WorldGradScaler):
            return
        self.precision_plugin.scaler = WorldGradScaler.like(scaler, self.root_device.type)  # type: ignore[attr-defined]

    def _use_global_norm_clipping(self) -> None:
        group = self._pipeline_group if self.layout.pipe_size > 1 else None

        def clip_grad_by_norm(optimizer: torch.optim.Optimizer, clip_val: float) -> None:
            parameters = [p for group_ in optimizer.param_groups for p in group_["params"]]
            clip_grad_norm(parameters, clip_val, group, self._ties.duplicates() if self._ties is not None else ())

        self.precision_plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    # ------------------------------------------------------------------ steps

    @contextlib.contextmanager
    def _pipelined(self, microbatch: Microbatch) -> Iterator[dict[str, Any]]:
        """Route the user's call of the sequence for this micro-batch into the stage."""
        assert self._partition is not None
        assert self._stage is not None
        assert self._run is not None
        stage, step, stand_in = self._stage, self._run, self._partition.stand_in
        call: dict[str, Any] = {"count": 0}

        def run(value: Any) -> Any:
            call["count"] += 1
            if call["count"] > 1 and self._relay is not None:
                return self._relay.call(microbatch.index, value)  # decoding: only the last stage gets here
            if call["count"] > 1:
                raise RuntimeError(
                    "the step called the pipelined sequence twice for one batch; under GPipeStrategy each step "
                    "passes its input through the sequence exactly once (validation, test and predict steps may call "
                    "it again, e.g. to decode)"
                )
            output = step.forward(microbatch.index, value if stage.is_first else None)
            if not stage.is_last:
                raise _StageDone
            return output

        stand_in.runner = run
        try:
            yield call
        finally:
            stand_in.runner = None

    def _run_user_step(self, hook: str, microbatch: Microbatch, args: tuple, kwargs: dict) -> Any:
        module = self.lightning_module
        assert module is not None
        with self._pipelined(microbatch) as call:
            try:
                output = getattr(module, hook)(microbatch.value, *args, **kwargs)
            except _StageDone:
                return None
        if call["count"] == 0:
            raise RuntimeError(
                f"{hook} returned without calling the pipelined sequence {self._partition.path!r}"  # type: ignore[union-attr]
                "; GPipeStrategy pipelines that call, so every step must pass its input through it once"
            )
        return output

    def _forward_phase(
        self,
        hook: str,
        args: tuple,
        kwargs: dict,
        context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> tuple[list[Any], LogRecorder]:
        """Begin the step and run the schedule's actions up to its last forward, each forward a call of ``hook``.

        Returns the user's step outputs in micro-batch order (``None`` on a stage that is not the last) and the
        recorded logs. The backward passes the schedule runs before its last forward (``"1f1b"``) run here, their
        gradients held past Lightning's ``zero_grad`` (:class:`HeldGradients`); the rest run in :meth:`backward`.
        """
        assert self._pipeline is not None
        module = self.lightning_module
        assert module is not None
        batch, rest = args[0], args[1:]
        samples = batch_size(batch)
        if hook == "training_step" and self._planned_batch is not None:
            check_planned_batch(self._planned_batch, samples)
            self._planned_batch = None
        self._check_chunks(hook, samples)
        if samples < self.layout.pipe_size and module.training:
            raise ValueError(
                f"a batch of {samples} samples cannot fill {self.layout.pipe_size} pipeline stages; "
                "use a batch size of at least pipe_size (and drop_last=True if the last batch is smaller)"
            )
        # Every stage computes the fingerprint of its own copy of the batch; the step header carries it to the next.
        fingerprint = batch_fingerprint(batch) if self.config.verify_batches and self.layout.pipe_size > 1 else None
        training = hook == "training_step"
        self._run = run = self._pipeline.begin(batch, training=training, fingerprint=fingerprint)
        recorder = LogRecorder(module, step_values=training)
        outputs: list[Any] = []
        self._losses = {}
        try:
            # Known before the first forward, so every schedule can weigh a loss as soon as it is computed.
            self._declared = self._declared_weights(run.microbatches) if hook != "predict_step" else None
            early = run.backward_before_last_forward
            self._held = HeldGradients(module.parameters()) if early else None
            for action in run.actions[: run.forward_span]:
                mb = run.microbatches[action.microbatch]
                if action.phase is Phase.BACKWARD:
                    run.backward(mb.index, self._backward_loss(mb.index))
                    continue
                with context(), recorder.capture(mb.index):
                    outputs.append(self._run_user_step(hook, mb, rest, kwargs))
                if training and self._stage.is_last:  # type: ignore[union-attr]
                    self._losses[mb.index] = self._step_loss(mb, outputs[-1], early)
            if self._held is not None:
                self._held.hold()
        except BaseException as error:
            run.abort(repr(error))
            raise
        return outputs, recorder

    def _check_chunks(self, hook: str, samples: int) -> None:
        """Warn once when a hook's first batch has fewer samples than chunks (a later one may be an epoch's last)."""
        if self._sized is None or hook in self._sized:
            return
        self._sized.add(hook)
        if samples < self.chunks:
            self._sized = None  # warned: once is enough
            rank_zero_warn(
                f"chunks={self.chunks}, but the first {hook.removesuffix('_step')} batch holds {samples} samples and a "
                f"micro-batch holds at least one, so the step runs {samples} micro-batches of one sample, not "
                f"{self.chunks}. Set chunks={samples} (or fewer) to say so, or use batches of at least {self.chunks} "
                "samples."
            )

    def _declared_weights(self, microbatches: list[Microbatch]) -> Tensor | None:
        """The micro-batches' weights from the module's ``batch_loss_weight(batch)``, on the last stage; else None."""
        declare = getattr(self.lightning_module, "batch_loss_weight", None)
        if declare is None or not self._stage.is_last:  # type: ignore[union-attr]
            return None
        if not callable(declare):
            raise TypeError(
                f"batch_loss_weight is a {type(declare).__name__}; GPipeStrategy calls it as a method "
                "batch_loss_weight(batch) -> the number of elements the loss of `batch` averages over; rename it"
            )
        return count_weights([declare(mb.value) for mb in microbatches], self.root_device)

    def _loss_weights(self, outputs: list[Any], device: torch.device) -> Tensor:
        """Each micro-batch's share of the step's loss and logs: declared from its batch, returned, or by samples."""
        if self._declared is not None:
            return self._declared
        return loss_weights(outputs, self._run.microbatches, device)  # type: ignore[union-attr]

    def _step_loss(self, mb: Microbatch, output: Any, early: bool) -> Tensor:
        """The loss the user's step returned for ``mb``; weighted when ``early`` (declared weight, else samples)."""
        loss = output["loss"] if isinstance(output, Mapping) else output
        if not isinstance(loss, Tensor):
            raise TypeError(
                f"training_step returned {type(output).__name__}; under GPipeStrategy it must return the loss "
                "tensor or a dict with a 'loss' tensor for every batch"
            )
        if self.config.detect_anomalies:
            check_finite(self.layout.stage, mb.index, "the loss", loss)
        if isinstance(output, Mapping) and "loss_weight" in output:
            if self._declared is not None:
                raise ValueError(
                    f"training_step returned 'loss_weight' and {type(self.lightning_module).__name__} declares "
                    "batch_loss_weight(batch) too; say it once: drop 'loss_weight' from the step's output"
                )
            if early:
                raise ValueError(
                    f"training_step returned 'loss_weight' under schedule={self.settings.schedule!r}, which runs the "
                    "backward of micro-batch 0 before the forward of the last one, before the weights of all "
                    "micro-batches are known. Use schedule='gpipe', or declare the weight from the batch before the "
                    "schedule runs: a method batch_loss_weight(batch) on the LightningModule, without 'loss_weight'."
                )
        if not early:
            return loss
        return loss * (mb.weight if self._declared is None else self._declared[mb.index].to(loss.dtype))

    def _backward_loss(self, index: int) -> Tensor | None:
        """What the backward of micro-batch ``index`` starts from: its weighted loss on the last stage, scaled."""
        if not self._stage.is_last:  # type: ignore[union-attr]
            return None
        # Divided as Lightning divides the closure loss under accumulation; scaled as the closure loss would be.
        loss = self._losses.pop(index) / self.lightning_module.trainer.accumulate_grad_batches  # type: ignore[union-attr]
        scaler = getattr(self.precision_plugin, "scaler", None)
        return scaler.scale(loss) if scaler is not None else loss

    def _collective(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Turn the failure of a collective into an error that names this stage and what it was doing."""
        return collective_errors(self.layout.stage, what)

    def _share_from_last_stage(self, payload: Any) -> Any:
        """Send ``payload`` from the pipeline's last stage to its other stages."""
        if self.layout.pipe_size == 1:
            return payload
        source = self.layout.last_stage_rank
        # Sent on the CPU (pickled CUDA tensors would be restored on the sender's GPU), received onto this rank's.
        sent = portable(payload) if self.global_rank == source else None
        with self._collective(f"receiving the step's loss and logs from the last stage (global rank {source})"):
            received = broadcast_object(sent, source, self._object_group)
        return payload if self.global_rank == source else to_device(received, self.root_device)

    def _mirror_logs(
        self, recorder: LogRecorder, scalars: Mapping[str, Tensor] | None = None, other: Any = None
    ) -> tuple[dict[str, Tensor], Any]:
        """Log the last stage's step logs on every stage, and share ``scalars``, ``other`` and ``trainer.should_stop``.

        The last stage alone runs the user's code after the sequence's call, so a decision it takes there (e.g.
        ``self.trainer.should_stop = True`` in ``training_step``) reaches the other stages here, or they would wait
        for a batch that never comes. Returns ``(scalars, other)`` as the last stage gave them.
        """
        stage = self._stage
        assert stage is not None
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        if stage.is_last:
            # Share first: a `sync_dist=True` log runs world collectives, which the other stages join only once they
            # have the records to replay (logging first deadlocks, on gloo as on NCCL).
            if self.layout.pipe_size > 1:
                records, host = recorder.portable(scalars)
                self._share_from_last_stage((records, host, trainer.should_stop, other))
            recorder.replay_own()
            return dict(scalars or {}), other
        records, host, should_stop, other = self._share_from_last_stage(None)
        LogRecorder.replay(self.lightning_module, records)  # type: ignore[arg-type]
        trainer.should_stop = trainer.should_stop or should_stop
        return host, other

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._stage is not None
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        outputs, recorder = self._forward_phase("training_step", args, kwargs, self.precision_plugin.train_step_context)
        if not self._stage.is_last:
            scalars, extras = self._mirror_logs(recorder)
            return _with_extras(scalars["loss"].to(self.root_device, torch.float32), extras)
        run = self._run
        assert run is not None
        losses = [output["loss"] if isinstance(output, Mapping) else output for output in outputs]
        weights = self._loss_weights(outputs, losses[0].device)
        recorder.combine(weights)
        weighted = [loss * weight.to(loss.dtype) for loss, weight in zip(losses, weights, strict=True)]
        pending = {action.microbatch for action in run.remaining()}
        self._losses = {i: loss for i, loss in enumerate(weighted) if i in pending}
        total = torch.stack([loss.detach() for loss in weighted]).sum()
        # The step's other keys go to on_train_batch_end on every stage, as Lightning passes them on.
        extras = step_extras(outputs, [mb.size for mb in run.microbatches])
        self._mirror_logs(recorder, {"loss": total}, other=extras)
        return _with_extras(total.to(self.root_device), extras)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        module = self.lightning_module
        assert module is not None
        run = self._run
        assert run is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        try:
            if self._held is not None:
                self._held.release()
                self._held = None
            for action in run.remaining():  # the schedule's actions after its last forward: backward passes only
                run.backward(action.microbatch, self._backward_loss(action.microbatch))
            run.end()
        except BaseException as error:
            run.abort(repr(error))
            raise
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        replicas = self.layout.num_replicas

        def closure_then_average() -> Any:
            result = closure()
            parameters = [p for group in optimizer.param_groups for p in group["params"]]
            if self._ties is not None:
                with self._collective("summing the gradients of tied weights over the stages that share them"):
                    self._ties.sum_gradients()
            with self._collective(f"averaging gradients with the replicas of this stage {self.layout.replica_ranks()}"):
                average_gradients(parameters, self._replica_group, replicas)  # type: ignore[arg-type]
            return result

        return super().optimizer_step(optimizer, closure_then_average, model, **kwargs)

    def _eval_step(self, hook: str, args: tuple, kwargs: dict) -> Any:
        assert self._stage is not None
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        context = {
            "validation_step": self.precision_plugin.val_step_context,
            "test_step": self.precision_plugin.test_step_context,
            "predict_step": self.precision_plugin.predict_step_context,
        }[hook]
        with context():
            self._relay = self._calls
            try:
                outputs, recorder = self._forward_phase(hook, args, kwargs)
            finally:
                self._relay = None
        assert self._run is not None
        assert self._calls is not None
        try:
            # The last stage's steps may have called the sequence again (decoding): the others serve those calls.
            if self._stage.is_last:
                self._calls.finish()
            else:
                self._calls.serve()
            self._run.end()
        except BaseException as error:
            self._run.abort(repr(error))
            self._calls.abort(repr(error))
            raise
        gathered = None
        if self._stage.is_last:
            recorder.combine(self._loss_weights(outputs, self.root_device))
            sizes = [mb.size for mb in self._run.microbatches]
            gathered = gather(outputs, sizes) if outputs[0] is not None else None
        shared = self._mirror_logs(recorder, other=gathered if hook == "predict_step" else None)[1]
        return shared if hook == "predict_step" else gathered

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("predict_step", args, kwargs)

    # ------------------------------------------------------------------ collectives

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints

    def _gather_to_global_zero(self, part: Any) -> list[Any] | None:
        """Every stage's ``part`` on its pipeline's last-stage rank (global rank 0 for the first pipeline)."""
        if self.layout.pipe_size == 1:
            return [part]
        dst = self.layout.last_stage_rank
        parts: list[Any] | None = [None] * self.layout.pipe_size if self.global_rank == dst else None
        with self._collective(f"gathering the stages' parts on global rank {dst}"):
            dist.gather_object(portable(part), parts, dst=dst, group=self._object_group)
        return parts

    def gather_timeline(self) -> Timeline | None:
        """The spans every stage of the first pipeline recorded, merged on global rank 0 (``None`` elsewhere).

        A collective over each pipeline: call it on every rank. Recording is on while ``self.timeline.enabled``.
        """
        parts = self._gather_to_global_zero(self.timeline.to_records())
        return Timeline.merge(parts) if parts is not None and self.is_global_zero else None

    def _check_every_rank_saves(self) -> None:
        """Fail at once, with the fix, when ``trainer.save_checkpoint`` runs on some ranks only.

        Under DDP ``if trainer.is_global_zero: trainer.save_checkpoint(...)`` works, since rank 0 holds the whole
        model; here each stage holds its own part, so saving is a collective. The ranks meet in a barrier that gives
        up after a short wait and names the ranks that did not come, instead of a hang until ``timeout``.
        """
        if self.layout.pipe_size == 1 or self._control_group is None:
            return
        wait = min(self.config.timeout, _SAVE_ARRIVAL_TIMEOUT)
        try:
            dist.monitored_barrier(self._control_group, timeout=wait, wait_all_ranks=True)
        except RuntimeError as error:
            raise RuntimeError(
                f"trainer.save_checkpoint was called on global rank {self.global_rank}, but not on every rank within "
                f"{wait.total_seconds():.0f} s ({error}). Under GPipeStrategy every rank must call "
                "trainer.save_checkpoint, since the stages hold different parts of the model and optimizer: remove "
                "an `if trainer.is_global_zero:` guard around it (only global rank 0 writes the file)."
            ) from error

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        module = self.lightning_module
        assert module is not None
        self._check_every_rank_saves()
        local = {key: value.cpu() for key, value in module.state_dict().items()}
        parts = self._gather_to_global_zero(local)
        if parts is None:
            return local
        return merge_state_dicts(parts, self._names.keys)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        module = self.lightning_module
        assert module is not None
        local = optimizer_state_by_name(optimizer, module, self._names.aliases)
        local = _to_cpu(local)
        parts = self._gather_to_global_zero(local)
        if parts is None:
            return local
        return merge_optimizer_states(parts, self._names.parameter_order)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if not self.is_global_zero:
            return
        path = Path(filepath)
        if not isinstance(filepath, (str, os.PathLike)) or "://" in str(filepath):
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        # Write beside the target, then rename: a crash mid-write leaves the previous checkpoint intact.
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            self.checkpoint_io.save_checkpoint(checkpoint, temporary, storage_options=storage_options)
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # Loading a checkpoint never runs code from it.
        return self.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=True)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        assert module is not None
        assert self._partition is not None
        saved = checkpoint["state_dict"]
        check_loadable(saved, self._names.keys, self._names.shapes, strict)
        local_keys = module.state_dict().keys()
        module.load_state_dict({key: saved[key] for key in local_keys if key in saved}, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        module = self.lightning_module
        assert module is not None
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            optimizer.load_state_dict(
                local_optimizer_state(saved, optimizer, module, self._names.parameter_order, self._names.aliases)
            )
            _optimizers_to_device([optimizer], self.root_device)

    # ------------------------------------------------------------------ teardown

    @override
    def on_exception(self, exception: BaseException) -> None:
        # The other stages may be dead or blocked: teardown must not wait for them in a collective. Receives this stage
        # left posted would hold up the process group's destruction at exit (NCCL): abort the links that carry them.
        self._failed = True
        if self._stage is not None and isinstance(self._stage.transport, ProcessGroupTransport):
            self._stage.transport.abort_links()

    @override
    def teardown(self) -> None:
        """Put the whole model back together on every rank, so the user's module is complete after ``fit``.

        After a failure the module is left partitioned: reassembly needs every stage, and some may be gone.
        """
        if self._assembled is not None and _distributed_is_initialized() and not self._failed:
            module = self.lightning_module
            assert module is not None
            self._assembled.reassemble(self._object_group)
            module.example_input_array = self._example_input
            self._assembled = None
            self._partition = None
            self._stage = None
            self._calls = None
            self._ties = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            "gpipe", cls, description="GPipe pipeline parallelism over one process per stage", override=True
        )
        strategy_registry.register(
            "gpipe_notebook",
            cls,
            description="GPipe pipeline parallelism, processes forked (works in notebooks)",
            start_method="fork",
            override=True,
        )


def _run_loader(trainer: Trainer) -> Any:
    """The loader the running ``trainer.fit`` (or validate, test, predict) reads, as Lightning will request it."""
    loops: dict[TrainerFn | None, Any] = {
        TrainerFn.FITTING: trainer.fit_loop,
        TrainerFn.VALIDATING: trainer.validate_loop,
        TrainerFn.TESTING: trainer.test_loop,
        TrainerFn.PREDICTING: trainer.predict_loop,
    }
    loop = loops.get(trainer.state.fn)
    source = getattr(loop, "_data_source", None)  # Lightning's own record of where the loaders come from
    return source.dataloader() if source is not None and source.is_defined() else None


def _with_extras(loss: Tensor, extras: dict[str, Any] | None) -> Tensor | dict[str, Any]:
    return loss if extras is None else {"loss": loss, **extras}


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_cpu(item) for item in value]
    return value


def _check_backend_for_device(backend: str, device: torch.device) -> None:
    if backend == "gloo" and device.type == "cuda":
        raise ValueError(
            f"process_group_backend='gloo' cannot move the pipeline's tensors on {device}: gloo's send and receive "
            "take CPU tensors only. Use process_group_backend='nccl' (or leave it None to choose by device)."
        )
