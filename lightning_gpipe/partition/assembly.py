"""Stage assembly: one rank's stages of a pipeline built from the user's module, and the whole module put back.

:func:`assemble_stage` does on one rank what the strategy's ``setup`` needs before the first step, in an order every
rank follows (several steps are collectives): find the ``nn.Sequential``, record the whole module's names for
checkpoints, resolve the balance (measured on rank 0 and broadcast), cut the module down to this stage's layers,
allocate and initialize layers built on the meta device, convert BatchNorm to :class:`DeferredBatchNorm` when asked,
compile each layer in place when asked (:mod:`lightning_gpipe.partition.compile`), give the replicas of the stage the
same weights (under ``data_parallel="fsdp"``, layer by layer, each then sharded over them:
:mod:`lightning_gpipe.partition.fsdp`), set up the copies of tensors tied across processes, and wrap the cell in a
:class:`~lightning_gpipe.engine.pipeline.Pipeline` over the given transport.

A process may hold several stages (``schedule="interleaved"`` or ``"zbv"``): its module then holds the layers of each,
still under their original names, one cell per stage (each a slice of the sequence, the same layer objects), and a
tensor that two of its stages share is one tensor, with one gradient. It needs no Trainer: a test builds every
stage of a pipeline in one process over a :class:`~lightning_gpipe.engine.transport.ThreadTransport`.

:meth:`AssembledStage.gather` is the inverse, when the user asks for the whole module: every stage's layers, sent one
stage at a time, put it back on one rank.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_gpipe.engine.batchnorm import DeferredBatchNorm
from lightning_gpipe.engine.collectives import TensorSpec, broadcast_tensors, receive_tensors, send_tensors, to_device
from lightning_gpipe.engine.config import PipelineConfig
from lightning_gpipe.engine.errors import collective_errors
from lightning_gpipe.engine.layout import ProcessLayout
from lightning_gpipe.engine.pipeline import Pipeline
from lightning_gpipe.engine.sharding import is_sharded
from lightning_gpipe.engine.stage import Stage
from lightning_gpipe.engine.timeline import Timeline
from lightning_gpipe.engine.transport import Transport
from lightning_gpipe.partition.balance import balance_by_cost, checked_total, in_place_starts
from lightning_gpipe.partition.compile import CompiledLayers, compile_layers
from lightning_gpipe.partition.config import ResolvedPipeline
from lightning_gpipe.partition.discovery import find_sequence
from lightning_gpipe.partition.fsdp import shard_stage, unshard_stage
from lightning_gpipe.partition.reader import WeightsReader, read_held
from lightning_gpipe.partition.sequence import Partition, PipelinedSequential, materialize, partition_module
from lightning_gpipe.partition.state_dict import ModelNames
from lightning_gpipe.partition.tied import TiedCopies, retie, ties_between_processes
from lightning_gpipe.profile.cost import layer_costs

__all__ = [
    "AssembledStage",
    "assemble_stage",
    "measured_costs",
    "parameter_counts",
    "refuse_a_cut_module",
    "register_release",
    "resolve_balance",
    "take_over_cut",
]


@dataclass
class AssembledStage:
    """One rank's stage, ready to train: its part of the module, its pipeline, its tied copies, the whole's names.

    Attributes:
        partition: how the module was cut; the module itself now holds only this stage's layers.
        pipeline: this stage's :class:`~lightning_gpipe.engine.pipeline.Pipeline` (its cell and transport).
        ties: this stage's copies of tensors that layers of other stages share, kept equal by collectives.
        names: the whole module's state-dict keys, shapes and parameter names, recorded before the cut.
        whole_parameters: (all, trainable) parameter counts of the whole module, each tied tensor once.
        compiled: this stage's layers compiled in place (none unless ``settings.compile``), undone by :meth:`gather`.
        processes: the processes of the pipeline (K), among which :meth:`gather` collects the layers.
    """

    partition: Partition
    pipeline: Pipeline
    ties: TiedCopies
    names: ModelNames
    whole_parameters: tuple[int, int]
    compiled: CompiledLayers = field(default_factory=CompiledLayers)
    processes: int = 1

    @property
    def stage(self) -> Stage:
        """This rank's :class:`~lightning_gpipe.engine.stage.Stage`."""
        return self.pipeline.stage

    @property
    def layers(self) -> list[int]:
        """The indices, in the whole sequence, of the layers this process holds."""
        return self.partition.layers

    @property
    def stage_parameters(self) -> tuple[int, int]:
        """(all, trainable) parameter counts of this process's layers, a tensor its stages share once."""
        return parameter_counts(self.partition.stand_in.parameters())

    def gather(self, destination: int | None, ranks: Sequence[int], group: dist.ProcessGroup | None) -> None:
        """Put the user's sequence back in the module: on global rank ``destination`` whole, with every stage's trained
        layers, elsewhere with this process's layers and the others' on the ``meta`` device.

        A collective over the pipeline whose processes are the global ``ranks`` (in any order) when ``destination`` is
        one of them (another pipeline, or ``destination=None``, puts back its own layers alone); ``group`` is its group
        for objects (gloo).
        The destination allocates the other stages' layers and receives their tensors one process at a time, in
        buckets (:func:`~lightning_gpipe.engine.collectives.receive_tensors`): it holds the whole model and one bucket,
        and no rank holds a pickled copy. Tied tensors become one again, deferred BatchNorm layers plain BatchNorm, and
        compiled layers run as they did before assembly (:meth:`~lightning_gpipe.partition.sequence.Partition.finish`).

        Sharded layers (``data_parallel="fsdp"``) are first made whole on every rank
        (:func:`~lightning_gpipe.partition.fsdp.unshard_stage`, a collective over each stage's replicas, which every
        rank joins whatever ``destination`` is): a rank outside the destination holds its stage, whole, at most.
        """
        self.compiled.restore()
        unshard_stage(self.partition)
        tied = self.ties.values()
        if destination is None or destination not in ranks or self.processes == 1:
            self.partition.put_back(allocate=False)
            self.partition.finish(tied)
            return
        rank, ranks = dist.get_rank(), sorted(ranks)  # a gather's results come in the group's order
        part = self.partition.stage_state()
        specs = {key: TensorSpec.of(tensor) for key, tensor in part.items()}
        gathered: list[Any] | None = [None] * len(ranks) if rank == destination else None
        with collective_errors(self.partition.stage, f"sending this stage's layers to global rank {destination}"):
            dist.gather_object(specs, gathered, dst=destination, group=group)
            if rank != destination:
                send_tensors(list(part.values()), destination, group)
                self.partition.put_back(allocate=False)
                self.partition.finish(tied)
                return
            assert gathered is not None
            empty = self.partition.put_back(allocate=True)
            filled = set()
            for source, received in zip(ranks, gathered, strict=True):
                if source == destination:
                    continue
                keys = list(received)
                with torch.no_grad():
                    for index, tensor in receive_tensors(list(received.values()), source, group):
                        if keys[index] in empty:
                            empty[keys[index]].copy_(tensor)
                            filled.add(keys[index])
        missing = sorted(empty.keys() - filled)
        assert not missing, f"no stage sent {missing[:5]}"
        self.partition.finish(tied)


