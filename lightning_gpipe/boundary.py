"""Boundary values: what crosses from one stage to the next, and the gradients that come back.

A boundary value is a nest of tensors (tuples, lists, dicts, namedtuples, dataclasses; ``None`` leaves allowed), for
example an encoder output together with its attention mask. Its layout (structure, shapes, dtypes, which tensors need
gradients) is not hard-coded: the sender describes it in a header. Messages cost ~150 µs each on gloo, so the header
goes once per step, not per micro-batch:

- the first activation message of a step carries a header with the layout of that micro-batch's value and the sizes
  of all the step's micro-batches;
- every later micro-batch of the step is predicted from it: the same layout, with dim 0 of the tensors that carry the
  batch dimension resized to that micro-batch's size. The sender checks the prediction and raises if it fails;
- gradients need no header: they go back for exactly the received tensors that require grad, with their shapes,
  one micro-batch after the other in the order of the receiving stage's backward passes.

The header also carries the sender's batch fingerprint (:mod:`lightning_gpipe.fingerprint`), when the caller gives
one: the receiver compares it with its own, so stages that read different batches are caught at the first step.

Once the header is in, the receiver posts the receives of the whole step at once: gloo parks a send until its
receive is posted, and a receive posted only when needed costs a rendezvous per message (~100 µs against ~20 µs for a
4 KiB message posted ahead, measured on these machines). Gradient receives can be posted ahead too
(:meth:`GradientLink.post`), in the order the peer sends them, once the outputs they are the gradients of exist.

Header wire format: a fixed ``HEADER_BYTES`` uint8 buffer holding the payload length (8 bytes, little endian) and the
pickled payload when it fits, else the payload follows as a second message. Pickle is only ever exchanged between the
ranks of one job, which already trust each other with their code.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_gpipe.errors import PipelineError
from lightning_gpipe.fingerprint import Fingerprint, same_fingerprint
from lightning_gpipe.structure import Spec, flatten, leaf_paths, unflatten
from lightning_gpipe.transport import Transport

__all__ = ["HEADER_BYTES", "ActivationLink", "GradientLink", "TensorLayout"]

HEADER_BYTES = 1024
"""Size in bytes of the header buffer sent before a step's first activation: payload length, then the layout."""
_LENGTH_BYTES = 8


