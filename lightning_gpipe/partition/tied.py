"""Tied tensors: a parameter or buffer that layers on several pipeline stages share, one copy per stage, kept equal.

An embedding tied to the output projection, or one rotary table whose buffers every block reads, is named by layers
that land on different stages. Each of those stages holds a copy, which its own layers use exactly as the plain
model's layers use the one tensor, and the copies stay equal:

- at setup, the stage holding the tensor's first name (its owner) broadcasts its value to the other holders;
- once per optimizer step, the copies' gradients are summed over the stages that hold them, so every copy gets the
  plain model's gradient, and the same optimizer math on the same values keeps the copies bit-identical;
- the global gradient norm counts a tied parameter once, on its owner.

Checkpoints need nothing more: a stage's state dict names a tied tensor as the plain module's does, under every name
its own layers give it, so the stages' merged state dict is the plain module's. The sums run over one process group
per set of stages that share something, per data-parallel replica; a sum over stages followed by the average over
replicas is DDP's gradient. Copies sharded over the replicas (``data_parallel="fsdp"``) are sharded alike on every
stage, rank ``r`` of each stage's replicas holding the same rows of each copy, so the broadcasts and sums run shard by
shard within a replica.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_gpipe.engine.sharding import local_shard, whole
from lightning_gpipe.engine.torch_compat import BatchNormBase, flatten_dense_tensors, unflatten_dense_tensors

__all__ = ["Tie", "TiedCopies", "find_ties", "retie", "set_aside", "ties_between_processes"]


@dataclass(frozen=True)
class Tie:
    """One tensor that several places of the sequence name, e.g. ``("0.weight", "7.weight")`` for tied embeddings.

    Names are relative to the sequence, in the order of its ``named_parameters`` (or ``named_buffers``), each paired
    with the stage of its layer.
    """

    names: tuple[str, ...]
    name_stages: tuple[int, ...]
    is_parameter: bool

    @property
    def stages(self) -> tuple[int, ...]:
        """The stages holding a copy, in order."""
        return tuple(sorted(set(self.name_stages)))

    @property
    def owner(self) -> int:
        """The stage of the first name: it broadcasts the initial value and counts the gradient in the global norm."""
        return self.name_stages[0]

    def local_name(self, stage: int) -> str:
        """The first name of the tensor among ``stage``'s layers."""
        return next(name for name, at in zip(self.names, self.name_stages, strict=True) if at == stage)


def find_ties(sequence: nn.Sequential, balance: Sequence[int]) -> list[Tie]:
    """Every parameter and buffer that more than one place of ``sequence`` names, with the stages of ``balance``.

    Refuses a BatchNorm with running statistics shared by layers of different stages: each stage would update its own
    copy of the statistics, and the copies would drift apart.
    """
    layer_names = list(sequence._modules)  # not named_children(), which drops a layer object used twice
    if sum(balance) != len(layer_names):
        raise ValueError(f"balance {list(balance)} does not cover the {len(layer_names)} layers of the sequence")
    stage_of: dict[str, int] = {}
    start = 0
    for index, count in enumerate(balance):
        stage_of.update((name, index) for name in layer_names[start : start + count])
        start += count

    def stage(name: str) -> int:
        return stage_of[name.split(".", 1)[0]]

    first_names: dict[int, str] = {}
    for name, module in sequence.named_modules(remove_duplicate=False):
        first = first_names.setdefault(id(module), name)
        shares_statistics = isinstance(module, BatchNormBase) and module.track_running_stats
        if shares_statistics and stage(first) != stage(name):
            raise ValueError(
                f"layer {first} (stage {stage(first)}) and layer {name} (stage {stage(name)}) share one "
                f"{type(module).__name__}; give each its own, set track_running_stats=False, or keep "
                "both on one stage"
            )
    ties = []
    for is_parameter, named in (
        (True, sequence.named_parameters(remove_duplicate=False)),
        (False, sequence.named_buffers(remove_duplicate=False)),
    ):
        names: dict[int, list[str]] = {}
        for name, tensor in named:
            names.setdefault(id(tensor), []).append(name)
        for group in names.values():
            if len(group) > 1:
                ties.append(Tie(tuple(group), tuple(stage(name) for name in group), is_parameter))
    return ties


def ties_between_processes(ties: Sequence[Tie], position_of: Callable[[int], int]) -> list[Tie]:
    """``ties`` seen by process: each name's stage replaced by ``position_of(stage)``, the process holding it.

    With several stages per process (``"interleaved"``, ``"zbv"``) a tie whose names all sit on one process is one
    tensor there, used by both stages' layers (one gradient, accumulated by both): it then holds one place and needs no
    copies. :class:`TiedCopies` takes these ties with positions for stages and the pipelines' ranks by position.
    """
    return [replace(tie, name_stages=tuple(position_of(stage) for stage in tie.name_stages)) for tie in ties]


def set_aside(layers: Sequence[nn.Module], own: Sequence[nn.Module]) -> None:
    """Move ``layers`` (other stages' layers, kept for reassembly) to ``meta``, except tensors that ``own`` layers use.

    Moving a layer whole would also move a tensor or module it shares with this stage's layers, leaving them with
    meta (then uninitialized) weights or buffers.
    """
    keep: set[int] = set()
    for layer in own:
        for tensor in [*layer.parameters(), *layer.buffers()]:
            keep.add(id(tensor))
            if tensor.grad is not None:
                keep.add(id(tensor.grad))

    def to_meta(tensor: Tensor) -> Tensor:
        return tensor if id(tensor) in keep else tensor.to("meta")

    for layer in layers:
        layer._apply(to_meta)


