"""Every use of torch's private API in the package, in one place, checked by ``test_compat.py``.

Besides the names below, ``BatchNormBase`` is torch's private base class of its BatchNorm layers (``_BatchNorm``):
what ``DeferredBatchNorm`` subclasses and what re-materialization, tied copies and the planner recognize as BatchNorm.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "InfAgreeingScaler",
    "TorchDispatchMode",
    "abort_process_group",
    "compile_in_place",
    "flatten_dense_tensors",
    "keep_compiled_saved_tensors",
    "memoryless_tensor",
    "restore_compiled_call",
    "storage_key",
    "unflatten_dense_tensors",
]

flatten_dense_tensors = _flatten_dense_tensors
"""One flat tensor holding the given tensors of one dtype and device, as DDP's buckets are made."""
unflatten_dense_tensors = _unflatten_dense_tensors
"""Views of a flat tensor shaped like the given tensors."""

_memoryless = FakeTensorMode()


def memoryless_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``shape`` and ``dtype`` without memory (a fake tensor), which ``torch.save`` saves as a CPU
    tensor under ``torch.serialization.skip_data(materialize_fake_tensors=True)``."""
    with _memoryless:
        return torch.empty(shape, dtype=dtype)


# Not in __all__: it is torch's own class, whose missing docstring the reference would show; the module's says it.
BatchNormBase = _BatchNorm
"""The base class of torch's ``BatchNorm1d``/``2d``/``3d`` and ``SyncBatchNorm`` (running statistics, ``momentum``)."""

# TorchDispatchMode (a mode that sees every operator dispatched, with its tensors) lives in the private
# torch.utils._python_dispatch; it is re-exported from here, the one place that imports it.


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


CompiledCall = Callable[..., Any] | None
"""What a module's call runs instead of its own (``nn.Module.compile`` sets it); ``None`` when it is not compiled."""


def compile_in_place(module: nn.Module, options: Mapping[str, Any]) -> CompiledCall:
    """``module.compile(**options)``, which keeps the module and its names, also for torch's own module classes.

    Dynamo skips frames in torch's files, so a layer whose ``forward`` is torch's (``nn.Linear``, ``nn.LayerNorm``)
    would run eagerly under ``module.compile()``; as ``torch.compile(module)`` does for them, a frame of ours calls
    it instead. Returns the call the module ran before, for :func:`restore_compiled_call`.
    """
    previous: CompiledCall = module.__dict__.get("_compiled_call_impl")
    if not type(module).forward.__module__.startswith("torch."):
        module.compile(**options)  # its own forward is the frame dynamo compiles, one cache for all its instances
        return previous
    call = module._call_impl

    def torch_module_call(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    module._compiled_call_impl = torch.compile(torch_module_call, **options)
    return previous


def keep_compiled_saved_tensors() -> None:
    """Compile every later graph without donating its saved tensors' buffers to its backward (for this process).

    A split backward (``"zero_bubble"``, ``"zbv"``) runs a compiled layer's backward with the graph kept, since its
    input pass keeps the graph that its weight pass starts from. torch refuses that for a backward compiled to reuse
    its saved buffers ("compiled with non-empty donated buffers"): one compiled by a backward that did not keep the
    graph (a first stage's whole backward), which torch's compile cache then hands to other processes. Costs that
    reuse's memory saving.
    """
    torch._functorch.config.donated_buffer = False


def restore_compiled_call(module: nn.Module, previous: CompiledCall) -> None:
    """Undo :func:`compile_in_place`: the module runs ``previous`` again (its own call when ``None``)."""
    module._compiled_call_impl = previous


def abort_process_group(group: dist.ProcessGroup) -> None:
    """Abort ``group``'s pending operations so that the process can exit (torch has no public abort)."""
    dist.distributed_c10d._abort_process_group(group)
