"""Every use of torch's private API in the engine and the build layer, in one place, checked by ``test_compat.py``."""

from __future__ import annotations

from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

__all__ = ["InfAgreeingScaler", "flatten_dense_tensors", "storage_key", "unflatten_dense_tensors"]

flatten_dense_tensors = _flatten_dense_tensors
"""One flat tensor holding the given tensors of one dtype and device, as DDP's buckets are made."""
unflatten_dense_tensors = _unflatten_dense_tensors
"""Views of a flat tensor shaped like the given tensors."""


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s memory: views of one storage share it. Meta storages have no address; their
    storage object's ``_cdata`` tells them apart, alive as long as ``tensor``."""
    storage = tensor.untyped_storage()
    return int(storage._cdata) if tensor.is_meta else int(storage.data_ptr())


class InfAgreeingScaler(ShardedGradScaler):
    """A ``ShardedGradScaler`` that lets a subclass agree on the found infs of an optimizer that unscales itself.

    An optimizer that unscales inside its own step (``fused=True``) has its infs found by the private
    ``_check_inf_per_device``, which ``ShardedGradScaler`` leaves local; :meth:`agree` sees them there.
    """

    def agree(self, found: dict[Any, torch.Tensor]) -> None:
        """Make the found-inf flags the same on every rank (in place)."""

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        found = super()._check_inf_per_device(optimizer)
        self.agree(found)
        return found
