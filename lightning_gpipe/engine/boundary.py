"""Boundary values: what crosses from one stage to the next, and the gradients that come back.

A boundary value is a nest of tensors (tuples, lists, dicts, namedtuples, dataclasses; ``None`` leaves allowed), for
example an encoder output together with its attention mask. Its layout (structure, shapes, dtypes, which tensors need
gradients) is not hard-coded: the sender describes it in a header. Every gloo message costs a round trip, so the
header goes once per step, not per micro-batch:

- the first activation message of a step carries a header with the layout of that micro-batch's value and the sizes
  of all the step's micro-batches;
- every later micro-batch of the step is predicted from it: the same layout, with dim 0 of the tensors that carry the
  batch dimension resized to that micro-batch's size (a tensor wrapped in :class:`~lightning_gpipe.Unbatched` never
  is). Each is preceded by a small control message: nothing missing, or the leaves it lacks (``None``, as an
  attention mask that is ``None`` when nothing is padded), or "a new header follows";
- a new header follows when the prediction fails: a leaf appeared that the prediction has as ``None`` (no buffer
  awaits it), or a shape or the structure differs (sequences padded per micro-batch, a bias whose dim 0 only
  happened to equal the micro-batch size). Every receive already posted is then filled with placeholders (on
  devices, where receives are posted when needed, only that micro-batch's);
- after a shape changed, the step goes on *described*: each later micro-batch is preceded by its own layout message,
  and the receiver posts its tensors' receives once that is in. The sending link remembers it, so its later steps
  are described from their first micro-batch and no placeholders are sent again;
- gradients need no header: they go back for exactly the received tensors that require grad, with their shapes,
  one micro-batch after the other in the order of the receiving stage's backward passes.

The header also carries the sender's batch fingerprint (:mod:`lightning_gpipe.engine.fingerprint`), when the caller
gives one: the receiver compares it with its own, so stages that read different batches are caught at the first step.

Once the header is in, the receiver posts the receives of the whole step at once: gloo parks a send until its
receive is posted, and a receive posted only when needed costs a rendezvous per message, several times a receive
posted ahead (measured in docs/benchmarks/engine.md). A described step can post only one micro-batch ahead:
its layout message, behind the current micro-batch's tensors. Gradient receives can be posted ahead too
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

from lightning_gpipe.engine.errors import PipelineError
from lightning_gpipe.engine.fingerprint import Fingerprint, same_fingerprint
from lightning_gpipe.engine.transport import Transport
from lightning_gpipe.engine.tree import Spec, flatten, leaf_paths, unflatten
from lightning_gpipe.engine.unbatched import unbatched_leaves

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


def _describe(stage: int, value: Any, batch_size: int) -> tuple[_Layout, list[torch.Tensor | None]]:
    leaves, spec = flatten(value)
    layouts: list[TensorLayout | None] = []
    marked = unbatched_leaves(spec)
    for path, leaf, unbatched in zip(leaf_paths(spec, "output"), leaves, marked, strict=True):
        if leaf is None:
            layouts.append(None)
        elif isinstance(leaf, torch.Tensor):
            # A guess for unmarked tensors; a wrong one costs a described step (see the module), not a wrong value.
            batched = not unbatched and leaf.dim() > 0 and leaf.shape[0] == batch_size
            layouts.append(TensorLayout(tuple(leaf.shape), leaf.dtype, leaf.requires_grad, batched))
        else:
            raise TypeError(
                f"stage {stage} produced {path} of type {type(leaf).__name__}; only tensors (or None) can cross a "
                "stage boundary. Turn it into a tensor, or compute it inside the stage that uses it."
            )
    return (spec, tuple(layouts)), leaves


def _resize(layout: _Layout, size: int) -> _Layout:
    spec, tensors = layout
    return spec, tuple(None if entry is None else entry.resized(size) for entry in tensors)


class _Posted:
    """One micro-batch's posted receives: its control message (if it has one) and one buffer per tensor leaf.

    In a described step, the leaves' receives are posted only once the control message (the layout) is in.
    """

    def __init__(self, control: tuple[torch.Tensor, Callable[[], None]] | None) -> None:
        self.control = control
        self.leaves: list[tuple[torch.Tensor, Callable[[], None]] | None] = []

    def wait_all(self) -> None:
        """Wait for every receive, whatever arrives (used to drain receives made void by a new header)."""
        if self.control is not None:
            self.control[1]()
        for leaf in self.leaves:
            if leaf is not None:
                leaf[1]()


class ActivationLink:
    """Sends (or receives) one stage's outputs to (or from) a neighbour, one header per step."""

    def __init__(self, transport: Transport, peer: int) -> None:
        self.transport = transport
        self.peer = peer
        self._sizes: list[int] = []
        self._fingerprint: Fingerprint | None = None
        self._layout: _Layout | None = None  # the prediction's base: set by the step's header (or a later one)
        self._first = 0  # the micro-batch the last header came with: later ones have control messages
        self._described = False  # whether the micro-batches after the header's each carry their own layout
        # Sending side: a shape changed within a step of this link, so its steps start described (see the module).
        self._ragged = False
        self._posted: dict[int, _Posted] = {}
        self._nothing_missing: torch.Tensor | None = None  # the common control message, packed once

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
        self._first = 0
        self._described = False
        self._posted = {}

    def clear(self) -> None:
        """Forget the posted receives (after a failed step: the transport cannot take them back)."""
        self._posted = {}

    def _predicted(self, index: int) -> _Layout:
        assert self._layout is not None
        return _resize(self._layout, self._sizes[index])

    def _has_control(self, index: int) -> bool:
        return index > self._first

    # --- sending side

    def send(self, index: int, value: Any) -> None:
        """Send micro-batch ``index``'s output."""
        layout, leaves = _describe(self.stage, value, self._sizes[index])
        # The receiver allocates on the transport's device; a leaf left elsewhere (a CPU mask from a stage on a GPU)
        # would fail in the send, after the header is gone, and leave the peer waiting.
        leaves = [None if leaf is None else leaf.to(self.transport.device) for leaf in leaves]
        if self._layout is None:
            self._start(index, layout, self._fingerprint, described=self._ragged)
            self._send_leaves(index, leaves)
            return
        if self._described:
            self._send_header({"layout": layout}, f"the layout of micro-batch {index}")
            self._send_leaves(index, leaves)
            return
        predicted = self._predicted(index)
        entries, expected = layout[1], predicted[1]
        pairs = list(zip(entries, expected, strict=True)) if layout[0] == predicted[0] else None
        if pairs is None or any(ours is not None and theirs is not None and ours != theirs for ours, theirs in pairs):
            # A shape (or the structure) differs from the prediction: describe every later micro-batch, from this
            # step on (variable lengths per micro-batch come back step after step).
            self._ragged = True
            self._restart(index, layout, described=True)
            self._send_leaves(index, leaves)
            return
        if any(ours is not None and theirs is None for ours, theirs in pairs):
            # A leaf the receiver has no buffer for (a mask that was None so far): a new header describes it.
            self._restart(index, layout, described=False)
            self._send_leaves(index, leaves)
            return
        missing = [position for position, (ours, theirs) in enumerate(pairs) if ours != theirs]
        if missing:
            message = pickle.dumps({"missing": missing})
            if len(message) > HEADER_BYTES - _LENGTH_BYTES:  # a value of very many leaves: a header says it all
                self._restart(index, layout, described=False)
                self._send_leaves(index, leaves)
                return
            self.transport.send(_pack(message).to(self.transport.device), self.peer, _layout_of(index))
        else:
            if self._nothing_missing is None:
                self._nothing_missing = _pack(pickle.dumps({"missing": []})).to(self.transport.device)
            self.transport.send(self._nothing_missing, self.peer, _layout_of(index))
        for leaf, entry in zip(leaves, expected, strict=True):
            if entry is not None:  # the receiver posted a buffer for it: fill it, with a placeholder if it is None
                value = _placeholder(entry, self.transport.device) if leaf is None else leaf
                self.transport.send(value, self.peer, _activations_of(index))

    def _restart(self, index: int, layout: _Layout, described: bool) -> None:
        """Fill what the receiver posted for the rest of the step with placeholders, then send a new header."""
        self._send_message({"restart": True}, index)
        self._send_placeholders(index)
        if self.transport.posts_ahead:  # else the receiver has posted this micro-batch's receives only
            for later in range(index + 1, len(self._sizes)):
                self._send_message({"void": True}, later)
                self._send_placeholders(later)
        self._start(index, layout, None, described)

    def _start(self, index: int, layout: _Layout, fingerprint: Fingerprint | None, described: bool) -> None:
        self._layout = _resize(layout, self._sizes[0]) if self._sizes[index] != self._sizes[0] else layout
        self._first = index
        self._described = described
        header = {"layout": layout, "index": index, "sizes": self._sizes, "fingerprint": fingerprint}
        self._send_header({**header, "described": described}, _header_of(index))

    def _send_leaves(self, index: int, leaves: Sequence[torch.Tensor | None]) -> None:
        for leaf in leaves:
            if leaf is not None:
                self.transport.send(leaf, self.peer, _activations_of(index))

    def _send_placeholders(self, index: int) -> None:
        for entry in self._predicted(index)[1]:
            if entry is not None:
                self.transport.send(_placeholder(entry, self.transport.device), self.peer, _activations_of(index))

    def _send_message(self, payload: dict[str, Any], index: int) -> None:
        data = pickle.dumps(payload)
        assert len(data) <= HEADER_BYTES - _LENGTH_BYTES, "a control message outgrew its fixed buffer"
        self.transport.send(_pack(data).to(self.transport.device), self.peer, _layout_of(index))

    def _send_header(self, payload: dict[str, Any], what: str) -> None:
        data = pickle.dumps(payload)
        self.transport.send(_pack(data).to(self.transport.device), self.peer, what)
        if len(data) > HEADER_BYTES - _LENGTH_BYTES:
            rest = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.transport.device)
            self.transport.send(rest, self.peer, what)

    # --- receiving side

    def recv(self, index: int) -> Any:
        """Receive micro-batch ``index``'s input; float tensors that required grad upstream are leaves that do too."""
        if self._layout is None:
            self._receive_header(index)
            if self.transport.posts_ahead:
                self._post_from(index)
        if index not in self._posted:  # posted when needed (device streams), in the same forward order
            self._posted[index] = self._post(index)
        posted = self._posted.pop(index)
        missing: set[int] = set()
        assert self._layout is not None
        # The header's micro-batch (or a predicted one) at its own size: a header sent at a micro-batch of another size
        # than the step's first is kept resized to the first's. A described step's later ones bring their layout.
        layout = self._predicted(index)
        if posted.control is not None:
            buffer, wait = posted.control
            wait()
            message = self._read(buffer, _layout_of(index))
            if self._described:
                # Its receives are posted now that its layout is known; the next micro-batch's layout message can
                # be posted behind them (the peer sends layout, tensors, next layout, ...).
                layout = message["layout"]
                posted.leaves = self._post_leaves(index, layout)
                if self.transport.posts_ahead and index + 1 < len(self._sizes):
                    self._posted[index + 1] = self._post(index + 1)
            elif message.get("restart"):
                # The sender has filled every receive posted for this step with placeholders; a header follows.
                # (A wait is never repeated: on gloo a second wait of a receive waits for another message.)
                for leaf in posted.leaves:
                    if leaf is not None:
                        leaf[1]()
                for later in sorted(self._posted):
                    self._posted.pop(later).wait_all()
                self._receive_header(index)
                if self.transport.posts_ahead:
                    self._post_from(index)
                return self.recv(index)
            else:
                missing = set(message["missing"])
        spec, entries = layout
        leaves: list[torch.Tensor | None] = []
        for position, (entry, receive) in enumerate(zip(entries, posted.leaves, strict=True)):
            if entry is None or receive is None:
                leaves.append(None)
                continue
            buffer, wait = receive
            wait()
            leaves.append(None if position in missing else buffer.requires_grad_(entry.requires_grad))
        return unflatten(leaves, spec)

    def post_rest(self, after: int) -> None:
        """Post the receives of the step's micro-batches after ``after`` that are not posted yet.

        For a receiver about to take other messages from the same peer (the further calls of a decoding step, which
        the peer sends after this step's): without, those receives would be matched with this step's messages.
        """
        if self._layout is None:
            return
        for index in range(after + 1, len(self._sizes)):
            if index not in self._posted:
                self._posted[index] = self._post(index)

    def _post_from(self, first: int) -> None:
        # The sender sends the step's micro-batches in forward order, starting with this one. Described steps post
        # one layout message ahead only: the tensors' receives wait for their layout.
        last = first + 2 if self._described else len(self._sizes)
        for index in range(first, min(last, len(self._sizes))):
            self._posted[index] = self._post(index)

    def _post(self, index: int) -> _Posted:
        control = None
        if self._has_control(index):
            buffer = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.transport.device)
            control = (buffer, self.transport.post_recv(buffer, self.peer, _layout_of(index)))
        posted = _Posted(control)
        if control is None or not self._described:
            posted.leaves = self._post_leaves(index, self._predicted(index))  # at its own size, as in recv
        return posted

    def _post_leaves(self, index: int, layout: _Layout) -> list[tuple[torch.Tensor, Callable[[], None]] | None]:
        receives: list[tuple[torch.Tensor, Callable[[], None]] | None] = []
        for entry in layout[1]:
            if entry is None:
                receives.append(None)
                continue
            buffer = torch.empty(entry.shape, dtype=entry.dtype, device=self.transport.device)
            receives.append((buffer, self.transport.post_recv(buffer, self.peer, _activations_of(index))))
        return receives

    def _read(self, header: torch.Tensor, what: str) -> dict[str, Any]:
        """The payload of a received header-format message, receiving its continuation if it did not fit."""
        raw = header.cpu()
        length = int.from_bytes(bytes(raw[:_LENGTH_BYTES].tolist()), "little")
        if length <= HEADER_BYTES - _LENGTH_BYTES:
            data = _unpack(raw)
        else:
            payload = torch.empty(length, dtype=torch.uint8, device=self.transport.device)
            self.transport.recv(payload, self.peer, what)
            data = bytes(payload.cpu().tolist())
        message: dict[str, Any] = pickle.loads(data)
        return message

    def _receive_header(self, index: int) -> None:
        what = _header_of(index)
        header = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.transport.device)
        self.transport.recv(header, self.peer, what)
        message = self._read(header, what)
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
        self._first = index
        self._described = bool(message.get("described"))


