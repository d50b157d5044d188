"""Sharded stages (``data_parallel="fsdp"``): each layer of a process's stages sharded over its replicas with FSDP2.

Under ``"ddp"`` each replica of a stage holds the whole stage: parameters, gradients and optimizer state. Under
``"fsdp"`` each layer of the stage is one ``torch.distributed.fsdp.fully_shard`` unit over the stage's replicas (the
``"data"`` dimension of the job's mesh, :meth:`~lightning_gpipe.engine.layout.ProcessLayout.device_mesh`): each
replica holds one shard of every parameter, and therefore of its gradient and its optimizer state. How the units run
through a pipeline step (gathered once, reduced once) is the engine's :mod:`~lightning_gpipe.engine.sharding`.

:func:`shard_stage` takes one layer at a time, in order: allocates and initializes it if it was built on the meta
device, ties it back to the tensors it shares, converts its BatchNorm when asked, gives it replica 0's values, keeps
a copy of its structure on the meta device (reassembly rebuilds the whole module from it) and shards it. A rank
therefore holds its shards plus one whole layer at most, never the whole stage. :func:`unshard_stage` is the inverse,
when the module is put back: each layer rebuilt from its copy, whole, its tensors gathered from the replicas' shards.

A parameter that two layers of one process share (tied embeddings on one stage, or on the two stages of one ZB-V
process) cannot be split between two units; such a tensor stays whole on every process holding it, its gradient
averaged over the replicas as under ``"ddp"``. A tensor tied across processes is sharded alike on each of them, so the
copies' shards line up and :class:`~lightning_gpipe.partition.tied.TiedCopies` keeps them equal shard by shard.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from lightning_gpipe.engine.batchnorm import DeferredBatchNorm
from lightning_gpipe.engine.collectives import broadcast_tensors
from lightning_gpipe.engine.errors import collective_errors
from lightning_gpipe.engine.layout import ProcessLayout
from lightning_gpipe.engine.sharding import whole
from lightning_gpipe.partition.sequence import Partition, materialize, non_persistent_buffers
from lightning_gpipe.partition.tied import Tie, retie, set_aside

__all__ = ["PRECISIONS", "mixed_precision", "shard_stage", "ties_kept_whole", "unshard_stage"]

PRECISIONS: dict[str, MixedPrecisionPolicy] = {
    "32-true": MixedPrecisionPolicy(),
    "64-true": MixedPrecisionPolicy(),
    "16-true": MixedPrecisionPolicy(),
    "bf16-true": MixedPrecisionPolicy(),
    "16-mixed": MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32),
    "bf16-mixed": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
}
"""FSDP's mixed-precision policy for each of Lightning's ``precision`` settings that ``"fsdp"`` runs.

