"""The user's LightningModule cut down to this rank's cell, and put back together after training.

The module keeps its shape: its ``nn.Sequential`` attribute is replaced by a :class:`PipelinedSequential` that holds
only this stage's layers, registered under their original indices. Parameter names, ``state_dict`` keys and therefore
checkpoints stay those of the unpartitioned model, and ``configure_optimizers`` sees only this stage's parameters.
The other stages' layers are kept aside on the ``meta`` device, which holds their structure but no memory, so that the
whole model can be reassembled when training ends; a tensor they share with this stage's layers (tied weights) stays.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_gpipe.partition import cell_bounds
from lightning_gpipe.tied import Tie, find_ties, set_aside

__all__ = ["Partition", "PipelinedSequential", "find_sequence", "materialize", "partition_module"]


def _resolve(module: nn.Module, path: str) -> Any:
    target: Any = module
    for part in path.split("."):
        target = getattr(target, part)
    return target


def _assign(module: nn.Module, path: str, value: nn.Module) -> None:
    *parents, name = path.split(".")
    owner = _resolve(module, ".".join(parents)) if parents else module
    setattr(owner, name, value)


def find_sequence(module: nn.Module, module_name: str | None = None) -> tuple[str, nn.Sequential]:
    """The ``nn.Sequential`` to pipeline: ``module_name`` (a dotted attribute path) or the only top-level one."""
    if module_name is not None:
        try:
            found = _resolve(module, module_name)
        except AttributeError:
            found = None
        if not isinstance(found, nn.Sequential):
            raise TypeError(
                f"module_name={module_name!r} must name an nn.Sequential attribute of {type(module).__name__}, "
                f"found {type(found).__name__ if found is not None else 'nothing'}; "
                "put the layers to pipeline in one nn.Sequential and pass its attribute name"
            )
        return module_name, found
    candidates: list[tuple[str, nn.Sequential]] = []
    for name, child in module.named_modules():
        if isinstance(child, nn.Sequential) and not any(name.startswith(f"{c}.") for c, _ in candidates):
            candidates.append((name, child))
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise TypeError(
            f"{type(module).__name__} has no nn.Sequential to pipeline. GPipeStrategy partitions one sequence of "
            "layers: build them as `self.layers = nn.Sequential(...)` and call `self.layers(x)` in training_step."
        )
    names = ", ".join(repr(name) for name, _ in candidates)
    raise TypeError(
        f"{type(module).__name__} has several nn.Sequential attributes ({names}); "
        f"say which one to pipeline with GPipeStrategy(module_name=...), e.g. module_name={candidates[0][0]!r}"
    )


class PipelinedSequential(nn.Module):
    """Stands in for the user's ``nn.Sequential`` on one stage.

    It holds this stage's layers under their original indices. Calling it runs ``runner`` (set by the strategy for the
    duration of a step), which pipelines the call; outside a step it refuses to run, since most layers live elsewhere.
    """

    def __init__(self, layers: Mapping[str, nn.Module], num_layers: int, stage: int, num_stages: int) -> None:
        super().__init__()
        for name, layer in layers.items():
            self.add_module(name, layer)
        self.num_layers = num_layers
        self.stage = stage
        self.num_stages = num_stages
        self.runner: Callable[[Any], Any] | None = None

    def cell(self) -> nn.Sequential:
        """This stage's layers as a plain ``nn.Sequential`` (the same module objects)."""
        return nn.Sequential(OrderedDict(self._modules.items()))  # type: ignore[arg-type]

    def forward(self, value: Any) -> Any:
        if self.runner is None:
            raise RuntimeError(
                f"this pipelined sequence holds stage {self.stage} of {self.num_stages} only (layers "
                f"{', '.join(dict(self.named_children()))} of {self.num_layers}); it runs inside the Trainer's "
                "steps. After trainer.fit() returns, the module holds the whole sequence again."
            )
        return self.runner(value)

    def extra_repr(self) -> str:
        return f"stage={self.stage}/{self.num_stages}, layers of {self.num_layers}"


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
        """The pipeline stage this process runs."""
        return self.stand_in.stage

    def owner_of(self, key: str) -> int | None:
        """The stage holding state-dict ``key`` (a key of the whole module); None if it is outside the sequence."""
        prefix = f"{self.path}."
        if not key.startswith(prefix):
            return None
        index = int(key[len(prefix) :].split(".", 1)[0])
        return next(stage for stage, bound in enumerate(self.bounds) if index in bound)

    def restore(self, sequence_state: Mapping[str, torch.Tensor], device: torch.device) -> None:
        """Put the whole sequence back, its layers loaded from ``sequence_state`` (keys relative to the sequence)."""
        for index, layer in enumerate(self.original):
            if self.owner_of(f"{self.path}.{index}") != self.stage:
                layer.to_empty(device=device)
        self.original.load_state_dict(sequence_state, strict=True)
        _assign(self.module, self.path, self.original)


def partition_module(
    module: nn.Module, path: str, sequence: nn.Sequential, balance: Sequence[int], stage: int
) -> Partition:
    """Replace ``sequence`` (the attribute ``path`` of ``module``) by this stage's stand-in.

    Refuses trainable parameters outside the sequence, which one stage alone would update. A tensor (or module) that
    layers of several stages share stays on every stage that uses it; :mod:`lightning_gpipe.tied` keeps its copies
    equal.
    """
    outside = [name for name, p in module.named_parameters() if p.requires_grad and not name.startswith(f"{path}.")]
    if outside:
        raise ValueError(
            f"trainable parameters outside the pipelined sequence {path!r}: {', '.join(outside[:5])}"
            f"{' ...' if len(outside) > 5 else ''}. Every trainable layer must be inside the nn.Sequential, since "
            "each stage only updates its own layers: move them into it (e.g. the head as its last layer) or freeze "
            "them."
        )
    bounds = cell_bounds(balance)
    layers = list(sequence._modules.items())  # not named_children(), which drops a module used twice
    ties = find_ties(sequence, balance)
    own = OrderedDict(layers[i] for i in bounds[stage])
    # The other stages' layers keep their structure for reassembly, on meta: no memory.
    set_aside([layer for index, (_, layer) in enumerate(layers) if index not in bounds[stage]], list(own.values()))
    stand_in = PipelinedSequential(own, len(layers), stage, len(bounds))
    _assign(module, path, stand_in)
    return Partition(module, path, sequence, stand_in, bounds, ties)


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def materialize(layers: Sequence[tuple[int, nn.Module]], device: torch.device, seed: int) -> None:
    """Allocate meta-device layers on ``device`` and initialize them with their ``reset_parameters``.

    Layer ``i`` is initialized from a generator seeded ``seed + i``, so its weights are the same whichever stage
    holds it: a model built on meta starts from the same parameters for every number of stages.
    """
    for index, layer in layers:
        if not any(t.is_meta for t in [*layer.parameters(), *layer.buffers()]):
            continue
        layer.to_empty(device=device)
        with _seeded(seed + index):
            for submodule in layer.modules():
                reset = getattr(submodule, "reset_parameters", None)
                if callable(reset):
                    reset()
