"""Compiled stages: each layer of a stage compiled with ``torch.compile`` in place, its names unchanged.

Each layer is compiled in place (``nn.Module.compile``), never wrapped: its parameters keep their names, so
checkpoints, optimizer state keyed by name and ``strict=True`` loading into the plain module do not change. Assembly
compiles a stage's layers once they are final (materialized, tied weights restored, BatchNorm converted) and inside
the engine's re-materialization, which wraps the whole cell and so replays the compiled layers.

``dynamic=False`` is the default: torch's automatic dynamic shapes may give a later micro-batch a dynamic graph that
the replay of an earlier one then picks, saving other tensors than its forward did (torch's ``CheckpointError``).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_gpipe.engine.torch_compat import CompiledCall, compile_in_place, restore_compiled_call

__all__ = ["DEFAULT_OPTIONS", "Compile", "CompiledLayers", "check_compile", "compile_layers", "compile_options"]

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
        raise TypeError(
            f"compile={value!r} must be True, False or a dict of torch.compile's keyword arguments, e.g. "
            "compile={'mode': 'max-autotune'}"
        )
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

    def restore(self) -> None:
        """Give each layer back the call it had before (its own, unless the user compiled it)."""
        for layer, call in self.previous:
            restore_compiled_call(layer, call)
        self.previous.clear()


def compile_layers(layers: Iterable[nn.Module], options: Mapping[str, Any] | None) -> CompiledLayers:
    """Compile each of ``layers`` in place with ``torch.compile(**options)``; nothing when ``options`` is ``None``.

    Compilation happens at each layer's first call; a layer that appears twice is compiled once.
    """
    compiled = CompiledLayers()
    if options is None:
        return compiled
    seen: set[int] = set()
    for layer in layers:
        if id(layer) not in seen:
            seen.add(id(layer))
            compiled.previous.append((layer, compile_in_place(layer, options)))
    return compiled


def _nothing() -> None:
    return None
