"""Pretrained weights read on first use: a zoo model built on the meta device while its weights wait in a reader.

``zoo.load_pretrained`` reads no weight. It builds the model with its parameters and persistent buffers on the meta
device (:func:`parameters_on_meta`), while what a module computes for itself (rotary tables, causal masks) is made for
real and what no file holds (a new head, LoRA adapters) is initialized as the model's own code does; the model then
waits for a :class:`~zoo.weights.CheckpointReader` (:meth:`DeferredWeights.defer_weights`):

- under ``GPipeStrategy`` the strategy claims the reader (``claim_weights_reader``, the duck-typed protocol of
  ``lightning_gpipe.partition.reader``) and every process reads its own stage's tensors only;
- anywhere else the first use reads them all, onto the CPU: Lightning's ``configure_model`` hook (every other
  strategy), calling the model, ``model.layers`` or one of its layers, ``state_dict``, ``load_state_dict``, and
  ``.to()``, ``.cuda()``, ``.float()`` and the like; :meth:`DeferredWeights.load_weights` reads them at once.

Reading keeps each ``nn.Parameter`` object (``torch.utils.swap_tensors``), so an optimizer built on the meta
parameters holds the read ones.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from zoo.weights import CheckpointReader

__all__ = ["DeferredWeights", "allocate_unread", "initialize_unread", "parameters_on_meta"]


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules with their parameters and persistent buffers on the meta device and their other buffers on the
    CPU: what a checkpoint holds costs no memory, what a module computes for itself (rotary tables) is computed.

    As ``accelerate.init_empty_weights(include_buffers=False)``, with the persistent buffers (BatchNorm statistics)
    on meta too, since a checkpoint holds them. Tensors are still created on the CPU first, but a parameter created
    empty, as modules create them, is never written (so never resident) before it moves.
    """
    register_parameter = nn.Module.register_parameter
    register_buffer = nn.Module.register_buffer

    def parameter(module: nn.Module, name: str, value: nn.Parameter | None) -> None:
        register_parameter(module, name, value)
        if value is not None and not value.is_meta:
            extra = {**vars(value), "requires_grad": value.requires_grad}
            module._parameters[name] = type(value)(value.to("meta"), **extra)

    def buffer(module: nn.Module, name: str, value: Tensor | None, persistent: bool = True) -> None:
        register_buffer(module, name, value, persistent)
        if value is not None and persistent and not value.is_meta:
            module._buffers[name] = value.to("meta")

    nn.Module.register_parameter = parameter  # type: ignore[method-assign,assignment]
    nn.Module.register_buffer = buffer  # type: ignore[method-assign,assignment]
    try:
        with torch.device("cpu"):  # a user's `with torch.device("meta")` would put the computed buffers on meta
            yield
    finally:
        nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
        nn.Module.register_buffer = register_buffer  # type: ignore[method-assign]


def _slot(module: nn.Module, name: str) -> tuple[dict[str, Any], str]:
    path, _, attribute = name.rpartition(".")
    owner = module.get_submodule(path)
    return (owner._parameters if attribute in owner._parameters else owner._buffers), attribute


def _tensor(module: nn.Module, name: str) -> Tensor | None:
    table, attribute = _slot(module, name)
    return table[attribute]


def _move(module: nn.Module, names: Iterable[str], device: str) -> None:
    """Give the tensors ``names`` of ``module`` uninitialized memory on ``device`` unless they are there, keeping each
    object (an optimizer built on the parameters, a tie, still holds them)."""
    done: set[int] = set()
    for name in names:
        tensor = _tensor(module, name)
        if tensor is None or tensor.device.type == device or id(tensor) in done:
            continue
        done.add(id(tensor))
        empty = torch.empty_like(tensor, device=device)
        torch.utils.swap_tensors(
            tensor, nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
        )


def allocate_unread(module: nn.Module, keys: Iterable[str]) -> list[str]:
    """Give those of the tensors ``keys`` of ``module`` that are on the meta device uninitialized CPU memory (each
    object kept), for their own initialization to fill; returns their keys."""
    keys = [key for key in keys if (tensor := _tensor(module, key)) is not None and tensor.is_meta]
    _move(module, keys, "cpu")
    return keys


def initialize_unread(module: nn.Module, keys: Iterable[str], initialize: Callable[[nn.Module], None]) -> None:
    """Allocate the meta tensors ``keys`` of ``module`` that no file holds, and run ``initialize`` on each module that
    owns one (its ``reset_parameters``, the library's own initializer): a new head starts as the model's code starts
    it, on every rank alike, whether it is then trained whole or in a pipeline."""
    keys = allocate_unread(module, keys)
    with torch.no_grad():
        for path in sorted({key.rpartition(".")[0] for key in keys}):
            initialize(module.get_submodule(path))


