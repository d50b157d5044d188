"""The user's LightningModule cut down to this rank's cells, and put back together after training.

The module keeps its shape: its ``nn.Sequential`` attribute is replaced by a :class:`PipelinedSequential` that holds
only this process's layers (of its one stage, or of each of its stages), registered under their original indices.
Parameter names, ``state_dict`` keys and therefore checkpoints stay those of the unpartitioned model, and
``configure_optimizers`` sees only this process's parameters. The other stages' layers are kept aside on the ``meta``
device, which holds their structure but no memory, so that the sequence can be put back when the user asks for the whole
model (:meth:`Partition.put_back`); a tensor they share with this process's layers (tied weights) stays.
"""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_gpipe.engine.batchnorm import DeferredBatchNorm
from lightning_gpipe.partition.balance import cell_bounds
from lightning_gpipe.partition.reader import allocate_meta
from lightning_gpipe.partition.tied import Tie, find_ties, retie, set_aside

__all__ = [
    "Partition",
    "PipelinedSequential",
    "RemoteLayers",
    "materialize",
    "non_persistent_buffers",
    "partition_module",
]


def _assign(module: nn.Module, path: str, value: nn.Module) -> None:
    *parents, name = path.split(".")
    setattr(functools.reduce(getattr, parents, module), name, value)


class PipelinedSequential(nn.Module):
    """Stands in for the user's ``nn.Sequential`` on one stage.

    It holds the layers of this process's stages (one, or several: ``schedule="interleaved"`` or ``"zbv"``) under
    their original indices. Calling it runs ``runner`` (set by the strategy for the duration of a step), which
    pipelines the call, and :meth:`decode` runs ``decoder``, which runs a decoding call on every stage; outside a step
    both refuse to run, since most layers live elsewhere.
    """

    holds_all_layers = False  # model code reads this (duck typing) to call the whole sequence, never its parts

    def __init__(
        self, layers: Mapping[str, nn.Module], num_layers: int, stages: int | Sequence[int], num_stages: int
    ) -> None:
        super().__init__()
        for name, layer in layers.items():
            self.add_module(name, layer)
        self.num_layers = num_layers
        self.stages = (stages,) if isinstance(stages, int) else tuple(stages)
        self.num_stages = num_stages
        self.runner: Callable[[Any], Any] | None = None
        self.balance: list[int] = []  # layers per stage of the whole cut
        self.decoder: Callable[[Any], Any] | None = None

    @property
    def stage(self) -> int:
        """The first stage this process holds (its only one, but under ``"interleaved"`` and ``"zbv"``)."""
        return self.stages[0]

    def cell(self, layers: Sequence[int] | None = None) -> nn.Sequential:
        """The held layers as a plain ``nn.Sequential`` (the same module objects); ``layers``: only those (indices in
        the whole sequence), e.g. one stage's."""
        chosen = self._modules.items() if layers is None else [(str(i), self._modules[str(i)]) for i in layers]
        return nn.Sequential(OrderedDict(chosen))  # type: ignore[arg-type]

    def forward(self, value: Any) -> Any:
        if self.runner is None:
            raise RuntimeError(self._outside_a_step())
        return self.runner(value)

    def decode(self, decoding: Any) -> Any:
        """Run ``decoding`` (a :class:`~lightning_gpipe.engine.decoding.Decoding`) on every stage of the pipeline,
        each stage with its own layers and caches; its result on the last stage. Model code that decodes calls it in
        place of its own loop where the sequence does not hold all its layers (``holds_all_layers``)."""
        if self.decoder is None:
            raise RuntimeError(self._outside_a_step())
        return self.decoder(decoding)

    def _outside_a_step(self) -> str:
        return (
            f"this pipelined sequence holds {_stages(self.stages)} of {self.num_stages} only (layers "
            f"{', '.join(dict(self.named_children()))} of {self.num_layers}); it runs inside the Trainer's steps. "
            "After fit, trainer.strategy.gather_module() puts the whole sequence back on global rank 0."
        )

    def extra_repr(self) -> str:
        held = ",".join(map(str, self.stages))
        return f"stage{'s' if len(self.stages) > 1 else ''}={held}/{self.num_stages}, layers of {self.num_layers}"

    def __len__(self) -> int:
        return self.num_layers  # the whole sequence's length, as ``len(self.layers)`` is in the user's code

    def __getitem__(self, index: int | slice) -> nn.Module:
        """``self.layers[i]`` or ``self.layers[a:b]`` as in the user's sequence, seen from this stage.

        A layer of this stage is the layer itself. A layer of another stage is a :class:`RemoteLayers` without
        parameters, and a slice holds this stage's layers within it: so ``self.layers[-1].parameters()`` in a
        parameter group of ``configure_optimizers`` gives, on every stage, this stage's share of the group.
        """
        if isinstance(index, slice):
            chosen = [str(i) for i in range(self.num_layers)[index]]
            held = {name: layer for name in chosen if (layer := self._modules.get(name)) is not None}
            return RemoteLayers(held, chosen)
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"the pipelined sequence is indexed by int or slice, not {type(index).__name__}")
        if not -self.num_layers <= index < self.num_layers:
            raise IndexError(f"index {index} is out of range for a sequence of {self.num_layers} layers")
        name = str(index % self.num_layers)
        layer = self._modules.get(name)
        return layer if layer is not None else RemoteLayers({}, [name])


