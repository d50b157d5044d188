"""Every use of torch's private API in the package, in one place, checked by ``test_compat.py``.

Besides the names below, ``BatchNormBase`` is torch's private base class of its BatchNorm layers (``_BatchNorm``):
what ``DeferredBatchNorm`` subclasses and what re-materialization, tied copies and the planner recognize as BatchNorm.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "InfAgreeingScaler",
    "TorchDispatchMode",
    "abort_process_group",
    "compile_in_place",
    "drop_unsharded_gradients",
    "flatten_dense_tensors",
    "keep_compiled_saved_tensors",
    "memoryless_tensor",
    "reduce_unsharded_gradients",
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


def keep_compiled_saved_tensors() -> Callable[[], None]:
    """Compile graphs without donating their saved tensors' buffers to their backward, until the returned function
    is called (it puts torch's setting back once every caller has called its own).

    A split backward (``"zero_bubble"``, ``"zbv"``) runs a compiled layer's backward with the graph kept, since its
    input pass keeps the graph that its weight pass starts from. torch refuses that for a backward compiled to reuse
    its saved buffers ("compiled with non-empty donated buffers"): one compiled by a backward that did not keep the
    graph (a first stage's whole backward), which torch's compile cache then hands to other processes. Costs that
    reuse's memory saving. torch reads the setting when it compiles a graph and again at each backward that keeps the
    graph, so it stays off while compiled layers run, and only then; it is one flag of the process, hence counted.
    """
    global _keeping, _donated_before
    with _keeping_lock:
        if _keeping == 0:
            _donated_before = torch._functorch.config.donated_buffer
            torch._functorch.config.donated_buffer = False
        _keeping += 1
    released = False

    def release() -> None:
        global _keeping
        nonlocal released
        with _keeping_lock:
            if released:
                return
            released = True
            _keeping -= 1
            if _keeping == 0:
                torch._functorch.config.donated_buffer = _donated_before

    return release


_keeping = 0  # the callers of keep_compiled_saved_tensors that have not released it
_donated_before = True  # torch's setting before the first of them
_keeping_lock = threading.Lock()


def restore_compiled_call(module: nn.Module, previous: CompiledCall) -> None:
    """Undo :func:`compile_in_place`: the module runs ``previous`` again (its own call when ``None``)."""
    module._compiled_call_impl = previous


def abort_process_group(group: dist.ProcessGroup) -> None:
    """Abort ``group``'s pending operations so that the process can exit (torch has no public abort)."""
    dist.distributed_c10d._abort_process_group(group)


def reduce_unsharded_gradients(units: Sequence[FSDPModule]) -> None:
    """Reduce-scatter the gradients that FSDP2 ``units`` accumulated unsharded into their sharded ``.grad`` (added to
    what is there), as FSDP2 does at the end of a backward with gradient sync on.

    A pipeline stage runs one backward per micro-batch (and a split backward's weight passes outside any FSDP hook)
    with the sync off; FSDP2 has no public call that reduces afterwards, so this runs what its post-backward hooks
    run: each parameter group's ``post_backward``, then each root's final callback, which waits for the reductions.
    ``torch.distributed.pipelining``'s stage does the same (``perform_reduce_grad``). The sync is off again after.
    """
    states = [fully_shard.state(unit) for unit in units]  # type: ignore[attr-defined]
    for unit in units:
        unit.set_requires_gradient_sync(True, recurse=False)
        unit.set_is_last_backward(True)
    try:
        for state in states:
            for group in state._fsdp_param_groups:
                group.post_backward()
        for state in states:
            if state._is_root:
                state._root_post_backward_final_callback()
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(False, recurse=False)
            unit.set_is_last_backward(False)


def drop_unsharded_gradients(units: Sequence[FSDPModule]) -> None:
    """Forget the gradients FSDP2 ``units`` accumulated unsharded (a failed step's), which a next step would add to."""
    for unit in units:
        for group in fully_shard.state(unit)._fsdp_param_groups:  # type: ignore[attr-defined]
            for param in group.fsdp_params:
                param.unsharded_accumulated_grad = None
                if hasattr(param, "_unsharded_param"):
                    param.unsharded_param.grad = None