@dataclass(frozen=True)
class TensorLayout:
    """Shape, dtype and autograd flag of one tensor leaf; ``batched`` if dim 0 is the micro-batch dimension."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    batched: bool

    def resized(self, size: int) -> TensorLayout:
        """This layout for a micro-batch of ``size`` samples."""
        if not self.batched:
            return self
        return TensorLayout((size, *self.shape[1:]), self.dtype, self.requires_grad, True)


_Layout = tuple[Spec, tuple[TensorLayout | None, ...]]  # structure, and one entry per leaf (None for a None leaf)


def _describe(stage: int, value: Any, batch_size: int) -> tuple[_Layout, list[torch.Tensor]]:
    leaves, spec = flatten(value)
    layouts: list[TensorLayout | None] = []
    for path, leaf in zip(leaf_paths(spec, "output"), leaves, strict=True):
        if leaf is None:
            layouts.append(None)
        elif isinstance(leaf, torch.Tensor):
            batched = leaf.dim() > 0 and leaf.shape[0] == batch_size
            layouts.append(TensorLayout(tuple(leaf.shape), leaf.dtype, leaf.requires_grad, batched))
        else:
            raise TypeError(
                f"stage {stage} produced {path} of type {type(leaf).__name__}; only tensors (or None) can cross a "
                "stage boundary. Turn it into a tensor, or compute it inside the stage that uses it."
            )
    return (spec, tuple(layouts)), [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _resize(layout: _Layout, size: int) -> _Layout:
    spec, tensors = layout
    return spec, tuple(None if entry is None else entry.resized(size) for entry in tensors)


class ActivationLink:
    """Sends (or receives) one stage's outputs to (or from) a neighbour, one header per step."""

    def __init__(self, transport: Transport, peer: int) -> None:
        self.transport = transport
        self.peer = peer
        self._sizes: list[int] = []
        self._fingerprint: Fingerprint | None = None
        self._layout: _Layout | None = None  # layout of the step's first micro-batch, set by its header
        self._posted: dict[int, list[tuple[torch.Tensor | None, Callable[[], None] | None]]] = {}

    @property
    def stage(self) -> int:
        """The index of the stage this link belongs to."""
        return self.transport.stage

    @property
    def posted(self) -> list[int]:
        """The micro-batches whose activations are posted and not yet received."""
        return list(self._posted)

    def begin_step(self, sizes: Sequence[int], fingerprint: Fingerprint | None = None) -> None:
        """Start a step whose micro-batches have ``sizes`` samples; the next message carries a header.

        ``fingerprint`` summarizes this stage's batch; when both neighbours give one, the receiver checks they match.
        """
        self._sizes = list(sizes)
        self._fingerprint = fingerprint
        self._layout = None
        self._posted = {}

    def clear(self) -> None:
        """Forget the posted receives (after a failed step: the transport cannot take them back)."""
        self._posted = {}

    def _predicted(self, index: int) -> _Layout:
        assert self._layout is not None
        return _resize(self._layout, self._sizes[index])

    # --- sending side

    def send(self, index: int, value: Any) -> None:
        """Send micro-batch ``index``'s output."""
        layout, tensors = _describe(self.stage, value, self._sizes[index])
        if self._layout is None:
            self._layout = _resize(layout, self._sizes[0]) if self._sizes[index] != self._sizes[0] else layout
            self._send_header(
                {"layout": layout, "index": index, "sizes": self._sizes, "fingerprint": self._fingerprint}
            )
        elif layout != self._predicted(index):
            raise PipelineError(
                self.stage,
                f"the output of micro-batch {index} has layout {_show(layout)}, but the step's first micro-batch "
                f"implies {_show(self._predicted(index))}. Within one step, stage outputs may differ only in the "
                "micro-batch dimension (dim 0); pad variable-length data to one shape per batch.",
            )
        for tensor in tensors:
            self.transport.send(tensor, self.peer)

    def _send_header(self, payload: dict[str, Any]) -> None:
        data = pickle.dumps(payload)
        header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        header[:_LENGTH_BYTES] = torch.tensor(list(len(data).to_bytes(_LENGTH_BYTES, "little")), dtype=torch.uint8)
        fits = len(data) <= HEADER_BYTES - _LENGTH_BYTES
        if fits:
            header[_LENGTH_BYTES : _LENGTH_BYTES + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.transport.send(header.to(self.transport.device), self.peer)
        if not fits:
            self.transport.send(
                torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.transport.device), self.peer
            )

    # --- receiving side

    def recv(self, index: int) -> Any:
        """Receive micro-batch ``index``'s input; float tensors that required grad upstream are leaves that do too."""
        if self._layout is None:
            self._receive_header(index)
            # The sender sends the step's micro-batches in forward order, starting with this one.
            if self.transport.posts_ahead:
                for later in range(index, len(self._sizes)):
                    self._posted[later] = self._post(later)
        if index not in self._posted:  # posted when needed (device streams), in the same forward order
            self._posted[index] = self._post(index)
        spec, entries = self._predicted(index)
        leaves: list[torch.Tensor | None] = []
        for entry, (buffer, wait) in zip(entries, self._posted.pop(index), strict=True):
            if buffer is None or wait is None or entry is None:
                leaves.append(None)
                continue
            wait()
            leaves.append(buffer.requires_grad_(entry.requires_grad))
        return unflatten(leaves, spec)

    def _post(self, index: int) -> list[tuple[torch.Tensor | None, Callable[[], None] | None]]:
        posted: list[tuple[torch.Tensor | None, Callable[[], None] | None]] = []
        for entry in self._predicted(index)[1]:
            if entry is None:
                posted.append((None, None))
                continue
            buffer = torch.empty(entry.shape, dtype=entry.dtype, device=self.transport.device)
            posted.append((buffer, self.transport.post_recv(buffer, self.peer, f"activations of micro-batch {index}")))
        return posted

    def _receive_header(self, index: int) -> None:
        what = f"the step header (micro-batch {index})"
        header = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.transport.device)
        self.transport.recv(header, self.peer, what)
        raw = header.cpu()
        length = int.from_bytes(bytes(raw[:_LENGTH_BYTES].tolist()), "little")
        if length <= HEADER_BYTES - _LENGTH_BYTES:
            data = bytes(raw[_LENGTH_BYTES : _LENGTH_BYTES + length].tolist())
        else:
            payload = torch.empty(length, dtype=torch.uint8, device=self.transport.device)
            self.transport.recv(payload, self.peer, what)
            data = bytes(payload.cpu().tolist())
        message = pickle.loads(data)
        if message["sizes"] != self._sizes or message["index"] != index:
            raise PipelineError(
                self.stage,
                f"stage {self.peer} splits this step into micro-batches of sizes {message['sizes']} and sends "
                f"micro-batch {message['index']} first, but this stage expects sizes {self._sizes} starting with "
                f"micro-batch {index}. Every stage of a pipeline must see the same batch and the same chunks: use "
                "the data-parallel sampler only (not one per stage) and the same settings on every rank.",
            )
        theirs = message.get("fingerprint")
        if theirs is not None and self._fingerprint is not None and not same_fingerprint(theirs, self._fingerprint):
            raise PipelineError(
                self.stage,
                f"stage {self.peer} and this stage read different batches at this step (the batch fingerprints, "
                f"shape, dtype and checksum per tensor, are {_show_fingerprint(theirs)} there and "
                f"{_show_fingerprint(self._fingerprint)} here). Every stage of a pipeline must read the same batches "
                "in the same order: keep Lightning's distributed sampler (use_distributed_sampler=True), seed any "
                "shuffling identically on every rank, and do not make the data depend on the rank. If the stages "
                "read different inputs on purpose (random augmentation seeded per rank, used by the first stage "
                "only), turn the check off with GPipeStrategy(verify_batches=False).",
            )
        layout = message["layout"]
        self._layout = _resize(layout, self._sizes[0]) if self._sizes[index] != self._sizes[0] else layout