_READING = threading.RLock()


class _ReadBeforeCall:
    """A forward pre-hook that reads its owner's pending weights. A copy of a hooked layer made without its owner
    (a profiler's copy) holds no owner: the weights of a layer copied alone stay the copy's business."""

    def __init__(self, owner: DeferredWeights | None) -> None:
        self.owner = owner

    def __call__(self, module: nn.Module, args: Any) -> None:
        if self.owner is not None:
            self.owner.load_weights()

    def __deepcopy__(self, memo: dict[int, Any]) -> _ReadBeforeCall:
        return _ReadBeforeCall(memo.get(id(self.owner)))


class DeferredWeights(nn.Module):
    """A module whose weights may wait in a reader until their first use; mixed into every zoo model (``ZooModule``).

    It has ``layers`` (the flat sequence). Nothing waits unless :meth:`defer_weights` was called.
    """

    layers: nn.Module
    _weights_reader: CheckpointReader | None = None

    def defer_weights(self, reader: CheckpointReader) -> None:
        """Leave the tensors ``reader`` provides to be read on first use, or per stage; those not on the meta device
        yet move there (their memory goes back)."""
        _move(self, reader.keys(), "meta")
        self._weights_reader = reader
        for module in self._hooked():
            module.register_forward_pre_hook(_ReadBeforeCall(self))

    @property
    def weights_pending(self) -> bool:
        """Whether pretrained weights wait to be read (they are on the meta device until then)."""
        return self._weights_reader is not None

    @property
    def weights_source(self) -> str | None:
        """Where the pending weights are read from; ``None`` when none wait."""
        return None if self._weights_reader is None else self._weights_reader.source

    def load_weights(self) -> DeferredWeights:
        """Read the pending weights now, onto the CPU (nothing when none wait); returns the model."""
        with _READING:  # layers called from several threads (run_in_threads) wait for one read
            reader = self._weights_reader
            if reader is None:
                return self
            keys = list(reader.keys())
            _move(self, keys, "cpu")
            state = nn.Module.state_dict(self, keep_vars=True)
            with torch.no_grad():
                reader.read_into({key: state[key].detach() for key in keys})
            self._weights_reader = None
        self._unhook()
        left = [key for key, tensor in nn.Module.state_dict(self, keep_vars=True).items() if tensor.is_meta]
        assert not left, f"no file holds {left[:4]}, and nothing initialized them"
        return self

    def claim_weights_reader(self) -> CheckpointReader | None:
        """Hand the pending weights' reader over (``GPipeStrategy`` does, in ``connect``), and never read them here:
        the caller reads the tensors it needs (``lightning_gpipe.partition.reader``). ``None`` when none wait."""
        reader, self._weights_reader = self._weights_reader, None
        self._unhook()
        return reader

    def read_pending(self, module: nn.Module, prefix: str) -> list[str]:
        """Read, from the pending weights, the tensors of ``module`` (whose keys start with ``prefix``) onto the CPU,
        leaving the rest pending; returns their keys, for :meth:`release`. What an export reads a group at a time."""
        assert self._weights_reader is not None
        provided = self._weights_reader.keys()
        state = nn.Module.state_dict(module, prefix=prefix, keep_vars=True)
        keys = [key for key in state if key in provided and state[key].is_meta]
        _move(module, [key[len(prefix) :] for key in keys], "cpu")
        state = nn.Module.state_dict(module, prefix=prefix, keep_vars=True)
        with torch.no_grad():
            self._weights_reader.read_into({key: state[key].detach() for key in keys})
        return keys

    def release(self, module: nn.Module, keys: Iterable[str], prefix: str) -> None:
        """Put tensors :meth:`read_pending` read back on the meta device (still pending): their memory goes back."""
        _move(module, [key[len(prefix) :] for key in keys], "meta")

    def _hooked(self) -> list[nn.Module]:
        layers = getattr(self, "layers", None)
        return [self, *([layers, *layers.children()] if isinstance(layers, nn.Module) else [])]

    def _unhook(self) -> None:
        for module in self._hooked():
            for key, hook in list(module._forward_pre_hooks.items()):
                if isinstance(hook, _ReadBeforeCall):
                    del module._forward_pre_hooks[key]

    # The first uses outside a pipeline.

    def configure_model(self) -> None:
        """Lightning's hook before ``setup`` under every strategy: the pending weights are read here, unless a
        pipeline strategy claimed them first."""
        self.load_weights()

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Any:
        self.load_weights()
        return super()._apply(fn, recurse)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self.load_weights()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        self.load_weights()
        return super().load_state_dict(state_dict, strict, assign)

    def extra_repr(self) -> str:
        pending = self.weights_source
        return "" if pending is None else f"weights: read on first use from {pending!r} (load_weights() reads them now)"
