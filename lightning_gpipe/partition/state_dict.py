"""Whole-model checkpoints from pipeline stages: state dicts merged, optimizer state keyed by parameter name.

Each stage holds the state of its own layers under the unpartitioned model's names, so merging is a union. Optimizer
state is re-keyed from the optimizer's positional indices to parameter names, with each group's parameters listed in
the whole model's order. That one format loads into any number of stages (each takes the names it holds) and, because
``torch.optim.Optimizer.load_state_dict`` matches parameters by position, also into the plain model's optimizer.

A tied parameter has several names (the plain module's ``named_parameters`` lists it once, under its first) and one
copy on each stage that uses it. Its optimizer state is keyed by that first name: every copy's state maps to it, and
every copy loads it (:func:`parameter_aliases`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "ModelNames",
    "check_loadable",
    "local_optimizer_state",
    "merge_optimizer_states",
    "merge_state_dicts",
    "optimizer_state_by_name",
    "parameter_aliases",
    "parameter_names",
    "state_by_name",
]


@dataclass(frozen=True)
class ModelNames:
    """The whole module's names, recorded before it is cut into stages: what checkpoints are saved under.

    Attributes:
        keys: its state-dict keys, in order (merged checkpoints list them so).
        shapes: the shape of each tensor of its state dict (a checkpoint is checked against them before loading).
        parameter_order: its parameters' names, in ``named_parameters`` order (optimizer state is keyed by them).
        aliases: every further name of a tied parameter, mapped to its first (:func:`parameter_aliases`).
    """

    keys: list[str]
    shapes: dict[str, tuple[int, ...]]
    parameter_order: list[str]
    aliases: dict[str, str]

    @classmethod
    def of(cls, module: nn.Module) -> ModelNames:
        """The names of ``module`` as it is now (call it before the split)."""
        state = module.state_dict()
        return cls(
            keys=list(state.keys()),
            shapes={key: tuple(value.shape) for key, value in state.items() if isinstance(value, torch.Tensor)},
            parameter_order=[name for name, _ in module.named_parameters()],
            aliases=parameter_aliases(module),
        )


def merge_state_dicts(parts: Sequence[Mapping[str, Any]], order: Sequence[str]) -> dict[str, Any]:
    """One state dict from the stages' parts, keys in the whole model's ``order``."""
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    missing = [key for key in order if key not in merged]
    if missing:
        raise RuntimeError(f"no stage holds {', '.join(missing[:5])}: the stages' partitions do not cover the model")
    return {key: merged[key] for key in order}


def parameter_aliases(module: nn.Module) -> dict[str, str]:
    """Every further name of a parameter that ``module`` names several times (tied weights), mapped to its first."""
    first: dict[int, str] = {}
    aliases = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(parameter), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


def parameter_names(module: nn.Module, aliases: Mapping[str, str] | None = None) -> dict[int, str]:
    """The name each parameter of ``module`` has in a name-keyed optimizer state, by the parameter's ``id``: a tied
    parameter's first name (``aliases``, :func:`parameter_aliases` of the whole model)."""
    aliases = aliases or {}
    return {id(parameter): aliases.get(name, name) for name, parameter in module.named_parameters()}