def assemble_stage(
    module: nn.Module,
    settings: ResolvedPipeline,
    device: torch.device,
    transport: Transport | Mapping[int, Transport],
    *,
    sample: Any = None,
    replica_group: dist.ProcessGroup | None = None,
    timeline: Timeline | None = None,
    mesh: DeviceMesh | None = None,
    mixed_precision: MixedPrecisionPolicy | None = None,
    reader: WeightsReader | None = None,
) -> AssembledStage:
    """Cut ``module`` down to this process's stages (``settings.layout``) and build its pipeline over ``transport``.

    Every rank of the job calls it at the same point: resolving a measured balance, the replicas' weights and the
    tied copies are collectives (each only where the job has more than one process that takes part).

    Args:
        module: the user's module, holding the ``nn.Sequential`` to pipeline (``settings.module_name``, else the
            only one); it is changed in place (see :mod:`lightning_gpipe.partition.sequence`).
        settings: the settings resolved for this process
            (:meth:`BuildConfig.resolve <lightning_gpipe.partition.config.BuildConfig.resolve>`): K, M, this rank's
            place.
        device: where this stage's layers are allocated and run.
        transport: the links to this pipeline's other stages; with several stages per process, one per held stage.
        sample: one input of the sequence, for a balance measured on it (``"flops"``, ``"time"``, ``"memory"``).
        replica_group: the ranks running this stage in every replica: they start from replica 0's weights.
        timeline: records the pipeline's actions when given.
        mesh: the job's ``("pipe", "data")`` mesh (:meth:`~lightning_gpipe.engine.layout.ProcessLayout.device_mesh`),
            over whose ``"data"`` dimension ``settings.data_parallel="fsdp"`` shards the stage; needed then only.
        mixed_precision: FSDP's mixed precision under ``"fsdp"``
            (:func:`~lightning_gpipe.partition.fsdp.mixed_precision`); default: none.
        reader: the module's pretrained weights (:mod:`lightning_gpipe.partition.reader`): this stage's tensors are
            read from it, the module's others never are.
    """
    layout = settings.layout
    path, sequence = _sequence_to_cut(module, settings)
    names = ModelNames.of(module)
    whole = parameter_counts(module.parameters())  # before the split: each tied tensor once
    balance = resolve_balance(settings, sequence, sample, device, deferred=reader is not None)
    trained = [i for i, layer in enumerate(sequence) if _holds_weights(layer)]  # before the cut sets others aside
    partition = partition_module(module, path, sequence, balance, layout.stages)
    if reader is None:  # a reader fills every layer it holds; layers built on meta alone are initialized
        _refuse_stranded_layers([(i, sequence[i]) for i in partition.layers], trained)
    _materialize_stage(module, path, partition, settings, device, reader, mesh, mixed_precision)
    compiled, engine = _compile_stage(partition, settings)
    cells = {stage: partition.stand_in.cell(partition.bounds[stage]) for stage in layout.stages}
    _broadcast_replica_weights(module, layout, device, replica_group)
    ties = _tied_copies(partition, settings, device)
    held: nn.Module | dict[int, nn.Sequential] = cells
    if len(cells) == 1:  # one stage per process: its cell, and its transport
        (stage,) = layout.stages
        held, transport = cells[stage], transport[stage] if isinstance(transport, Mapping) else transport
    pipeline = Pipeline(held, transport, engine, timeline=timeline)
    return AssembledStage(partition, pipeline, ties, names, whole, compiled, layout.pipe_size)