Mixed precision gathers the parameters in half precision (half the bytes to gather, the layer's whole copy half the
size) and reduces gradients in float32, torchtitan's default; the shards, their gradients and the optimizer stay in
float32, and Lightning's autocast still runs around the step. A ``"-true"`` precision converts the module itself, so
the shards already have the precision the layers compute in."""


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """FSDP's mixed-precision policy for Lightning's ``precision`` (see :data:`PRECISIONS`).

    Raises:
        ValueError: a precision ``"fsdp"`` does not run (a plugin of its own: Transformer Engine, bitsandbytes...).
    """
    policy = PRECISIONS.get(precision)
    if policy is None:
        raise ValueError(
            f"precision={precision!r} is not supported with data_parallel='fsdp'; use one of "
            f"{', '.join(map(repr, PRECISIONS))}, or 'ddp'"
        )
    return policy


def ties_kept_whole(ties: Sequence[Tie], position_of: Callable[[int], int]) -> list[Tie]:
    """The tied parameters that stay whole: those that two layers of one process share (one tensor there, which two
    units cannot split). Every process computes the same list, so each copy of a tie is kept whole or sharded alike."""
    kept = []
    for tie in ties:
        layers: dict[int, set[str]] = {}
        for name, stage in zip(tie.names, tie.name_stages, strict=True):
            layers.setdefault(position_of(stage), set()).add(_layer_of(name))
        if tie.is_parameter and any(len(named) > 1 for named in layers.values()):
            kept.append(tie)
    return kept


def shard_stage(
    partition: Partition,
    layout: ProcessLayout,
    mesh: DeviceMesh,
    device: torch.device,
    *,
    seed: int,
    deferred_batch_norm: bool,
    policy: MixedPrecisionPolicy | None = None,
    provided: Callable[[int, str], bool] | None = None,
    fill: Callable[[int], None] | None = None,
) -> None:
    """Shard each layer of this process's stages over ``mesh`` (its replicas), one layer at a time.

    Each layer is materialized (if built on the meta device, seeded ``seed + index`` as under ``"ddp"``; tensors
    ``provided(index, name)`` says a weights reader holds are only allocated, then filled by ``fill(index)``), retied,
    converted to deferred BatchNorm (``deferred_batch_norm``), given replica 0's values, and sharded (``policy``: FSDP's
    mixed precision). The whole module's sequence (``partition.original``) then holds a meta copy of each of these
    layers, as it holds the other stages' layers: reassembly rebuilds them from the gathered shards. A collective over
    the replicas (every replica shards alike).
    """
    stand_in = partition.stand_in
    # The whole sequence too: the module holds only this process's layers now.
    if any(isinstance(m, FSDPModule) for m in [*partition.module.modules(), *partition.original.modules()]):
        raise ValueError(
            f"{type(partition.module).__name__} already holds layers sharded with fully_shard; build it unsharded "
            "(the strategy shards them)"
        )
    whole = ties_kept_whole(partition.ties, layout.position_of)
    group, source = mesh.get_group(), layout.replica_ranks()[0]
    policy = policy or MixedPrecisionPolicy()
    skeletons: dict[str, nn.Module] = {}
    for index in partition.layers:
        name = str(index)
        materialize([(index, stand_in.get_submodule(name))], device, seed, provided)
        retie(partition.original, [tie for tie in partition.ties if any(_in(n, name) for n in tie.names)])
        if fill is not None:
            fill(index)
        layer = stand_in.get_submodule(name)
        if deferred_batch_norm:
            stand_in._modules[name] = layer = DeferredBatchNorm.convert(layer)  # the layer itself may be replaced
        with collective_errors(layout.stage, f"receiving layer {index}'s weights from replica 0 (rank {source})"):
            broadcast_tensors(_tensors(layer), source, group)
        skeletons[name] = _skeleton(layer)
        kept = {id(p): p for p in (stand_in.get_parameter(n) for tie in whole for n in tie.names if _in(n, name))}
        if any(id(p) not in kept for p in layer.parameters()):  # a layer of whole tensors only is left alone
            unsharded = set(kept.values())
            fully_shard(layer, mesh=mesh, reshard_after_forward=False, mp_policy=policy, ignored_params=unsharded)
    # The other stages' layers may still hold this process's whole tensors (ties across processes): to meta.
    own = list(stand_in.children())
    others = [layer for name, layer in partition.original._modules.items() if name not in skeletons]
    set_aside(others, own)
    for name, skeleton in skeletons.items():
        partition.original._modules[name] = skeleton


def unshard_stage(partition: Partition) -> None:
    """Make each layer of this process whole again (after :func:`shard_stage`): the meta copy that the whole sequence
    (``partition.original``) holds in its place is allocated where the layer's shards are, given the layer's tensors
    gathered whole (``DTensor.full_tensor``: a collective over the replicas, every replica in the same order), and
    takes the sharded layer's place in the stand-in too. The partition is then as under ``"ddp"``: its layers plain
    modules, whole, the same objects in the stand-in and in the sequence; :meth:`Partition.put_back` follows.

    A rank holds its shards and its stage whole at the end, one tensor more at most on the way. A stage that was not
    sharded (``"ddp"``: its layers are the sequence's own) is left as it is.
    """
    stand_in, sequence = partition.stand_in, partition.original
    for index in partition.layers:
        name = str(index)
        layer, skeleton = stand_in.get_submodule(name), sequence.get_submodule(name)
        if layer is skeleton or not any(t.is_meta for t in _state(skeleton)):
            continue
        device = next((tensor.device for tensor in _state(layer)), torch.device("cpu"))
        skeleton.to_empty(device=device)
        target = {**skeleton.state_dict(keep_vars=True), **dict(non_persistent_buffers(skeleton))}
        source = {**layer.state_dict(keep_vars=True), **dict(non_persistent_buffers(layer))}
        with torch.no_grad():
            for key, tensor in target.items():  # in the layer's own order, alike on every replica
                tensor.copy_(whole(source[key].detach()))
        stand_in._modules[name] = skeleton


def _state(layer: nn.Module) -> list[Tensor]:
    return [*layer.parameters(), *layer.buffers()]


def _layer_of(name: str) -> str:
    """The layer (its index in the sequence) of the tensor ``name``, relative to the sequence."""
    return name.split(".", 1)[0]


def _in(name: str, layer: str) -> bool:
    return _layer_of(name) == layer


def _tensors(layer: nn.Module) -> list[Tensor]:
    unique = {id(t): t for t in [*layer.parameters(), *layer.buffers()]}
    return [tensor.data for tensor in unique.values()]


def _skeleton(layer: nn.Module) -> nn.Module:
    """A copy of ``layer`` on the meta device: its structure, no memory; a tensor it uses twice is one in the copy."""
    memo: dict[int, Any] = {}
    for parameter in layer.parameters():
        memo[id(parameter)] = nn.Parameter(torch.empty_like(parameter, device="meta"), parameter.requires_grad)
    for buffer in layer.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(layer, memo)
