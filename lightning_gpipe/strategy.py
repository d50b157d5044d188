"""GPipeStrategy: Lightning's lifecycle around the GPipe engine, one process per pipeline stage (or per few stages).

The step has one owner, :class:`~lightning_gpipe.user_step.UserSteps`, to which the step hooks delegate: the engine's
step driver runs its forward phase (each forward the user's ``training_step`` on one micro-batch) in ``training_step``
and its backward phase in ``backward``. Gradients go through :mod:`lightning_gpipe.optimization`, logs
:mod:`lightning_gpipe.log_mirror`, checkpoints :mod:`lightning_gpipe.checkpoint_io`, and ``plan="auto"``
:mod:`lightning_gpipe.plan.auto`.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_gpipe.checkpoint_io import StageCheckpoints
from lightning_gpipe.compat import (
    StrategyRegistry,
    SubprocessScriptLauncher,
    distributed_is_initialized,
    init_dist_connection,
    optimizers_to_device,
    running_loader,
    set_device_mesh,
    sync_ddp_if_available,
)
from lightning_gpipe.config import StartMethod, StateDictType, StrategyConfig, eager_selective_advice
from lightning_gpipe.engine.errors import collective_errors
from lightning_gpipe.engine.layout import ProcessLayout, StageGroups, new_stage_groups
from lightning_gpipe.engine.relay import CallRelay
from lightning_gpipe.engine.rematerialization import CheckpointMode
from lightning_gpipe.engine.stage import Stage
from lightning_gpipe.engine.timeline import Timeline
from lightning_gpipe.engine.transport import ProcessGroupTransport
from lightning_gpipe.launcher import StagesToLauncher
from lightning_gpipe.log_mirror import sharing_from_last_stage, sync_metrics_over
from lightning_gpipe.optimization import StageGradients, setup_stage_optimizers
from lightning_gpipe.partition.assembly import (
    AssembledStage,
    assemble_stage,
    refuse_a_cut_module,
    register_release,
    take_over_cut,
)
from lightning_gpipe.partition.config import Balance, DataParallel, ResolvedPipeline
from lightning_gpipe.partition.discovery import find_sequence
from lightning_gpipe.partition.fsdp import mixed_precision
from lightning_gpipe.partition.reader import WeightsReader, claim_reader
from lightning_gpipe.partition.state_dict import ModelNames
from lightning_gpipe.plan.auto import AutoPlan, auto_plan, planned_settings
from lightning_gpipe.summary import describe_pipeline
from lightning_gpipe.user_step import BatchChecks, UserSteps, check_automatic_optimization

__all__ = ["GPipeStrategy"]

log = logging.getLogger(__name__)


class GPipeStrategy(ParallelStrategy):
    """GPipe pipeline parallelism: the LightningModule's ``nn.Sequential`` split into ``pipe_size`` stages.

    The user guide (docs/guide/strategy.md, "Arguments") describes each argument in full.

    Args:
        pipe_size: K, stages per pipeline; default: every process in one pipeline (``world_size / K`` replicas).
        chunks: M, micro-batches per mini-batch; default ``4 * K``.
        balance: layers per stage (K ints), or ``"params"``, ``"flops"``, ``"time"``, ``"memory"`` or a callable
            ``cost(layer) -> float``; default ``"flops"`` with an ``example_input_array``, else ``"params"``.
        checkpoint: re-materialization: ``"always"``, ``"except_last"`` (default), ``"selective"`` or ``"never"``.
        schedule: ``"gpipe"`` (fill-drain), ``"1f1b"`` (the same gradients in less activation memory),
            ``"zero_bubble"`` (ZB-H1: 1F1B with each backward split, its weight gradients deferred into the bubble),
            ``"interleaved"`` (``virtual_stages`` stages per process) or ``"zbv"`` (two stages per process in a V).
        module_name: attribute (dotted path) of the ``nn.Sequential`` to pipeline; default: found automatically.
        deferred_batch_norm: move BatchNorm running statistics once per mini-batch, from all of its samples.
        virtual_stages: v, the stages each process holds under ``schedule="interleaved"`` (2 or more; process ``r``
            the stages ``r, r + K, ...``); ``balance`` then counts ``K * v`` stages.
        timeout: how long a stage waits for a peer before it gives up (default 30 minutes).
        start_method: ``"popen"`` (default, as DDP), or ``"fork"`` / ``"spawn"``; use ``"fork"`` in notebooks.
        process_group_backend: default ``"nccl"`` on CUDA, ``"gloo"`` on CPU.
        detect_anomalies: stop at the first NaN or Inf, naming its stage and micro-batch; off by default.
        verify_batches: check at every step that all stages of a pipeline read the same batch; on by default.
        plan: ``"auto"`` or an :class:`~lightning_gpipe.AutoPlan`: rank 0 plans K, M, balance, checkpoint, schedule
            and data_parallel at setup, every rank follows it (docs/guide/planning.md); leave those at their defaults.
        compile: ``torch.compile`` each layer of each stage in place: ``True`` or a dict of its keyword arguments.
        data_parallel: how the replicas of a stage share it: ``"ddp"`` (default: each holds it whole) or ``"fsdp"``
            (each holds a shard of every parameter, its gradient and its optimizer state; docs/guide/fsdp.md).
        state_dict_type: ``"full"`` (default: one file, written by global rank 0 as the stages send their tensors) or
            ``"sharded"`` (a ``torch.distributed.checkpoint`` directory, each rank writing its own stage).
    """

    strategy_name = "gpipe"

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
        virtual_stages: int = 1,
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
        compile: bool | dict[str, Any] = False,
        data_parallel: DataParallel = "ddp",
        state_dict_type: StateDictType = "full",
    ) -> None:
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
        )  # fmt: skip
        self.config = StrategyConfig(  # every setting checked here, where it is given
            pipe_size=pipe_size, chunks=chunks, balance=balance, checkpoint=checkpoint, schedule=schedule,
            module_name=module_name, deferred_batch_norm=deferred_batch_norm, virtual_stages=virtual_stages,
            process_group_backend=process_group_backend, timeout=timeout, start_method=start_method,
            detect_anomalies=detect_anomalies, verify_batches=verify_batches, compile=compile,
            data_parallel=data_parallel, state_dict_type=state_dict_type,
        )  # fmt: skip
        self._auto_plan = auto_plan(plan, self.config)  # settled in setup, by _follow_plan
        self._planned: dict[str, Any] = {}  # the settings the plan chose, in place of the config's
        self._settings: ResolvedPipeline | None = None  # the config resolved against the world, by set_world_ranks
        self._process_group_backend = self.config.process_group_backend  # resolved from the device in setup_environment
        self._num_nodes = 1
        self._groups: StageGroups | None = None  # pipelines, replicas, links, objects, control: by _new_groups
        self._device_mesh: DeviceMesh | None = None  # ("pipe", "data"), under data_parallel="fsdp"
        self._assembled: AssembledStage | None = None  # this process's stage of the module, its partition and ties
        self._reader: WeightsReader | None = None  # the module's pretrained weights, claimed in connect
        self._stages: tuple[Stage, ...] = ()  # this process's stages, in model order
        self._steps: UserSteps | None = None  # the Lightning-side step: the user's hooks over micro-batches
        self._gradients: StageGradients | None = None
        self._names = ModelNames(keys=[], shapes={}, parameter_order=[], aliases={})
        self._example_input: Any = None
        self._batches = BatchChecks()  # each step's batch checked (plan="auto"'s batch size among others)
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
        return self._settings.pipe_size if self._settings is not None else self.config.sizes(self.world_size)[0]

    @property
    def chunks(self) -> int:
        """M, the number of micro-batches per mini-batch (before the Trainer sets the world: the one given)."""
        return self._settings.chunks if self._settings is not None else self.config.sizes(self.world_size)[1]

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
            self._launcher = SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = StagesToLauncher(self, start_method=self.config.start_method)

    def set_world_ranks(self) -> None:
        """Tell the cluster environment this process's global rank and the world size; resolve the settings for them."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        if self._auto_plan is not None:
            self._settings = None
            return  # K is known once the plan is made, in setup (_follow_plan resolves the settings then)
        # Lightning's connector and setup_environment both call this: resolve (and warn) once per world and rank.
        known = self._settings.layout if self._settings is not None else None
        if known is None or (known.world_size, known.rank) != (self.world_size, self.global_rank):
            self._settings = self.config.resolve(self.world_size, self.global_rank, self._planned)  # checks the world

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        self._process_group_backend = backend = self.config.backend_for(self.root_device)
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        init_dist_connection(self.cluster_environment, backend, timeout=self.config.timeout, device_id=device_id)
        if self._auto_plan is None:
            self._new_groups()

    def _new_groups(self) -> None:
        """The groups of the layout: pipelines, replicas, links, objects and control (collective over the world)."""
        self._groups = groups = new_stage_groups(self.layout, self._process_group_backend, self.config.timeout)
        if self.settings.data_parallel == "fsdp":  # made of the groups above: the replicas shard over "data"
            self._device_mesh = self.layout.device_mesh(self.root_device.type, groups.pipeline, groups.replicas)
            if self.lightning_module is not None:
                set_device_mesh(self.lightning_module, self._device_mesh)

    @override
    def connect(self, model: Any) -> None:
        super().connect(model)
        # Before configure_model, which would have a module with a weights reader read everything: each stage reads
        # its own tensors once the module is cut (assemble_stage).
        self._reader = claim_reader(model) or self._reader

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
        check_automatic_optimization(module)
        if self._auto_plan is not None:
            self._follow_plan(module)
        assembled = self._partition_model(module)
        self.precision_plugin.convert_module(self.model)  # type: ignore[arg-type]
        self.model_to_device()
        self.timeline.device = self.root_device  # on a GPU, spans are timed with CUDA events
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            setup_stage_optimizers(self.setup_optimizers, trainer, module, assembled.partition)
            advice = eager_selective_advice(self.settings, self.root_device)
            if advice is not None:
                rank_zero_warn(advice)
        self.setup_precision_plugin()
        groups, sharded = self._stage_groups(), self.settings.data_parallel == "fsdp"
        self._gradients = StageGradients(self.layout, groups.pipeline, groups.replicas, assembled.ties, sharded)
        self._gradients.install(self.precision_plugin, self.root_device, fitting)
        if fitting:
            optimizers_to_device(self.optimizers, self.root_device)

    def _stage_groups(self) -> StageGroups:
        assert self._groups is not None, "the groups are made in setup_environment, or by _follow_plan"
        return self._groups

    def _follow_plan(self, module: LightningModule) -> None:
        """``plan="auto"``: plan on global rank 0, resolve its choice on every rank, then make the groups it needs."""
        assert self._auto_plan is not None
        _, sequence = find_sequence(module, self.config.module_name)
        self._planned, batch = planned_settings(
            self._auto_plan, sequence, module.example_input_array, loader=lambda: running_loader(module.trainer),
            devices=self.world_size, device=self.root_device, compiled=self.config.compile is not False,
            rank=self.global_rank, broadcast=self.broadcast, report=rank_zero_info,
        )  # fmt: skip
        self._auto_plan, self._settings = None, None
        self._batches.planned = batch if module.trainer.state.fn == TrainerFn.FITTING else None
        self.set_world_ranks()
        self._new_groups()

    def _partition_model(self, module: LightningModule) -> AssembledStage:
        """Build this process's stage of ``module`` (once: a second fit or validate keeps it) and the user's steps."""
        if self._assembled is not None:
            return self._assembled
        balance = take_over_cut(module, self.settings)  # cut alike by another Trainer's strategy: each rank keeps its
        if balance is not None:  # layers, nothing moves
            self._planned, self._settings = {**self._planned, "balance": balance}, None
        ranks, timeout, groups = self.layout.stage_ranks(), self.settings.timeout, self._stage_groups()
        transport = ProcessGroupTransport.for_stages(
            ranks, self.layout.stages, self.root_device, timeout, links=groups.links
        )
        sharded = self.settings.data_parallel == "fsdp"
        self._assembled = assembled = assemble_stage(
            module, self.settings, self.root_device, transport, sample=module.example_input_array,
            replica_group=groups.replicas, timeline=self.timeline, mesh=self._device_mesh,
            mixed_precision=mixed_precision(self.precision_plugin.precision) if sharded else None, reader=self._reader,
        )  # fmt: skip
        self._reader = None
        sync_metrics_over(module, groups.replicas)
        self._stages, self._names = assembled.pipeline.stages, assembled.names
        register_release(assembled.partition.stand_in, self._put_back)
        # Lightning's model summary runs example_input_array through the module on rank 0 alone, outside any step,
        # which a partitioned module cannot do; it is set aside until gather_module (the summary then omits sizes).
        self._example_input, module.example_input_array = module.example_input_array, None
        self._steps = UserSteps(
            module, assembled.pipeline, assembled.partition, CallRelay(self._stages[-1]), self._batches,
            precision=self.precision_plugin, device=self.root_device,
            share=sharing_from_last_stage(self.layout, groups.objects, self.root_device),
            verify_batches=self.config.verify_batches, detect_anomalies=self.config.detect_anomalies,
        )  # fmt: skip
        describe_pipeline(self.layout, self.chunks, assembled)
        return assembled

    # ------------------------------------------------------------------ steps: delegated to the step's owner

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._steps is not None
        return self._steps.training_step(args, kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        # Lightning's own sequence (Strategy.backward), the pipeline's backward phase in place of loss.backward().
        assert self._steps is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self._steps.module)
        self._steps.backward()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self._steps.module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        assert self._gradients is not None
        return super().optimizer_step(optimizer, self._gradients.after_closure(optimizer, closure), model, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._steps is not None
        return self._steps.eval_step("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._steps is not None
        return self._steps.eval_step("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._steps is not None
        return self._steps.eval_step("predict_step", args, kwargs)

    # ------------------------------------------------------------------ collectives

    def _collective(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Turn the failure of a collective into an error that names this stage and what it was doing."""
        return collective_errors(self.layout.stage, what)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def barrier(self, name: str | None = None) -> None:
        if not distributed_is_initialized():
            return
        with self._collective(f"a barrier of every rank{f' ({name})' if name else ''}"):
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not distributed_is_initialized():
            return obj
        box = [obj]
        with self._collective(f"receiving an object that global rank {src} broadcasts"):
            dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if not isinstance(tensor, Tensor):
            return tensor
        with self._collective("reducing a logged value over the ranks (self.log with sync_dist=True)"):
            return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        with self._collective("gathering a tensor from every rank (self.all_gather)"):
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    # ------------------------------------------------------------------ checkpoints

    def _checkpoints(self) -> StageCheckpoints:
        device = self.root_device if self.parallel_devices else torch.device("cpu")  # before the Trainer sets devices
        module = self.lightning_module if self._assembled is not None else None
        groups = (self._groups.objects, self._groups.control) if self._groups is not None else (None, None)
        return StageCheckpoints(self.layout, self._names, *groups, self.config, device, module)

    def gather_timeline(self) -> Timeline | None:
        """The spans every stage of the first pipeline recorded, merged on global rank 0 (``None`` elsewhere).

        A collective over each pipeline: call it on every rank. Recording is on while ``self.timeline.enabled``.
        """
        parts = self._checkpoints().gather(self.timeline.to_records())
        return Timeline.merge(parts) if parts is not None and self.is_global_zero else None

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._checkpoints().module_state()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self._checkpoints().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self._checkpoints().save(checkpoint, filepath, self.checkpoint_io, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # Loading a checkpoint never runs code from it; each rank reads its own stage's part (once it has one).
        return self._checkpoints().load(checkpoint_path, self.optimizers, self.checkpoint_io)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._checkpoints().load_module_state(checkpoint["state_dict"], strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._checkpoints().load_optimizer_states(self.optimizers, checkpoint["optimizer_states"])

    # ------------------------------------------------------------------ teardown: each stage stays where it is

    @override
    def on_exception(self, exception: BaseException) -> None:
        # The other stages may be dead or blocked: nothing may wait for them in a collective. Receives this stage left
        # posted would hold up the process group's destruction at exit (NCCL): abort the links that carry them.
        for stage in self._stages:
            if isinstance(stage.transport, ProcessGroupTransport):
                stage.transport.abort_links()

    def gather_module(self) -> LightningModule | None:
        """The whole trained module on global rank 0 (``None`` elsewhere); a collective: call it on every rank.

        Each rank keeps its stage after ``fit`` (docs/guide/strategy.md, "After fit"). This sends every stage's layers
        to global rank 0, one stage at a time, where the module becomes whole on the CPU (the whole model's weights);
        elsewhere it keeps this rank's layers, whole (sharded ones too), the others on ``meta``. The next Trainer call
        cuts it again.
        """
        if self._assembled is not None:
            self._put_back(destination=0)
        elif self.lightning_module is not None:  # nothing cut here, or by another Trainer's strategy, which gathers it
            refuse_a_cut_module(self.lightning_module)
        return self.lightning_module if self.is_global_zero else None

    def _put_back(self, destination: int | None = None) -> None:
        """Give the module its sequence back, whole on global rank ``destination`` (``None``: nowhere, each rank keeping
        its layers), and release the stages; the next cut keeps their balance."""
        assert self._assembled is not None
        partition = self._assembled.partition
        self._planned = {**self._planned, "balance": [len(bound) for bound in partition.bounds]}
        self._assembled.gather(
            destination, self.layout.pipeline_ranks(self.layout.replica), self._stage_groups().objects
        )
        partition.module.example_input_array = self._example_input
        self._assembled, self._steps, self._stages = None, None, ()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        for name, description, start_method in (
            ("gpipe", "GPipe pipeline parallelism over one process per stage", "popen"),
            ("gpipe_notebook", "GPipe pipeline parallelism, processes forked (works in notebooks)", "fork"),
        ):
            strategy_registry.register(name, cls, description=description, start_method=start_method, override=True)