def _sequence_to_cut(module: nn.Module, settings: ResolvedPipeline) -> tuple[str, nn.Sequential]:
    """The path and the ``nn.Sequential`` of ``module`` to pipeline, refused when it cannot give every stage a layer."""
    layout = settings.layout
    refuse_a_cut_module(module, " that has not put it back")
    path, sequence = find_sequence(module, settings.module_name)
    if len(sequence) < layout.num_stages:
        per = len(layout.stages)
        fix = (
            f"pipe_size <= {len(sequence)}"
            if per == 1
            else f"pipe_size x {per} stages per process (schedule={layout.schedule!r}) <= {len(sequence)}"
        )
        raise ValueError(
            f"cannot split the {len(sequence)} layers of {path!r} into {layout.num_stages} stages; use {fix} or "
            "more layers"
        )
    return path, sequence


def _materialize_stage(
    module: nn.Module,
    path: str,
    partition: Partition,
    settings: ResolvedPipeline,
    device: torch.device,
    reader: WeightsReader | None,
    mesh: DeviceMesh | None,
    mixed_precision: MixedPrecisionPolicy | None,
) -> None:
    """Give this process's layers their weights on ``device``: read from ``reader``, else initialized with one seed on
    every rank; sharded over the replicas under ``data_parallel="fsdp"``, BatchNorm deferred when asked."""
    seed = torch.initial_seed() % 2**62
    provided = set(reader.keys()) if reader is not None else set()

    def is_provided(index: int, name: str) -> bool:
        return f"{path}.{index}.{name}" in provided

    if settings.data_parallel == "fsdp":
        assert mesh is not None, "data_parallel='fsdp' shards over the job's mesh: pass mesh="
        fill = None if reader is None else partial(_read_layer, module, reader, device, path)
        shard_stage(
            partition, settings.layout, mesh["data"], device, seed=seed,
            deferred_batch_norm=settings.deferred_batch_norm, policy=mixed_precision, provided=is_provided, fill=fill,
        )  # fmt: skip
        if reader is not None:  # what lies outside the sequence (a frozen part), never sharded
            read_held(module, reader, device, only=lambda key: not key.startswith(f"{path}."))
        return
    sequence = partition.original
    materialize([(i, sequence[i]) for i in partition.layers], device, seed, is_provided)
    retie(sequence, partition.ties)  # materializing gave each name of a tied parameter its own tensor
    if reader is not None:
        read_held(module, reader, device)
    if settings.deferred_batch_norm:
        DeferredBatchNorm.convert(partition.stand_in)


