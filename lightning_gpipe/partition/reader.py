"""Pretrained weights read per stage: the reader a module hands over, and a stage's tensors filled from it.

A module built on the meta device whose weights wait in files (``zoo.load_pretrained`` builds every pretrained model
so) offers the duck-typed method ``claim_weights_reader()``: it returns a :class:`WeightsReader` and leaves the
reading to its caller from then on (unclaimed, the module reads everything on first use).
:class:`~lightning_gpipe.GPipeStrategy` claims it in ``connect``, before Lightning's ``configure_model`` hook would
have the module read everything; after the cut, each process allocates only its own layers
(:func:`~lightning_gpipe.partition.sequence.materialize`, which initializes what the reader does not provide) and
fills them with :func:`read_held`. A tensor tied across stages is read by every stage that holds it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

__all__ = ["WeightsReader", "allocate_meta", "claim_reader", "read_held"]


@runtime_checkable
class WeightsReader(Protocol):
    """Reads named tensors of a module's state dict from storage, any subset of them, in any order."""

    def keys(self) -> Collection[str]:
        """The module's state-dict keys (of the whole module, before any cut) whose values the reader holds."""
        ...

    def read_into(self, tensors: Mapping[str, Tensor]) -> None:
        """Copy the stored value of each key into its tensor, converting it to the tensor's dtype and device."""
        ...


def claim_reader(module: nn.Module) -> WeightsReader | None:
    """The reader ``module`` hands over through ``claim_weights_reader()``, or ``None`` when it has none to give."""
    claim = getattr(module, "claim_weights_reader", None)
    reader = claim() if callable(claim) else None
    if reader is not None and not isinstance(reader, WeightsReader):
        raise TypeError(
            f"{type(module).__name__}.claim_weights_reader() returned a {type(reader).__name__}, which lacks keys() "
            "or read_into(tensors); return an object with both"
        )
    return reader


def read_held(
    module: nn.Module, reader: WeightsReader, device: torch.device, only: Callable[[str], bool] | None = None
) -> list[str]:
    """Fill every tensor that ``module`` holds now and ``reader`` provides (those of keys ``only`` accepts); returns
    their state-dict keys.

    Tensors still on the meta device (a frozen part outside the pipelined sequence) are allocated on ``device`` first;
    the sequence's own layers are allocated by :func:`~lightning_gpipe.partition.sequence.materialize`.
    """
    provided = set(reader.keys())
    state = nn.Module.state_dict(module, keep_vars=True)  # the plain state dict, whatever the module overrides
    keys = [key for key in state if key in provided and (only is None or only(key))]
    allocate_meta(module, [key for key in keys if state[key].is_meta], device)
    state = nn.Module.state_dict(module, keep_vars=True)
    with torch.no_grad():
        reader.read_into({key: state[key].detach() for key in keys})
    return keys


def allocate_meta(module: nn.Module, names: Iterable[str], device: torch.device) -> None:
    """Give the tensors ``names`` of ``module`` (parameters or buffers, dotted names) that are on the meta device
    uninitialized memory on ``device``; a tensor under several names stays one tensor."""
    allocated: dict[int, torch.Tensor] = {}
    for name in names:
        path, _, attribute = name.rpartition(".")
        owner = module.get_submodule(path)
        table: dict[str, Any] = owner._parameters if attribute in owner._parameters else owner._buffers
        tensor = table[attribute]
        if tensor is None or not tensor.is_meta:
            continue
        new = allocated.get(id(tensor))
        if new is None:
            empty = torch.empty_like(tensor, device=device)
            new = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
            allocated[id(tensor)] = new
        table[attribute] = new