class GradientLink:
    """Sends (or receives) the gradients of a boundary value's grad-requiring tensors; their layout is known.

    On the receiving side, :meth:`post` starts a micro-batch's receives ahead of its backward and :meth:`recv` waits
    for them. Receives take the peer's messages in posting order, so micro-batches must be posted in the order the peer
    sends their gradients: the peer's backward order.
    """

    def __init__(self, transport: Transport, peer: int) -> None:
        self.transport = transport
        self.peer = peer
        # Per micro-batch: receive buffer, its wait, and the device of the output it is the gradient of.
        self._posted: dict[int, list[tuple[torch.Tensor, Callable[[], None], torch.device]]] = {}

    def send(
        self, inputs: Sequence[torch.Tensor], index: int, grads: Sequence[torch.Tensor | None] | None = None
    ) -> None:
        """Send the gradients of ``inputs`` (micro-batch ``index``'s leaves that require grad): ``grads`` where given,
        else those accumulated in ``.grad``; zeros where none arrived."""
        for k, tensor in enumerate(inputs):
            grad = tensor.grad if grads is None else grads[k]
            self.transport.send(torch.zeros_like(tensor) if grad is None else grad, self.peer, _gradients_of(index))

    @property
    def posted(self) -> list[int]:
        """The micro-batches whose gradients are posted and not yet received, in posting order."""
        return list(self._posted)

    def post(self, outputs: Sequence[torch.Tensor], index: int) -> None:
        """Start receiving the gradients of ``outputs``, micro-batch ``index``'s tensors that require grad."""
        assert index not in self._posted, f"the gradients of micro-batch {index} are posted twice"
        posted = []
        for tensor in outputs:
            # Contiguous whatever the output's strides (channels_last, a transpose): gloo and NCCL receive into
            # contiguous buffers only, and autograd accepts a gradient of any strides for the output.
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.transport.device)
            wait = self.transport.post_recv(buffer, self.peer, _gradients_of(index))
            posted.append((buffer, wait, tensor.device))
        self._posted[index] = posted

    def recv(self, outputs: Sequence[torch.Tensor], index: int) -> list[torch.Tensor]:
        """The gradients of ``outputs``: waits for the receives :meth:`post` started, or receives them now."""
        if index not in self._posted:
            # Posted now, after any micro-batch still outstanding: the caller keeps the peer's order.
            self.post(outputs, index)
        grads = []
        for buffer, wait, device in self._posted.pop(index):
            wait()
            grads.append(buffer.to(device))  # an output left on the CPU by a stage on a GPU gets a CPU gradient
        return grads

    def clear(self) -> None:
        """Forget the posted receives (after a failed step: the transport cannot take them back)."""
        self._posted.clear()