def _compile_stage(partition: Partition, settings: ResolvedPipeline) -> tuple[CompiledLayers, PipelineConfig]:
    """Compile this process's layers in place when asked, and the engine's settings that go with them.

    The final layer objects (materialized, BatchNorm converted) are the ones compiled; the checkpointed cell around
    them stays eager, so a replay runs the compiled layers with the engine's RNG and BatchNorm handling. Compiled
    selective layers re-materialize themselves, inside their graphs: the stage wraps nothing around them.
    """
    selective = settings.compile is not None and settings.checkpoint == "selective"
    compiled = compile_layers(partition.stand_in.children(), settings.compile, selective=selective)
    engine = replace(settings.pipeline, checkpoint="never") if selective else settings.pipeline
    return compiled, engine


def _tied_copies(partition: Partition, settings: ResolvedPipeline, device: torch.device) -> TiedCopies:
    """This process's copies of tensors tied to other processes' layers, broadcast equal (a collective)."""
    layout = settings.layout
    with collective_errors(layout.stage, "creating the groups of stages that share tied weights and broadcasting them"):
        ties = TiedCopies(
            ties_between_processes(partition.ties, layout.position_of),  # a tie within one process is one tensor
            partition.stand_in,
            layout.stage,
            [layout.pipeline_ranks(replica) for replica in range(layout.num_replicas)],
            layout.replica,
            settings.timeout,
        )
        ties.broadcast(device)
    return ties


def _read_layer(module: nn.Module, reader: WeightsReader, device: torch.device, path: str, index: int) -> None:
    """Fill layer ``index`` of the sequence at ``path`` from ``reader`` (before it is sharded)."""
    read_held(module, reader, device, only=lambda key: key.startswith(f"{path}.{index}."))


def resolve_balance(
    settings: ResolvedPipeline, sequence: nn.Sequential, sample: Any, device: torch.device, deferred: bool = False
) -> list[int]:
    """Layers per stage (``K·v`` of them): ``settings.balance`` if it is a list (checked against the sequence), else
    found from costs.

    A measured balance is decided on global rank 0 and broadcast over the world, since measured costs differ between
    processes; without a process group (one process building every stage), each call measures for itself. The
    default is ``"flops"`` when there is a ``sample`` and the layers are not on the meta device, else ``"params"``;
    layers whose weights wait in a reader (``deferred``) count as real, their FLOPs counted on the meta device.
    """
    if isinstance(settings.balance, list):
        return checked_total(settings.balance, len(sequence))  # its entries were checked where it was given
    how = settings.balance
    if how is None:
        how = "flops" if sample is not None and (deferred or not _is_meta(sequence)) else "params"
    if how in ("flops", "time", "memory") and sample is None:
        raise ValueError(
            f"balance={how!r} needs a sample input: set `self.example_input_array`, or use balance='params' or a list"
        )
    distributed = dist.is_available() and dist.is_initialized()
    balance: list[int] | None = None
    if not distributed or settings.layout.rank == 0:
        if deferred and how == "flops" and _is_meta(sequence):
            # A meta copy, the sample with it: the values of the weights do not change a layer's FLOPs.
            sequence, sample = copy.deepcopy(sequence).to("meta"), to_device(sample, torch.device("meta"))
        costs = measured_costs(sequence, how, sample, device)
        balance = balance_by_cost(costs, settings.num_stages, avoid_cuts=in_place_starts(sequence))
    if distributed:
        box = [balance]
        dist.broadcast_object_list(box, src=0)
        balance = box[0]
    assert balance is not None
    return balance


def measured_costs(sequence: nn.Sequential, how: Any, sample: Any, device: torch.device) -> list[float]:
    """Layer costs; ``"time"`` and ``"memory"`` run a copy of the layers on ``device``, where the stages will train.

    Timing on the CPU copy would balance CPU speed, not the GPU's, and CUDA kernels save other tensors than CPU ones.
    The copy needs the whole sequence to fit on rank 0's device; ``"flops"`` and ``"params"`` need no device at all.
    """
    if how not in ("time", "memory") or device.type == "cpu" or _is_meta(sequence):
        return layer_costs(sequence, how, sample)
    on_device = copy.deepcopy(sequence).to(device)
    try:
        return layer_costs(on_device, how, to_device(sample, device))
    finally:
        del on_device
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the copy's memory goes back before the stages allocate their own


