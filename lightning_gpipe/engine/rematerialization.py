"""Re-materialization: keep only a cell's boundary input and recompute its forward during backward.

GPipe trades compute for memory: during the forward pass a checkpointed cell stores nothing but its input, and the
backward pass runs the cell's forward again to rebuild the activations it needs. The recomputation must see the same
random numbers (dropout masks) as the first forward, and it must not repeat side effects such as BatchNorm running
statistics; :func:`is_recomputing` lets a layer tell the two apart.

torch saves the CPU random state, and the state of every CUDA device that holds a tensor argument, which it finds by
walking the arguments with pytree. pytree treats dataclasses and most dict subclasses as leaves, both valid boundary
values here, so the value's tensors are handed over as separate arguments: otherwise a CUDA stage would recompute
with fresh dropout masks.

The ``"selective"`` mode keeps more than the input: the outputs of the matrix multiplications and attention kernels
(:data:`KEPT_OPS`), the expensive part of a Transformer layer, through torch's selective checkpoint contexts; the
replay recomputes only the cheap rest (norms, activations, dropout with its replayed random state, additions) and reads
the kept outputs back.

Non-reentrant checkpointing (``use_reentrant=False``) is used on purpose: reentrant checkpointing runs a nested
backward that DistributedDataParallel sees as a second gradient ready event ("Expected to mark a variable ready only
once"), the failure that kept torchgpipe and PyTorch's old ``Pipe`` from combining re-materialization with DDP.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from lightning_gpipe.engine.torch_compat import BatchNormBase
from lightning_gpipe.engine.tree import flatten, map_tensors, unflatten

__all__ = [
    "CHECKPOINT_MODES",
    "KEPT_OPS",
    "CheckpointMode",
    "checkpointed",
    "checkpoint_stop",
    "is_recomputing",
    "replayed_layer",
    "selective_checkpoint",
    "tracks_running_stats",
    "validate_mode",
]

CheckpointMode = Literal["always", "except_last", "selective", "never"]
"""Which micro-batches re-materialize: every one, all but the last (whose backward follows at once), all but the last
keeping their matrix multiplications' and attention's outputs (:data:`KEPT_OPS`), or none."""
CHECKPOINT_MODES: tuple[str, ...] = get_args(CheckpointMode)
"""The values of [`CheckpointMode`][lightning_gpipe.engine.rematerialization.CheckpointMode]: checks, messages."""

_aten = torch.ops.aten
KEPT_OPS: frozenset[Any] = frozenset(
    getattr(_aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    if hasattr(_aten, name)
)
"""The operators whose outputs ``checkpoint="selective"`` keeps: matrix multiplications (``nn.Linear`` and
``torch.matmul`` run as these) and the fused attention kernels of ``scaled_dot_product_attention``."""

_state = threading.local()


def validate_mode(mode: object) -> CheckpointMode:
    """Return ``mode`` if it names a re-materialization mode, else raise a ``ValueError`` that lists the valid ones."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(
            f"checkpoint={mode!r} is not a re-materialization mode; use one of {', '.join(map(repr, CHECKPOINT_MODES))}"
        )
    return mode  # type: ignore[return-value]


def checkpoint_stop(mode: CheckpointMode, num_microbatches: int, *, compiled: bool = False) -> int:
    """How many leading micro-batches are re-materialized: micro-batch ``i`` is checkpointed iff ``i < stop``.

    ``except_last`` spares the last micro-batch because its backward runs first, right after its forward, so
    recomputing it would buy no memory; with a single micro-batch it therefore checkpoints nothing. ``selective``
    spares it for the same reason, unless the layers are ``compiled``: each then re-materializes itself, inside its
    graph, on every micro-batch (see :mod:`lightning_gpipe.partition.compile`).
    """
    if compiled and mode == "selective":
        return num_microbatches
    spared = {"always": 0, "except_last": 1, "selective": 1, "never": num_microbatches}[mode]
    return num_microbatches - spared


def is_recomputing() -> bool:
    """True while a checkpointed cell is being recomputed for backward (in this thread)."""
    return getattr(_state, "recomputing", False)