# How errors name each message, on the sending side as on the receiving one (the transport says which).


def _header_of(index: int) -> str:
    return f"the step header (micro-batch {index})"


def _layout_of(index: int) -> str:
    return f"the layout of micro-batch {index}"


def _activations_of(index: int) -> str:
    return f"activations of micro-batch {index}"


def _gradients_of(index: int) -> str:
    return f"gradients of micro-batch {index}"


def _pack(data: bytes) -> torch.Tensor:
    """A ``HEADER_BYTES`` buffer: the length of ``data``, then ``data`` itself if it fits."""
    message = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    message[:_LENGTH_BYTES] = torch.tensor(list(len(data).to_bytes(_LENGTH_BYTES, "little")), dtype=torch.uint8)
    if len(data) <= HEADER_BYTES - _LENGTH_BYTES:
        message[_LENGTH_BYTES : _LENGTH_BYTES + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return message


def _unpack(message: torch.Tensor) -> bytes:
    """The data that :func:`_pack` put in ``message`` (a CPU buffer; the data fitted)."""
    length = int.from_bytes(bytes(message[:_LENGTH_BYTES].tolist()), "little")
    return bytes(message[_LENGTH_BYTES : _LENGTH_BYTES + length].tolist())


def _placeholder(entry: TensorLayout, device: torch.device) -> torch.Tensor:
    """What fills a receive posted for a tensor that the micro-batch does not have: the receiver discards it."""
    return torch.zeros(entry.shape, dtype=entry.dtype, device=device)


def _show_fingerprint(fingerprint: Fingerprint) -> str:
    return "[" + ", ".join(f"{tuple(shape)} {dtype} {checksum:.6g}" for shape, dtype, checksum in fingerprint) + "]"


def _show(layout: _Layout) -> str:
    _spec, entries = layout
    return "[" + ", ".join("None" if e is None else f"{tuple(e.shape)} {e.dtype}" for e in entries) + "]"