def optimizer_state_by_name(
    optimizer: torch.optim.Optimizer, module: nn.Module, aliases: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameter names in place of positions; ``aliases`` rename tied parameters."""
    names = parameter_names(module, aliases)
    state = optimizer.state_dict()
    positions = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {
        "state": {positions[index]: value for index, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [positions[index] for index in group["params"]]} for group in state["param_groups"]
        ],
    }


def merge_optimizer_states(parts: Sequence[Mapping[str, Any]], order: Sequence[str]) -> dict[str, Any]:
    """One name-keyed optimizer state from the stages' parts; group ``g`` collects every stage's group ``g``.

    A tied parameter's copies (on several stages, under one name) hold the same state: it is kept once.
    """
    counts = {len(part["param_groups"]) for part in parts}
    if len(counts) != 1:
        raise RuntimeError(f"the stages' optimizers have different numbers of parameter groups: {sorted(counts)}")
    rank = {name: position for position, name in enumerate(order)}
    groups = []
    for index in range(counts.pop()):
        group = dict(parts[0]["param_groups"][index])
        names = {name for part in parts for name in part["param_groups"][index]["params"]}
        group["params"] = sorted(names, key=rank.__getitem__)
        groups.append(group)
    state: dict[str, Any] = {}
    for part in parts:
        state.update(part["state"])
    return {"state": state, "param_groups": groups}


def state_by_name(saved: Mapping[str, Any], order: Sequence[str]) -> Mapping[str, Any]:
    """``saved`` keyed by parameter name: as it is when it is, else a positional (plain PyTorch) optimizer state whose
    single group lists the model's parameters in ``order``, re-keyed."""
    groups = saved["param_groups"]
    if all(isinstance(name, str) for group in groups for name in group["params"]):
        return saved
    positions = [index for group in groups for index in group["params"]]
    if len(groups) != 1 or positions != list(range(len(order))):
        raise ValueError(
            f"this checkpoint's optimizer state is keyed by position ({len(groups)} groups, {len(positions)} "
            f"parameters for a model of {len(order)}); load only the weights"
        )
    return {
        "state": {order[index]: value for index, value in saved["state"].items()},
        "param_groups": [{**groups[0], "params": list(order)}],
    }


def local_optimizer_state(
    saved: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    module: nn.Module,
    order: Sequence[str],
    aliases: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The part of a saved optimizer state that belongs to this stage's ``optimizer``, ready for ``load_state_dict``.

    ``order`` lists the whole model's parameter names (used to read positional, plain-PyTorch states); ``aliases``
    rename tied parameters to the name their state is saved under (:func:`parameter_aliases` of the whole model).
    """
    saved = state_by_name(saved, order)
    names = parameter_names(module, aliases)
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved['param_groups'])} parameter groups, this one has "
            f"{len(optimizer.param_groups)}; resume with the same groups"
        )
    groups, state = [], {}
    for saved_group, group in zip(saved["param_groups"], optimizer.param_groups, strict=True):
        local = [names[id(p)] for p in group["params"]]
        unknown = [name for name in local if name not in saved_group["params"]]
        if unknown:
            raise ValueError(
                f"the checkpoint's optimizer has no entry for {', '.join(unknown[:5])} in this parameter group; "
                "resume with the same model and groups"
            )
        groups.append({**saved_group, "params": local})
        state.update({name: saved["state"][name] for name in local if name in saved["state"]})
    return {"state": state, "param_groups": groups}


def check_loadable(
    saved: Mapping[str, Any],
    keys: Sequence[str],
    shapes: Mapping[str, tuple[int, ...]],
    strict: bool = True,
    source: str = "checkpoint",
) -> None:
    """Refuse a whole-model state dict that does not fit the model whose state-dict ``keys`` and tensor ``shapes``
    are given, naming what is missing, unexpected or of another shape. With ``strict=False`` only shapes count.

    Every stage checks the whole checkpoint, not only its own part, so that all stages fail together with the same
    message instead of one failing while the others wait for it.
    """
    if strict:
        known = set(keys)
        unexpected = [key for key in saved if key not in known]
        missing = [key for key in keys if key not in saved]
        if unexpected or missing:
            raise ValueError(
                f"{source}: the checkpoint does not match this model: "
                f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
                f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} (another model's, or one "
                "stage's). Nothing was loaded."
            )
    mismatched = [
        f"{key}: {tuple(saved[key].shape)} in the checkpoint, {shape} in the model"
        for key, shape in shapes.items()
        if isinstance(saved.get(key), torch.Tensor) and tuple(saved[key].shape) != shape
    ]
    if mismatched:
        raise ValueError(
            f"{source}: the checkpoint does not match this model: {len(mismatched)} tensor(s) have another shape "
            f"({'; '.join(mismatched[:3])}{' ...' if len(mismatched) > 3 else ''}): build the model with the "
            "checkpoint's sizes. Nothing was loaded."
        )