def parameter_counts(parameters: Iterable[Tensor]) -> tuple[int, int]:
    """(all, trainable) element counts of ``parameters``; meta tensors count too."""
    counts = [(p.numel(), p.requires_grad) for p in parameters]
    return sum(n for n, _ in counts), sum(n for n, trainable in counts if trainable)


def _broadcast_replica_weights(
    module: nn.Module, layout: ProcessLayout, device: torch.device, group: dist.ProcessGroup | None
) -> None:
    # Replicas of a stage start from the same weights, as DDP ensures at construction.
    if layout.num_replicas == 1:
        return
    assert group is not None, "data-parallel replicas need their replica group"
    # NCCL broadcasts device tensors only, and the module (or a buffer outside the sequence) may still be on the
    # CPU here: move it first. Sharded layers got replica 0's values before they were sharded.
    module.to(device)
    source = layout.replica_ranks()[0]
    tensors = [tensor.data for tensor in [*module.parameters(), *module.buffers()] if not is_sharded(tensor)]
    with collective_errors(layout.stage, f"receiving the weights of replica 0 of this stage (global rank {source})"):
        broadcast_tensors(tensors, source, group)


def refuse_a_cut_module(module: nn.Module, why: str = "") -> None:
    """Refuse ``module`` when a sequence of it holds one stage only: cut by a strategy that still holds that stage."""
    cut = next((name for name, sub in module.named_modules() if isinstance(sub, PipelinedSequential)), None)
    if cut is not None:
        raise ValueError(
            f"{type(module).__name__}.{cut} holds one stage only, cut by another Trainer{why}: call that Trainer's "
            "strategy.gather_module() on every rank, or resume from a checkpoint"
        )


_RELEASES: weakref.WeakKeyDictionary[nn.Module, Callable[[], None]] = weakref.WeakKeyDictionary()


def register_release(stand_in: PipelinedSequential, release: Callable[[], None]) -> None:
    """Let another strategy take over the cut ``stand_in`` stands for: ``release`` puts the sequence back (this rank
    keeping its layers, the others on ``meta``) and forgets the stages (see :func:`take_over_cut`)."""
    _RELEASES[stand_in] = release


def take_over_cut(module: nn.Module, settings: ResolvedPipeline) -> list[int] | None:
    """The balance of a cut of ``module`` that another strategy made and that these ``settings`` cut alike (the same
    stages on this rank, the same balance if one is given), once that strategy has put the sequence back; ``None``
    when the module is not cut. Nothing moves: each rank keeps the layers it holds.

    Raises:
        ValueError: the module is cut otherwise, or by something that cannot put it back.
    """
    stand_in = next((sub for sub in module.modules() if isinstance(sub, PipelinedSequential)), None)
    if stand_in is None:
        return None
    release, balance = _RELEASES.get(stand_in), stand_in.balance
    cut, wanted = (stand_in.num_stages, stand_in.stages), (settings.num_stages, settings.layout.stages)
    if release is None or cut != wanted:
        refuse_a_cut_module(
            module, f" ({cut[0]} stages, this rank holding {cut[1]}; this Trainer's: {wanted[0]}, {wanted[1]})"
        )
    if isinstance(settings.balance, list) and settings.balance != balance:
        refuse_a_cut_module(module, f" (balance={balance}; this Trainer's: {settings.balance})")
    release()  # type: ignore[misc]
    return balance


def _refuse_stranded_layers(own: Sequence[tuple[int, nn.Module]], trained: Sequence[int]) -> None:
    """Refuse to initialize this stage's layers that are on ``meta`` while other layers hold weights: after
    ``gather_module`` a rank keeps only its own stage's layers, and a stage cut another way would get fresh ones."""
    stranded = [index for index, layer in own if any(p.is_meta for p in layer.parameters())]
    if stranded and trained:
        listed = ", ".join(map(str, stranded))
        which = f"layers {listed} of the sequence are" if len(stranded) > 1 else f"layer {listed} of the sequence is"
        raise ValueError(
            f"{which} on the meta device on this rank while layers {', '.join(map(str, trained[:8]))} hold weights: "
            "cut as before (pipe_size, balance=[...]) or resume from a checkpoint"
        )


def _holds_weights(layer: nn.Module) -> bool:
    # Parameters only: a layer built on meta may compute small buffers (a rotary table) for real.
    return any(not p.is_meta for p in layer.parameters())


def _is_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())
