"""The ``nn.Sequential`` to pipeline, found in the user's module, or why the module's layers are not one sequence."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

__all__ = ["find_sequence"]


def _resolve(module: nn.Module, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), module)


def find_sequence(module: nn.Module, module_name: str | None = None) -> tuple[str, nn.Sequential]:
    """The ``nn.Sequential`` to pipeline: ``module_name`` (a dotted attribute path) or the only top-level one.

    Found automatically, it must be the model's sequence, not a sub-block of it: a model whose layers sit in an
    ``nn.ModuleList`` (a GPT's blocks), or whose only ``nn.Sequential`` attributes are small parts (a U-Net's
    ``enc1``, a block's ``mlp``), is refused with how to rewrite it as one sequence.
    """
    if module_name is not None:
        try:
            found = _resolve(module, module_name)
        except AttributeError:
            found = None
        if not isinstance(found, nn.Sequential):
            raise TypeError(
                f"module_name={module_name!r} must name an nn.Sequential attribute of {type(module).__name__}, "
                f"found {type(found).__name__ if found is not None else 'nothing'}"
            )
        return module_name, found
    candidates: list[tuple[str, nn.Sequential]] = []
    for name, child in module.named_modules():
        if isinstance(child, nn.Sequential) and not any(name.startswith(f"{c}.") for c, _ in candidates):
            candidates.append((name, child))
    reason = _not_one_sequence(module, candidates)
    if reason is not None:
        raise TypeError(
            f"{type(module).__name__}'s layers are not one sequence: {reason}; rewrite them as one nn.Sequential: "
            "docs/getting_started.md#models-that-are-not-one-sequence"
        )
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise TypeError(
            f"{type(module).__name__} has no nn.Sequential to pipeline; build `self.layers = nn.Sequential(...)`"
        )
    names = ", ".join(repr(name) for name, _ in candidates)
    largest = max(candidates, key=lambda candidate: _count(_trainable(candidate[1])))[0]
    raise TypeError(
        f"{type(module).__name__} has several nn.Sequential attributes ({names}); "
        f"pick one, e.g. module_name={largest!r}"
    )


def _trainable(module: nn.Module) -> dict[int, int]:
    """The sizes of ``module``'s trainable parameters, by identity (a tied parameter once)."""
    return {id(p): p.numel() for p in module.parameters() if p.requires_grad}


def _kind(module: nn.Module, path: str) -> str:
    return "nn.ModuleList" if isinstance(module.get_submodule(path), nn.ModuleList) else "nn.ModuleDict"


def _count(parameters: Mapping[int, int]) -> int:
    return sum(parameters.values())


def _not_one_sequence(module: nn.Module, candidates: Sequence[tuple[str, nn.Sequential]]) -> str | None:
    """Why no ``nn.Sequential`` found in ``module`` can be its sequence, or None when the usual rules apply.

    Only when none holds every trainable parameter (setup would refuse the others anyway) and the one holding most is
    not the model's sequence: its layers are in an ``nn.ModuleList`` or ``nn.ModuleDict``, the sequence is part of a
    larger trainable block (a block's ``mlp``), several sequences hold trainable layers (a U-Net's ``enc1``,
    ``enc2``, ...), or it holds less than half of them. A sequence with a small head outside it keeps setup's
    message, which says to move the head in; a frozen sequence beside a trainable one, the hint to name the latter.
    """
    trainable = _trainable(module)
    if not trainable:
        return None
    lists = [
        name
        for name, sub in module.named_modules()
        if isinstance(sub, nn.ModuleList | nn.ModuleDict) and _trainable(sub)
    ]
    if not candidates:  # the message that asks for an nn.Sequential, unless the layers are in a list
        return None if not lists else f"its layers are in an {_kind(module, lists[0])} ({lists[0]!r})"
    path, sequence = max(candidates, key=lambda candidate: _count(_trainable(candidate[1])))
    inside = _trainable(sequence)
    if inside.keys() >= trainable.keys():
        return None
    share = _count(inside) / _count(trainable)
    which = f"its nn.Sequential {path!r}" if len(candidates) == 1 else f"the largest of its nn.Sequential, {path!r},"
    found = f"{which} holds {share:.0%} of the trainable parameters"
    for name in lists:
        if not name.startswith(f"{path}.") and _trainable(module.get_submodule(name)).keys() - inside.keys():
            return f"its layers are in an {_kind(module, name)} ({name!r}); {found}"
    parts = path.split(".")
    for end in range(1, len(parts)):
        block = ".".join(parts[:end])
        if _trainable(module.get_submodule(block)).keys() - inside.keys():
            return f"{found} and is part of a larger block, {block!r}, with trainable layers outside it"
    trained = [name for name, candidate in candidates if _trainable(candidate)]
    if len(trained) > 1:  # naming one of them with module_name would leave the others' layers outside it
        shown = ", ".join(repr(name) for name in trained[:4]) + (", ..." if len(trained) > 4 else "")
        return f"its trainable layers are spread over {len(trained)} nn.Sequential ({shown}) joined in forward"
    if share < 0.5:
        return found
    return None