class GradientLink:
    """Sends (or receives) the gradients of a boundary value's grad-requiring tensors; their layout is known.

    On the receiving side, :meth:`post` starts a micro-batch's receives ahead of its backward and :meth:`recv` waits
    for them. Receives take the peer's messages in posting order, so micro-batches must be posted in the order the peer
    sends their gradients: the peer's backward order.
    """

    def __init__(self, transport: Transport, peer: int) -> None:
        self.transport = transport
        self.peer = peer
        self._posted: dict[int, list[tuple[torch.Tensor, Callable[[], None]]]] = {}

    def send(self, inputs: Sequence[torch.Tensor]) -> None:
        """Send the gradients accumulated in ``inputs`` (leaves that require grad); zeros where none arrived."""
        for tensor in inputs:
            self.transport.send(torch.zeros_like(tensor) if tensor.grad is None else tensor.grad, self.peer)

    @property
    def posted(self) -> list[int]:
        """The micro-batches whose gradients are posted and not yet received, in posting order."""
        return list(self._posted)

    def post(self, outputs: Sequence[torch.Tensor], index: int) -> None:
        """Start receiving the gradients of ``outputs``, micro-batch ``index``'s tensors that require grad."""
        assert index not in self._posted, f"the gradients of micro-batch {index} are posted twice"
        posted = []
        for tensor in outputs:
            buffer = torch.empty_like(tensor, device=self.transport.device, requires_grad=False)
            posted.append((buffer, self.transport.post_recv(buffer, self.peer, f"gradients of micro-batch {index}")))
        self._posted[index] = posted

    def recv(self, outputs: Sequence[torch.Tensor], index: int) -> list[torch.Tensor]:
        """The gradients of ``outputs``: waits for the receives :meth:`post` started, or receives them now."""
        if index not in self._posted:
            # Posted now, after any micro-batch still outstanding: the caller keeps the peer's order.
            self.post(outputs, index)
        grads = []
        for buffer, wait in self._posted.pop(index):
            wait()
            grads.append(buffer)
        return grads

    def clear(self) -> None:
        """Forget the posted receives (after a failed step: the transport cannot take them back)."""
        self._posted.clear()


def _show_fingerprint(fingerprint: Fingerprint) -> str:
    return "[" + ", ".join(f"{tuple(shape)} {dtype} {checksum:.6g}" for shape, dtype, checksum in fingerprint) + "]"


def _show(layout: _Layout) -> str:
    _spec, entries = layout
    return "[" + ", ".join("None" if e is None else f"{tuple(e.shape)} {e.dtype}" for e in entries) + "]"