def _stages(stages: Sequence[int]) -> str:
    return f"stage {stages[0]}" if len(stages) == 1 else f"stages {', '.join(map(str, stages))}"


class RemoteLayers(nn.Module):
    """The part of a selection of the pipelined sequence's layers that lives on this stage (possibly none).

    It exists for code that reads parameters by position (``self.layers[-1].parameters()``); running it is refused,
    since the selected layers are spread over the stages.
    """

    def __init__(self, layers: Mapping[str, nn.Module], selected: Sequence[str]) -> None:
        super().__init__()
        for name, layer in layers.items():
            self.add_module(name, layer)
        self.selected = list(selected)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"layers {', '.join(self.selected)} are spread over the stages (held here: "
            f"{', '.join(self._modules) or 'none'}); call the whole sequence, and index it only for parameters"
        )

    def extra_repr(self) -> str:
        return f"layers {self.selected}, held here: {list(self._modules)}"


@dataclass
class Partition:
    """How the module was cut: where the sequence lives, the original, this stage's stand-in, and its tied tensors."""

    module: nn.Module
    path: str
    original: nn.Sequential
    stand_in: PipelinedSequential
    bounds: list[range]
    ties: list[Tie] = field(default_factory=list)

    @property
    def stage(self) -> int:
        """The pipeline stage this process runs (the first, when it runs several)."""
        return self.stand_in.stage

    @property
    def stages(self) -> tuple[int, ...]:
        """The pipeline stages this process runs."""
        return self.stand_in.stages

    @property
    def layers(self) -> list[int]:
        """The indices, in the whole sequence, of the layers this process holds."""
        return [index for stage in self.stages for index in self.bounds[stage]]

    def owner_of(self, key: str) -> int | None:
        """The stage holding state-dict ``key`` (a key of the whole module); None if it is outside the sequence."""
        prefix = f"{self.path}."
        if not key.startswith(prefix):
            return None
        index = int(key[len(prefix) :].split(".", 1)[0])
        return next(stage for stage, bound in enumerate(self.bounds) if index in bound)

    def stage_state(self) -> dict[str, torch.Tensor]:
        """This stage's part of the sequence on the CPU, keys relative to the sequence: its state dict and also its
        non-persistent buffers (rotary tables, BERT's ``position_ids``), which no state dict holds but the other
        stages need to reassemble the model. Sharded layers are made whole first
        (:func:`~lightning_gpipe.partition.fsdp.unshard_stage`)."""
        state = {key: value.detach().cpu() for key, value in self.stand_in.state_dict().items()}
        for key, buffer in non_persistent_buffers(self.stand_in):
            state[key] = buffer.detach().cpu()
        return state

    def put_back(self, allocate: bool) -> dict[str, torch.Tensor]:
        """Put the user's sequence back in the module in place of the stand-in, this process's layers in it as trained.

        The other stages' layers stay on the ``meta`` device, or with ``allocate`` get CPU memory, uninitialized: their
        tensors are then returned by name relative to the sequence (non-persistent buffers included, as
        :meth:`stage_state` names them) for the caller to fill in from the stages that trained them. Call
        :meth:`finish` once they are filled.
        """
        held = set(self.layers)
        empty: dict[str, torch.Tensor] = {}
        for index, layer in enumerate(self.original):
            if index in held or not allocate:
                continue
            layer.to_empty(device=torch.device("cpu"))
            empty.update((f"{index}.{key}", tensor) for key, tensor in layer.state_dict(keep_vars=True).items())
            empty.update((f"{index}.{key}", buffer) for key, buffer in non_persistent_buffers(layer))
        _assign(self.module, self.path, self.original)
        return empty

    def finish(self, tied: Mapping[str, torch.Tensor]) -> None:
        """End :meth:`put_back`: each tied tensor one tensor again, holding ``tied``'s value (:meth:`TiedCopies.values`;
        putting layers back gives each name of a tied tensor its own), and deferred BatchNorm layers plain BatchNorm
        again, with the running statistics they gathered."""
        retie(self.original, self.ties, tied)
        DeferredBatchNorm.revert(self.original)

    def reassemble(self, parts: Sequence[Mapping[str, torch.Tensor]], tied: Mapping[str, torch.Tensor]) -> None:
        """Put the whole model back on the CPU from every stage's :meth:`stage_state`, all in this process (in-process
        pipelines, tests): :meth:`put_back` with every layer allocated, filled from ``parts``, then :meth:`finish`."""
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        with torch.no_grad():
            for key, tensor in self.put_back(allocate=True).items():
                tensor.copy_(merged[key])
        self.finish(tied)