@contextmanager
def _recomputing(function: Callable[..., Any]) -> Iterator[None]:
    previous = is_recomputing()
    _state.recomputing = True
    # Plain BatchNorm updates its running statistics on every training forward; the replay must not count twice.
    norms = [m for m in function.modules() if tracks_running_stats(m)] if isinstance(function, nn.Module) else []
    saved = [[buffer.clone() for buffer in _stat_buffers(norm)] for norm in norms]
    try:
        yield
    finally:
        _state.recomputing = previous
        for norm, buffers in zip(norms, saved, strict=True):
            for current, before in zip(_stat_buffers(norm), buffers, strict=True):
                current.copy_(before)


def tracks_running_stats(module: nn.Module) -> bool:
    """Whether ``module`` is a BatchNorm that moves running statistics in training (plain or deferred)."""
    return isinstance(module, BatchNormBase) and module.track_running_stats and module.running_mean is not None


def _stat_buffers(norm: nn.Module) -> list[torch.Tensor]:
    return [norm.running_mean, norm.running_var, norm.num_batches_tracked]  # type: ignore[list-item]


def _keep_matmuls(context: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` re-materialized on its own under the selective policy (:data:`KEPT_OPS` kept, the rest replayed).

    For compiled layers: ``torch.compile(selective_checkpoint(layer))`` puts the policy inside the compiled graph,
    where torch's partitioner keeps the kept operators' outputs and fuses the replay into the backward kernels. Around
    a compiled layer (as :func:`checkpointed` wraps a cell) the policy sees the layer as one call and keeps nothing of
    it. The random state is replayed as in :func:`checkpointed`; :func:`is_recomputing` is not set inside a graph.
    """

    def run(*args: Any) -> Any:
        return _torch_checkpoint(call, *args, use_reentrant=False, context_fn=_selective_contexts)

    return run


def _selective_contexts() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_keep_matmuls)


@contextmanager
def _entered(*managers: AbstractContextManager[Any]) -> Iterator[None]:
    with ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


def checkpointed(
    function: Callable[[Any], Any],
    value: Any,
    *,
    copy_input: bool = False,
    selective: bool = False,
    module: nn.Module | None = None,
) -> Any:
    """Run ``function(value)`` keeping only ``value``; the forward is replayed with the same RNG state in backward.

    The CPU generator and the generator of every CUDA device holding one of ``value``'s tensors are replayed,
    whatever containers hold them. With ``copy_input``, ``function`` gets a copy of ``value``'s tensors, for cells
    that modify their input in place: the replay must see the input as it was. With ``selective``, the outputs of
    :data:`KEPT_OPS` are kept too, and the replay reads them instead of computing them again (a cell must then not
    modify such an output in place: torch raises when the replay finds it changed).

    The replay puts back the BatchNorm running statistics of ``module`` (``function`` itself when it is a module):
    plain BatchNorm would otherwise count the replayed micro-batch twice.

    Callers decide when to checkpoint: in eval mode or under ``torch.no_grad`` there is no backward to recompute for,
    so they should call ``function`` directly.
    """
    leaves, spec = flatten(value)
    owner = module if module is not None else function

    def run(*arguments: Any) -> Any:
        rebuilt = unflatten(arguments, spec)
        return function(map_tensors(torch.clone, rebuilt) if copy_input else rebuilt)

    def contexts() -> tuple[Any, Any]:
        if not selective:
            return nullcontext(), _recomputing(owner)
        first, replay = _selective_contexts()
        return first, _entered(_recomputing(owner), replay)

    return _torch_checkpoint(run, *leaves, use_reentrant=False, preserve_rng_state=True, context_fn=contexts)


def replayed_layer(layer: nn.Module, call: Callable[..., Any]) -> Callable[..., Any]:
    """``call``, what ``layer`` runs, re-materialized on its own by :func:`checkpointed` under the selective policy.

    For a compiled layer whose graph cannot replay it alone: the replay sets :func:`is_recomputing`, so deferred
    BatchNorm's eager gathering does not count it twice, puts plain BatchNorm's statistics back, and starts from a copy
    of the input, which the layer may have changed in place. In eval mode or without grad it runs ``call`` as it is.
    """

    def run(*args: Any, **kwargs: Any) -> Any:
        if len(args) != 1 or kwargs or not torch.is_grad_enabled() or not layer.training:
            return call(*args, **kwargs)
        return checkpointed(call, args[0], copy_input=True, selective=True, module=layer)

    return run
