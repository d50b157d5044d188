"""Compiled stages: each layer of a stage compiled with ``torch.compile`` in place, its names unchanged.

Each layer is compiled in place (``nn.Module.compile``), never wrapped: its parameters keep their names, so
checkpoints, optimizer state keyed by name and ``strict=True`` loading into the plain module do not change. Assembly
compiles a stage's layers once they are final (materialized, tied weights restored, BatchNorm converted) and inside
the engine's re-materialization, which wraps the whole cell and so replays the compiled layers.

With ``checkpoint="selective"`` each layer is compiled as ``selective_checkpoint(layer's call)`` instead
(:func:`~lightning_gpipe.engine.rematerialization.selective_checkpoint`): the policy lives inside the compiled graph,
whose partitioner keeps the matrix multiplications' and attention's outputs and fuses the replay of the rest into the
backward, and the stage wraps nothing (the engine's wrapper around a compiled layer sees one call and would replay it
whole). The layers re-materialize themselves, so on every micro-batch, the last included. A layer the graph cannot
replay alone stays under the engine's own wrapper, on its own (:func:`~lightning_gpipe.engine.rematerialization.
replayed_layer`): one holding a BatchNorm that tracks running statistics (deferred BatchNorm gathers them eagerly, in a
graph break, and a replay must not count them twice) or whose first module changes its input in place. Any other graph
break in a layer makes torch run that layer's checkpoint eagerly: it trains alike, without the compiled speed.

``dynamic=False`` is the default: torch's automatic dynamic shapes may give a later micro-batch a dynamic graph that
the replay of an earlier one then picks, saving other tensors than its forward did (torch's ``CheckpointError``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_gpipe.engine.rematerialization import replayed_layer, selective_checkpoint, tracks_running_stats
from lightning_gpipe.engine.torch_compat import (
    CompiledCall,
    compile_in_place,
    keep_compiled_saved_tensors,
    restore_compiled_call,
)
from lightning_gpipe.partition.balance import in_place_starts

__all__ = [
    "DEFAULT_OPTIONS",
    "Compile",
    "CompiledLayers",
    "check_compile",
    "compile_layers",
    "compile_options",
    "replayed_by_engine",
]

Compile = bool | Mapping[str, Any]
"""The ``compile`` setting: ``False``, ``True`` (torch's defaults but :data:`DEFAULT_OPTIONS`), or ``torch.compile``'s
keyword arguments."""

DEFAULT_OPTIONS: dict[str, Any] = {"dynamic": False}
"""Options given unless the user gives them: static shapes, so a micro-batch's replay runs its forward's graph."""


def check_compile(value: object) -> Compile:
    """``value`` as the ``compile`` setting (a dict copied), or a ``TypeError``/``ValueError`` naming it and the fix.

    Option names are checked against ``torch.compile``'s signature, and a dry ``torch.compile`` of a function checks
    their values (``mode``, ``backend``, inductor ``options``) now rather than at the first step.
    """
    if isinstance(value, bool):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"compile={value!r} must be True, False or a dict of torch.compile's keyword arguments")
    options = dict(value)
    known = [name for name in inspect.signature(torch.compile).parameters if name != "model"]
    unknown = [name for name in options if not isinstance(name, str) or name not in known]
    if unknown:
        what = "is not a keyword argument" if len(unknown) == 1 else "are not keyword arguments"
        raise ValueError(
            f"compile={options!r}: {', '.join(map(repr, unknown))} {what} of torch.compile; use some of "
            f"{', '.join(known)}"
        )
    try:
        torch.compile(_nothing, **{**DEFAULT_OPTIONS, **options})  # builds the compiler: a bad mode, backend...
    except Exception as error:
        said = str(error) if len(str(error)) <= 300 else f"{str(error)[:300]}..."  # inductor lists all its options
        raise ValueError(f"compile={options!r} is refused by torch.compile: {said}") from error
    return options


def compile_options(value: Compile) -> dict[str, Any] | None:
    """The keyword arguments of ``torch.compile`` for a checked ``compile`` setting; ``None`` when off."""
    if value is False:
        return None
    return {**DEFAULT_OPTIONS, **(value if isinstance(value, Mapping) else {})}


@dataclass
class CompiledLayers:
    """Layers compiled in place by :func:`compile_layers`, and what each ran before, for :meth:`restore`."""

    previous: list[tuple[nn.Module, CompiledCall]] = field(default_factory=list)
    release: Callable[[], None] | None = None  # gives back torch's donated-buffer setting

    def restore(self) -> None:
        """Give each layer back the call it had before (its own, unless the user compiled it), and torch its
        setting of donated buffers."""
        for layer, call in self.previous:
            restore_compiled_call(layer, call)
        self.previous.clear()
        if self.release is not None:
            self.release()
            self.release = None


def compile_layers(
    layers: Iterable[nn.Module], options: Mapping[str, Any] | None, *, selective: bool = False
) -> CompiledLayers:
    """Compile each of ``layers`` in place with ``torch.compile(**options)``; nothing when ``options`` is ``None``.

    With ``selective``, each layer re-materializes itself under the selective policy, inside its graph where it can
    (:func:`replayed_by_engine` says where not). Compilation happens at each layer's first call; a layer that appears
    twice is compiled once. Until :meth:`CompiledLayers.restore`, torch donates no saved buffers to compiled backwards
    (:func:`~lightning_gpipe.engine.torch_compat.keep_compiled_saved_tensors`).
    """
    compiled = CompiledLayers()
    if options is None:
        return compiled
    compiled.release = keep_compiled_saved_tensors()  # a split backward runs a compiled layer's backward twice
    seen: set[int] = set()
    for layer in layers:
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        if not selective:
            compiled.previous.append((layer, compile_in_place(layer, options)))
        elif replayed_by_engine(layer):
            previous = compile_in_place(layer, options)
            assert layer._compiled_call_impl is not None
            layer._compiled_call_impl = replayed_layer(layer, layer._compiled_call_impl)
            compiled.previous.append((layer, previous))
        else:
            previous = layer.__dict__.get("_compiled_call_impl")
            layer._compiled_call_impl = torch.compile(selective_checkpoint(layer._call_impl), **options)
            compiled.previous.append((layer, previous))
    return compiled


def replayed_by_engine(layer: nn.Module) -> bool:
    """Whether a compiled selective ``layer`` is replayed by the engine's wrapper rather than inside its graph.

    Its graph cannot hold a BatchNorm's statistics without counting a replay twice (deferred BatchNorm gathers them
    eagerly), nor replay from an input the layer changed in place.
    """
    return any(tracks_running_stats(m) for m in layer.modules()) or bool(in_place_starts([layer]))


def _nothing() -> None:
    return None