def non_persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers of ``module`` that its state dict leaves out, with their dotted names."""
    for prefix, submodule in module.named_modules(remove_duplicate=False):  # a shared module under each name
        for name in submodule._non_persistent_buffers_set:
            buffer = submodule._buffers.get(name)
            if buffer is not None:
                yield f"{prefix}.{name}".lstrip("."), buffer


def _check_aliases(module: nn.Module, path: str, sequence: nn.Sequential) -> None:
    """Refuse modules or parameters outside the sequence that are also in it (a Hugging Face model kept whole next
    to the layers built from it): each stage keeps only its own layers, so the alias would hold the others' on meta."""
    # Only modules with state: one without parameters or buffers (an activation reused outside) loses nothing.
    names = {id(sub): f"{path}.{name}".rstrip(".") for name, sub in sequence.named_modules() if _has_state(sub)}
    names.update({id(p): f"{path}.{name}" for name, p in sequence.named_parameters()})
    aliases = [
        f"{name} is {names[id(item)]}"
        for name, item in [
            *module.named_modules(remove_duplicate=False),
            *module.named_parameters(remove_duplicate=False),
        ]
        if name and name != path and not name.startswith(f"{path}.") and id(item) in names
    ]
    if aliases:
        owner = aliases[0].split(".", 1)[0].split(" ", 1)[0]
        raise ValueError(
            f"{type(module).__name__} reaches layers of the pipelined sequence {path!r} from outside it too: "
            f"{', '.join(aliases[:3])}{' and more' if len(aliases) > 3 else ''}; assign {owner!r} "
            f"with `object.__setattr__(self, {owner!r}, model)`"
        )