def _slot(root: nn.Module, name: str, is_parameter: bool) -> tuple[dict[str, Tensor], str]:
    path, _, attribute = name.rpartition(".")
    module = root.get_submodule(path)
    return (module._parameters if is_parameter else module._buffers), attribute  # type: ignore[return-value]


def retie(root: nn.Module, ties: Sequence[Tie], values: Mapping[str, Tensor] | None = None) -> None:
    """Make every name of each tie that ``root`` holds refer to one tensor again.

    Moving a layer between devices (``to_empty`` from ``meta`` among them) gives a tied parameter of each layer a tensor
    of its own. The one kept is the first name's that is not on ``meta``; ``values`` (keyed by any name of a tie)
    is then copied into it.
    """
    values = values or {}
    for tie in ties:
        slots = []
        for name in tie.names:
            try:
                slots.append(_slot(root, name, tie.is_parameter))
            except AttributeError:  # a layer that ``root`` does not hold (another stage's)
                continue
        if not slots:
            continue
        tensors = [table[attribute] for table, attribute in slots]
        kept = next((tensor for tensor in tensors if not tensor.is_meta), tensors[0])
        for table, attribute in slots:
            table[attribute] = kept
        value = next((values[name] for name in tie.names if name in values), None)
        if value is not None:
            with torch.no_grad():
                kept.copy_(value)


class TiedCopies:
    """This stage's copies of the tensors it shares with other stages, and the collectives that keep them equal.

    Creating it creates one process group per set of stages that share a tensor, per replica: a collective over the
    world, so every rank must create its ``TiedCopies`` at the same point, from the same ties.

    Args:
        ties: the sequence's ties (:func:`find_ties`); those within one stage need nothing here.
        cell: this stage's layers under their original names (the cell from ``split`` or the strategy's stand-in).
        stage: this stage's index.
        pipelines: global ranks of each replica's stages, stage 0 first (one list for a single pipeline).
        replica: this rank's replica (index into ``pipelines``).
        timeout: how long a collective waits for the other stages; default: the process group's.
    """

    def __init__(
        self,
        ties: Sequence[Tie],
        cell: nn.Module,
        stage: int,
        pipelines: Sequence[Sequence[int]],
        replica: int = 0,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        self.cell = cell
        self.stage = stage
        self.ties = [tie for tie in ties if len(tie.stages) > 1]
        self._ranks = list(pipelines[replica])  # global rank of each stage of this rank's pipeline
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for stages in sorted({tie.stages for tie in self.ties}):
            for index, ranks in enumerate(pipelines):
                group = dist.new_group([ranks[s] for s in stages], timeout=timeout)
                if index == replica and stage in stages:
                    self._groups[stages] = group
        self._held = [(tie, tie.local_name(stage)) for tie in self.ties if stage in tie.stages]

    def _tensor(self, tie: Tie, name: str) -> Tensor:
        return self.cell.get_parameter(name) if tie.is_parameter else self.cell.get_buffer(name)

    def broadcast(self, device: torch.device | None = None) -> None:
        """Give every copy the owner's value (at setup); ``device`` is where the backend communicates (CUDA: NCCL)."""
        for tie, name in self._held:
            tensor = local_shard(self._tensor(tie, name).detach())
            wire = tensor if device is None else tensor.to(device)
            # From each tie's own owner: ties over the same stages may have different owners.
            dist.broadcast(wire, src=self._ranks[tie.owner], group=self._groups[tie.stages])
            if wire is not tensor:
                tensor.copy_(wire)

    def sum_gradients(self) -> None:
        """Sum the copies' gradients over the stages holding them: once per optimizer step, before clipping.

        A copy whose layers got no gradient here takes the others' sum; a tensor that got no gradient on any stage
        keeps ``grad = None``, as the plain model's would (so the optimizer skips it, weight decay included).
        """
        for stages, group in sorted(self._groups.items()):
            parameters = [
                self._tensor(tie, name)
                for tie, name in self._held
                if tie.is_parameter and tie.stages == stages and self._tensor(tie, name).requires_grad
            ]
            buckets: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
            for parameter in parameters:
                buckets.setdefault((parameter.dtype, parameter.device), []).append(parameter)
            for (dtype, device), members in sorted(buckets.items(), key=lambda item: str(item[0])):
                # One count per parameter rides along: how many stages had a gradient for it.
                counts = torch.tensor([float(p.grad is not None) for p in members], dtype=dtype, device=device)
                grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in members]
                shards = [local_shard(grad) for grad in grads]
                flat = flatten_dense_tensors([*shards, counts])
                dist.all_reduce(flat, group=group)
                *summed, counts = unflatten_dense_tensors(flat, [*shards, counts])
                for parameter, grad, shard, total, count in zip(
                    members, grads, shards, summed, counts.tolist(), strict=True
                ):
                    if count == 0:
                        parameter.grad = None
                        continue
                    shard.copy_(total)
                    parameter.grad = grad

    def duplicates(self) -> list[nn.Parameter]:
        """This stage's tied parameters whose gradient norm the owner stage counts (the global norm counts it once)."""
        return [
            self._tensor(tie, name)  # type: ignore[misc]
            for tie, name in self._held
            if tie.is_parameter and tie.owner != self.stage
        ]

    def values(self) -> dict[str, Tensor]:
        """Copies of this stage's tied tensors, by their names here (to put back after the model is reassembled);
        sharded ones gathered whole (a collective over the replicas)."""
        return {name: whole(self._tensor(tie, name).detach()).clone() for tie, name in self._held}