def _has_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def partition_module(
    module: nn.Module, path: str, sequence: nn.Sequential, balance: Sequence[int], stage: int | Sequence[int]
) -> Partition:
    """Replace ``sequence`` (the attribute ``path`` of ``module``) by the stand-in of this process's ``stage`` (an
    index of ``balance``, or several: the stages one process holds under ``"interleaved"`` or ``"zbv"``).

    Refuses trainable parameters outside the sequence, which one stage alone would update. A tensor (or module) that
    layers of several stages share stays on every stage that uses it; :mod:`lightning_gpipe.partition.tied` keeps its
    copies equal.
    """
    _check_aliases(module, path, sequence)
    inside = {id(p) for p in sequence.parameters()}
    outside = [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        raise ValueError(
            f"trainable parameters outside the pipelined sequence {path!r}: {', '.join(outside[:5])}"
            f"{' ...' if len(outside) > 5 else ''}; move them into the nn.Sequential, or freeze them"
        )
    bounds = cell_bounds(balance)
    layers = list(sequence._modules.items())  # not named_children(), which drops a module used twice
    ties = find_ties(sequence, balance)
    stages = (stage,) if isinstance(stage, int) else tuple(sorted(stage))
    held = {index for s in stages for index in bounds[s]}
    own = OrderedDict(layers[i] for i in sorted(held))
    # The other stages' layers keep their structure for reassembly, on meta: no memory.
    set_aside([layer for index, (_, layer) in enumerate(layers) if index not in held], list(own.values()))
    stand_in = PipelinedSequential(own, len(layers), stages, len(bounds))
    stand_in.balance = list(balance)
    _assign(module, path, stand_in)
    return Partition(module, path, sequence, stand_in, bounds, ties)


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Draw from the CPU generator and ``device``'s seeded ``seed``, and leave every generator as it was.

    Not ``torch.manual_seed``: it reseeds every CUDA generator (or queues that until CUDA starts), which the fork would
    not undo, and the user's seeded CUDA stream would be lost.
    """
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.random.default_generator.manual_seed(seed)
        for index in cuda:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


def materialize(
    layers: Sequence[tuple[int, nn.Module]],
    device: torch.device,
    seed: int,
    provided: Callable[[int, str], bool] | None = None,
) -> None:
    """Allocate the meta tensors of ``layers`` on ``device`` and initialize them with their ``reset_parameters``.

    Layer ``i`` is initialized from a generator seeded ``seed + i``, so its weights are the same whichever stage
    holds it: a model built on meta starts from the same parameters for every number of stages. Tensors that are not
    on meta (a rotary table computed when the model was built) keep their values. ``provided(i, name)`` says that a
    weights reader will fill tensor ``name`` of layer ``i`` (:mod:`lightning_gpipe.partition.reader`): such tensors
    are only allocated, and a layer whose meta tensors are all provided is not initialized at all.
    """
    untouched: dict[int, list[str]] = {}
    for index, layer in layers:
        meta = [name for name, (tensor, _) in _versions(layer).items() if tensor.is_meta]
        if not meta:
            continue
        fresh = [name for name in meta if provided is None or not provided(index, name)]
        allocate_meta(layer, meta, device)
        if not fresh:
            continue
        allocated = _versions(layer)
        with _seeded(seed + index, device):
            for submodule in layer.modules():
                reset = getattr(submodule, "reset_parameters", None)
                if callable(reset):
                    reset()
        names = _never_written(index, layer, {name: allocated[name] for name in fresh})
        if names:
            untouched[index] = names
    # Refused only once every layer is allocated: the teardown after the error moves the module to the CPU, which
    # a layer left on the meta device would fail with torch's "Cannot copy out of meta tensor" instead.
    if untouched:
        indices = [str(index) for index in untouched]
        names = [name for layer_names in untouched.values() for name in layer_names]
        shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
        raise ValueError(
            f"layer{'s' if len(indices) > 1 else ''} {', '.join(indices)} {'were' if len(indices) > 1 else 'was'} "
            f"built on the meta device, and no reset_parameters() initializes {shown}: add one to their module, or "
            "build the model in __init__"
        )


def _versions(layer: nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    # Every in-place write (nn.init, fill_, copy_) bumps a tensor's version counter: a tensor still at the version
    # its allocation gave it, and not replaced, was never written.
    tensors = [*layer.named_parameters(remove_duplicate=False), *layer.named_buffers(remove_duplicate=False)]
    return {name: (tensor, tensor._version) for name, tensor in tensors}


def _never_written(index: int, layer: nn.Module, allocated: Mapping[str, tuple[torch.Tensor, int]]) -> list[str]:
    after = dict(_versions(layer))
    return [
        f"{index}.{name}"
        for name, (tensor, version) in allocated.items()
        # An empty tensor has no memory to leave uninitialized.
        if name in after and after[name][0] is tensor and tensor._version == version and tensor.numel() > 0
    ]
